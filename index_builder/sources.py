"""What a build reads besides the corpus: the base version of an append / delete (its rows,
vectors and tokens), the rows it keeps, and the key that names a build's shards."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sqlite3
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from index_builder.corpus import CorpusItem, CorpusSelection
from index_builder.device_decode import jpeg_key
from index_builder.encode import PlanItem, autocast_dtype, read_shard
from index_builder.errors import BuildError
from index_builder.options import BuildOptions
from models.builtin import BuiltinModel
from models.images import DECODE
from models.loading import Models
from store import indexio, integrity
from store.manifest import Manifest

log = logging.getLogger("duet.build")


@dataclass
class _Base:
    """The current version an append/delete starts from."""

    path: Path
    manifest: Manifest
    images: list[indexio.ImageRow]
    texts: list[indexio.TextRow]
    image_vectors: np.ndarray
    text_vectors: np.ndarray
    image_tokens: np.ndarray


def _shard_key(
    corpus: Path | None,
    selection: CorpusSelection,
    plan: Sequence[PlanItem],
    model: BuiltinModel | Models,
    dev: Any,
    batch_size: int,
    shard_size: int,
    base: _Base | None,
    gpu_share: float = 0.0,
) -> str:
    """What decides the shards' bytes: a changed corpus or argument never reuses stale ones."""
    h = hashlib.sha256()
    h.update(
        json.dumps(
            {
                # 2: captions encoded in batches sorted by length; 3: images decoded by
                # models.images.open_rgb (upright by EXIF, JPEGs at a DCT scale); 4: every
                # caption encoded, a failed image's captions dropped after; 5: a caption's
                # words in other scripts read whole (`models.shipped.caption_words`); 6: grey
                # levels wider than 8 bits scaled, not clipped (`models.images.eight_bit`)
                "shard_format": 6,
                "model": model.fingerprint,
                "device": dev.type,
                "autocast": str(autocast_dtype(dev)),
                "batch_size": batch_size,
                "shard_size": shard_size,
                "base": base.manifest.version if base else None,
                "corpus": selection.as_json(),  # a different --split or --images-root never resumes
                # where a GPU build decoded its JPEGs, or what share on the GPU (nvJPEG's
                # pixels are not PIL's; a GPU build before --decode-jpeg used nvJPEG with no
                # key of it); CPU builds, which always decode on the CPU, keep their keys
                **({"jpeg": jpeg_key(gpu_share)} if dev.type == "cuda" else {}),
            },
            sort_keys=True,
        ).encode()
    )
    if corpus is not None:
        h.update(hashlib.sha256(Path(corpus).read_bytes()).digest())
    for it in plan:  # image bytes are hashed while encoding; here size + mtime stand in
        if it.image is not None:
            try:
                st = os.stat(it.image)
                h.update(f"{it.image}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
            except OSError:
                h.update(f"{it.image}\0missing\n".encode())
    return h.hexdigest()[:24]


def _kept_items(
    items: Sequence[CorpusItem],
    plan: Sequence[PlanItem],
    shards: Sequence[Path],
    bad: Callable[[int, str], None],
) -> tuple[list[CorpusItem], str]:
    """The items whose image decoded (or that have none), and the content hash over them:
    image sha256s in order, then [id, image, captions] per item."""
    ok_flags: list[bool] = []
    shas: list[bytes] = []
    errors: list[str] = []
    for path in shards:
        arrays = read_shard(path, ("image_ok", "image_sha", "image_error"))
        ok_flags.extend(arrays["image_ok"].tolist())
        shas.extend(bytes(s) for s in arrays["image_sha"])
        errors.extend(arrays["image_error"].tolist())
    for p, err in zip([p for p in plan if p.image is not None], errors, strict=True):
        if err:
            bad(p.line, err)  # raises unless skipping
    flags = iter(zip(ok_flags, shas, strict=True))
    content = hashlib.sha256()
    kept: list[CorpusItem] = []
    for it in items:
        if it.image is None:
            kept.append(it)
            continue
        ok, sha = next(flags)
        if ok:
            content.update(sha)
            kept.append(it)
    for it in kept:
        content.update(json.dumps([it.id, it.image_rel, it.captions], sort_keys=True).encode())
    return kept, content.hexdigest()


def decode_after(base: _Base | None, appending: bool) -> int:
    """The image decode a version records (`models.images.DECODE`): the older of its base's
    and this build's, since it keeps the base's vectors; appending to an older one warns."""
    if base is None:
        return DECODE
    old = base.manifest.build.decode if base.manifest.build is not None else 0
    if old < DECODE and appending:
        log.warning(
            "%s was built before duet turned photos upright by their EXIF orientation: its "
            "photos stored sideways stay sideways in the index (the appended ones are turned); "
            "build a fresh index with --corpus to turn them all",
            base.path.name,
        )
    return min(DECODE, old)


def _load_base(out: Path) -> _Base:
    try:
        path = indexio.resolve_current(out)
        manifest = Manifest.read(path)
    except indexio.IndexLoadError as exc:
        raise BuildError(f"--append/--delete need a current version: {exc}") from exc
    # proved as it was published, which checked it as the service does: every file it reads
    # listed, each with its sha256 (hashed on threads; no FAISS index loaded). A damaged base
    # would otherwise end the build in a traceback, or pass its damage on to a new version
    # the service then refuses
    try:
        integrity.run_checks(indexio.file_checks(path, manifest.files)[0])
    except indexio.IndexLoadError as exc:
        raise BuildError(
            f"--append/--delete start from {path}, which is damaged: {exc}. Restore it, or "
            "point current at a sound older version, or build the corpus anew"
        ) from exc
    con = sqlite3.connect(f"file:{path / indexio.ITEMS}?mode=ro", uri=True)
    try:
        images = [
            indexio.ImageRow(r[0], r[1], json.loads(r[2]))
            for r in con.execute("SELECT id, path, meta FROM images ORDER BY row")
        ]
        texts = [
            indexio.TextRow(r[0], r[1], r[2], json.loads(r[3]))
            for r in con.execute("SELECT id, text, image_id, meta FROM texts ORDER BY row")
        ]
    finally:
        con.close()
    vectors = []
    for name, index_file in (
        (indexio.IMAGE_VECTORS, indexio.IMAGE_INDEX),
        (indexio.TEXT_VECTORS, indexio.TEXT_INDEX),
    ):
        if (path / name).is_file():
            vectors.append(np.load(path / name, mmap_mode="r"))
            continue
        index = faiss.read_index(str(path / index_file))  # versions built before vectors
        try:
            vectors.append(index.reconstruct_n(0, index.ntotal))
        except RuntimeError as exc:
            raise BuildError(
                f"{path} has no {name} and its index cannot give vectors back; "
                "rebuild it from its corpus"
            ) from exc
    tokens = np.load(path / indexio.IMAGE_TOKENS, mmap_mode="r")
    return _Base(path, manifest, images, texts, vectors[0], vectors[1], tokens)


def read_ids(path: Path, known: set[str] | None = None) -> list[str]:
    """The ids a --delete file lists, one per line. A line is an id as written, or with
    the spaces around it taken off when `known` lacks it as written (so " padded " and
    "#tag" can be deleted); a blank line, and a "#" line that names no known id, says
    nothing (a comment)."""
    try:
        lines = Path(path).read_text(encoding="utf-8-sig").splitlines()  # a BOM is no id
    except (OSError, UnicodeError) as exc:
        raise BuildError(f"cannot read ids file {path}: {exc}") from exc
    ids = []
    for line in lines:
        if known is not None and line in known:
            ids.append(line)
        elif (s := line.strip()) and (s in (known or ()) or not s.startswith("#")):
            ids.append(s)
    return ids


def no_ids(delete: Path | str) -> str:
    return (
        f"--delete {delete} lists no ids (one per line; a '#' line naming no id of the "
        "version is a comment): nothing to delete (to index the version again with another "
        "--factory, give --factory)"
    )


def _item_of_text(row: indexio.TextRow) -> str:
    return row.image_id if row.image_id is not None else row.id.rsplit("#", 1)[0]


def _apply_delete(
    base: _Base | None, opts: BuildOptions
) -> tuple[list[tuple[int, indexio.ImageRow]], list[tuple[int, indexio.TextRow]], set[str]]:
    """The base rows (with their row numbers) left after deleting the ids `opts.delete`
    lists. A file naming none of the base's ids (only "#" comments) is refused unless the
    build appends or asks for another --factory: it would publish a copy."""
    if base is None:
        return [], [], set()
    known = {r.id for r in base.images} | {_item_of_text(t) for t in base.texts}
    delete = opts.delete
    ids = set(read_ids(delete, known)) if delete is not None else set()
    if delete is not None and not ids and not (opts.append or opts.factory):
        raise BuildError(no_ids(delete))
    unknown = sorted(ids - known)
    if unknown:
        captions = {t.id for t in base.texts if t.id in ids}  # a caption hit's id: "p002#0"
        hint = (
            f"; {', '.join(map(repr, sorted(captions)[:3]))} name captions: --delete takes "
            "the id of an item (its image and all its captions go), as the manifest gave it"
            if captions
            else ""
        )
        raise BuildError(
            f"--delete: {len(unknown)} id(s) not in {base.path.name}: "
            f"{', '.join(map(repr, unknown[:5]))}{' ...' if len(unknown) > 5 else ''}{hint}"
        )
    images = [(i, r) for i, r in enumerate(base.images) if r.id not in ids]
    texts = [(i, r) for i, r in enumerate(base.texts) if _item_of_text(r) not in ids]
    return images, texts, ids


def _check_duplicates(
    items: Sequence[CorpusItem],
    images: Sequence[tuple[int, Any]],
    texts: Sequence[tuple[int, indexio.TextRow]],
) -> None:
    existing = {r.id for _, r in images} | {_item_of_text(t) for _, t in texts}
    dup = [it.id for it in items if it.id in existing]
    if dup:
        raise BuildError(
            f"--append: {len(dup)} id(s) already in the current version: "
            f"{', '.join(dup[:5])}{' ...' if len(dup) > 5 else ''} "
            "(ids must stay unique; --delete them first to replace them)"
        )
