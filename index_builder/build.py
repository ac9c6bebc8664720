"""`duet build`: read a corpus -> encode in batches -> write a version -> point `current` at it."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import faiss
import numpy as np
from PIL import Image
from tqdm import tqdm

from duet import indexio
from index_builder.corpus import CorpusError, CorpusItem, read_manifest
from models.protocols import JointEncoder

log = logging.getLogger("duet.build")


@dataclass
class BuildReport:
    """What a build produced, for the CLI to print."""

    version: str
    path: Path
    images: int
    texts: int
    seconds: float
    skipped: list[str] = field(default_factory=list)


def _load_image(item: CorpusItem, corpus: Path) -> tuple[Image.Image, bytes]:
    assert item.image is not None
    try:
        data = item.image.read_bytes()
        img = Image.open(io.BytesIO(data))
        img.load()
        return img.convert("RGB"), data
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise CorpusError(corpus, item.line,
                          f"cannot read image {item.image_rel!r} ({item.image}): {exc}") from exc


def build(corpus: Path, out: Path, model: JointEncoder, batch_size: int = 64,
          skip_bad: bool = False, progress: bool = True) -> BuildReport:
    """Encode `corpus` with `model` into `out/<version>/` and make it `out/current`."""
    t0 = time.perf_counter()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    skipped: list[str] = []

    def bad(err: CorpusError) -> None:
        if not skip_bad:
            raise err
        skipped.append(str(err))
        log.warning("skipping %s", err)

    items: list[CorpusItem] = []
    for entry in read_manifest(Path(corpus)):
        if isinstance(entry, CorpusError):
            bad(entry)
        else:
            items.append(entry)

    content = hashlib.sha256()
    kept: list[CorpusItem] = []
    img_vecs: list[np.ndarray] = []
    img_toks: list[np.ndarray] = []
    with_images = [it for it in items if it.image is not None]
    bar = tqdm(total=len(with_images), desc="encoding images", unit="img", disable=not progress)
    pending: list[tuple[CorpusItem, Image.Image]] = []

    def flush() -> None:
        if pending:
            vecs, toks = model.encode_images([img for _, img in pending])
            img_vecs.append(vecs)
            img_toks.append(toks)
            bar.update(len(pending))
            pending.clear()

    for it in items:
        if it.image is None:
            kept.append(it)
            continue
        try:
            img, data = _load_image(it, Path(corpus))
        except CorpusError as err:
            bad(err)
            bar.update(1)
            continue
        content.update(hashlib.sha256(data).digest())
        kept.append(it)
        pending.append((it, img))
        if len(pending) >= batch_size:
            flush()
    flush()
    bar.close()

    image_rows = [indexio.ImageRow(it.id, it.image_rel, it.meta) for it in kept if it.image]
    text_rows = [indexio.TextRow(f"{it.id}#{n}", cap, it.id if it.image else None, it.meta)
                 for it in kept for n, cap in enumerate(it.captions)]
    for it in kept:
        content.update(json.dumps([it.id, it.image_rel, it.captions], sort_keys=True).encode())
    txt_vecs: list[np.ndarray] = []
    text_batch = max(batch_size, 256)
    for s in tqdm(range(0, len(text_rows), text_batch), desc="encoding texts", unit="batch",
                  disable=not progress):
        txt_vecs.append(model.encode_texts([r.text for r in text_rows[s : s + text_batch]]))

    dim = model.dim
    ivecs = np.concatenate(img_vecs) if img_vecs else np.zeros((0, dim), np.float32)
    itoks = (np.concatenate(img_toks) if img_toks
             else np.zeros((0, *model.token_shape), np.float16))
    tvecs = np.concatenate(txt_vecs) if txt_vecs else np.zeros((0, dim), np.float32)

    digest = content.hexdigest()
    version = _new_version(out, digest)
    tmp = out / f".building-{version}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        for name, vecs in ((indexio.IMAGE_INDEX, ivecs), (indexio.TEXT_INDEX, tvecs)):
            index = faiss.IndexFlatIP(dim)
            index.add(np.ascontiguousarray(vecs, dtype=np.float32))
            faiss.write_index(index, str(tmp / name))
        np.save(tmp / indexio.IMAGE_TOKENS, itoks.astype(np.float16))
        indexio.write_items(tmp / indexio.ITEMS, image_rows, text_rows)
        seconds = time.perf_counter() - t0
        manifest = {
            "format": indexio.FORMAT_VERSION,
            "version": version,
            "model": {"name": model.name, "fingerprint": model.fingerprint},
            "dim": dim,
            "metric": "inner_product",
            "index_type": "Flat",
            "counts": {"images": len(image_rows), "texts": len(text_rows)},
            "image_tokens": {"shape": list(itoks.shape[1:]), "dtype": "float16"},
            "content_hash": digest,
            "corpus": str(Path(corpus).resolve()),
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "build_seconds": round(seconds, 2),
            "skipped": len(skipped),
        }
        (tmp / indexio.MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        (tmp).rename(out / version)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    indexio.point_current(out, version)
    return BuildReport(version, out / version, len(image_rows), len(text_rows), seconds, skipped)


def _new_version(out: Path, digest: str) -> str:
    base = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + f"-{digest[:8]}"
    version, n = base, 1
    while (out / version).exists():
        n += 1
        version = f"{base}-{n}"
    return version
