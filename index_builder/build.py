"""`duet build`: read a corpus -> encode in shards -> train/fill FAISS -> write a version ->
point `current` at it.

Resumable: encoded shards are written (temp name, fsync, rename) under
`OUT/.shards/<key>/` as they finish, where <key> hashes everything that decides their
contents (model, device and autocast dtype, batch and shard size, the corpus file's bytes and
how it was read (format, Karpathy split and images root), each image's path, size and mtime,
the base version of an append). A build started again with
the same arguments skips the shards already there. Encoding order, batch boundaries and the
FAISS training seed are fixed, and no time goes into the data files, so a resumed build
writes the same bytes as an uninterrupted one (see IDENTICAL_FILES).

Incremental: `append=True` adds a corpus's items to the current version, `delete` drops ids,
reusing the stored vectors and tokens of everything kept.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import os
import shutil
import sqlite3
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import torch
from tqdm import tqdm

from index_builder.corpus import CorpusError, CorpusItem, CorpusSelection, read_corpus
from index_builder.encode import (
    Encoder,
    PlanItem,
    RGBEncoder,
    ShardBuilder,
    autocast_dtype,
    decode_rgb,
    decoded_batches,
    default_workers,
    read_shard,
    shard_batches,
    shard_bytes,
    shard_path,
)
from models.builtin import BuiltinModel
from models.device import resolve_device
from models.errors import UserError
from models.loading import Models, manifest_model
from store import ann, indexio

log = logging.getLogger("duet.build")

DEFAULT_SHARD_SIZE = 1024
SHARDS_DIR = ".shards"
RECALL_K = 10
RECALL_QUERIES = 1000
# What "a resumed build is identical to an uninterrupted one" compares, byte for byte.
# manifest.json is not in it: it records build times, throughput and the version name.
IDENTICAL_FILES = (
    indexio.IMAGE_INDEX,
    indexio.TEXT_INDEX,
    indexio.IMAGE_TOKENS,
    indexio.ITEMS,
    indexio.IMAGE_VECTORS,
    indexio.TEXT_VECTORS,
)


class BuildError(UserError, ValueError):
    """A build that cannot start or finish as asked (bad factory, duplicate ids, ...)."""


@dataclass
class BuildReport:
    """What a build produced, for the CLI to print."""

    version: str
    path: Path
    images: int
    texts: int
    seconds: float
    skipped: list[str] = field(default_factory=list)
    encoded: int = 0  # corpus items encoded by this run (not resumed from shards)
    resumed_shards: int = 0
    shards: int = 0
    encode_seconds: float = 0.0
    items_per_s: float = 0.0
    manifest: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Base:
    """The current version an append/delete starts from."""

    path: Path
    manifest: dict[str, Any]
    images: list[indexio.ImageRow]
    texts: list[indexio.TextRow]
    image_vectors: np.ndarray
    text_vectors: np.ndarray
    image_tokens: np.ndarray


def build(
    corpus: Path | None,
    out: Path,
    model: BuiltinModel | Models,
    batch_size: int = 64,
    skip_bad: bool = False,
    progress: bool = True,
    *,
    factory: str | None = None,
    shard_size: int = DEFAULT_SHARD_SIZE,
    workers: int | None = None,
    device: str = "auto",
    engine: str = "local",
    append: bool = False,
    delete: Path | None = None,
    ray_actors: int | None = None,
    split: str | None = None,
    images_root: Path | None = None,
) -> BuildReport:
    """Encode `corpus` with `model` into `out/<version>/` and make it `out/current`.

    `corpus` is a JSONL manifest or a Karpathy JSON file (`.json`), of which `split` (`test`,
    `train,restval`, `all`) is read, its images under `images_root` (default: its directory).

    With `append`, `corpus` holds only new items, added to the current version; `delete`
    names a file of ids (one per line) to drop from it. Either reuses the stored vectors.

    `model` is duet's joint model, or the `Models` of `models.loading.load_models` (an
    encoder and the re-ranker whose image tokens the index stores). When the joint model is
    both, encoding takes the fast path (decode workers, autocast, Ray); Hugging Face models
    take a plain batched loop in this process, on the device they were loaded on.
    """
    t0 = time.perf_counter()
    out = Path(out)
    if batch_size < 1 or shard_size < 1:
        raise BuildError("--batch-size and --shard-size must be at least 1")
    if engine not in ("local", "ray"):
        raise BuildError(f"unknown engine {engine!r}: use local or ray")
    # the joint model alone (as encoder and token source) takes the fast path
    joint = model if isinstance(model, BuiltinModel) else model.joint
    dev = resolve_device(device) if joint is not None else torch.device(str(model.device))
    workers = default_workers(dev) if workers is None else workers
    if workers < 0:
        raise BuildError("--workers must be 0 or more")
    if joint is None:
        if engine == "ray":
            raise BuildError(
                f"--engine ray encodes with duet's builtin model only; {model.name} "
                "(Hugging Face checkpoints) builds with --engine local"
            )
        workers = 0  # decoded in this process
    skipped: list[str] = []

    def bad(err: CorpusError) -> None:
        if not skip_bad:
            raise err
        skipped.append(str(err))
        log.warning("skipping %s", err)

    base = _load_base(out) if (append or delete is not None) else None
    if (
        base is not None
        and (built_by := base.manifest.get("model", {}).get("fingerprint")) != model.fingerprint
    ):
        raise BuildError(
            f"--append/--delete: {base.path.name} was built by model {built_by!r}"
            f"{indexio.built_with(base.manifest)}, this build encodes with "
            f"{model.fingerprint!r}; use the models that built it (--encoder, "
            "--reranker, --model-dir) or build a fresh index with --corpus"
        )
    items: list[CorpusItem] = []
    selection = CorpusSelection("manifest")
    if corpus is not None:
        selection, entries = read_corpus(Path(corpus), split, images_root)
        for entry in entries:
            if isinstance(entry, CorpusError):
                bad(entry)
            else:
                items.append(entry)

    kept_images, kept_texts, deleted = _apply_delete(base, delete)
    if base is not None:
        _check_duplicates(items, kept_images, kept_texts)

    if factory is None and base is not None:  # an append keeps the base's explicit choice
        factory = base.manifest.get("build", {}).get("factory_arg")
    n_img = len(kept_images) + sum(1 for it in items if it.image is not None)
    n_txt = len(kept_texts) + sum(len(it.captions) for it in items)
    try:
        factories = _factories(factory, base, n_img, n_txt, model.dim)
    except ann.FactoryError as exc:
        raise BuildError(str(exc)) from exc

    plan = [
        PlanItem(
            i, it.id, str(it.image) if it.image else None, it.image_rel, it.line, tuple(it.captions)
        )
        for i, it in enumerate(items)
    ]
    out.mkdir(parents=True, exist_ok=True)
    shard_dir = (
        out
        / SHARDS_DIR
        / _shard_key(corpus, selection, plan, model, dev, batch_size, shard_size, base)
    )
    ranges = [
        (k, a, min(a + shard_size, len(plan)))
        for k, a in enumerate(range(0, len(plan), shard_size))
    ]
    shard_dir.mkdir(parents=True, exist_ok=True)
    done = {k for k, _, _ in ranges if shard_path(shard_dir, k).is_file()}
    missing = [r for r in ranges if r[0] not in done]
    if done:
        log.info(
            "resuming: %d of %d shards already encoded in %s", len(done), len(ranges), shard_dir
        )

    corpus_path = Path(corpus) if corpus is not None else Path("-")
    where = {it.line: it.where for it in items}

    def item_error(line: int, err: str) -> CorpusError:
        return CorpusError(corpus_path, line, err, where.get(line))

    def check(k: int, arrays: dict[str, np.ndarray]) -> None:
        """Stop at a shard's first unreadable image unless skipping."""
        if skip_bad:
            return
        _, a, b = ranges[k]
        for p, err in zip(
            [p for p in plan[a:b] if p.image is not None],
            arrays["image_error"].tolist(),
            strict=True,
        ):
            if err:
                raise item_error(p.line, err)

    for k in sorted(done):
        check(k, read_shard(shard_path(shard_dir, k), ("image_error",)))
    t_enc = time.perf_counter()
    encoded = sum(b - a for _, a, b in missing)
    if missing and joint is None:
        assert isinstance(model, Models)
        _encode_rgb(plan, missing, shard_dir, model, batch_size, progress, check)
    elif missing and engine == "ray":
        from index_builder.ray_engine import encode_ray

        assert joint is not None
        encode_ray(
            plan, missing, shard_dir, joint, dev, batch_size, ray_actors, progress, on_shard=check
        )
    elif missing:
        assert joint is not None
        _encode_local(plan, missing, shard_dir, joint, dev, batch_size, workers, progress, check)
    encode_seconds = time.perf_counter() - t_enc

    # -- assemble: kept base rows, then the new items in corpus order -----------------------
    kept, digest = _kept_items(
        items,
        plan,
        [shard_path(shard_dir, k) for k, _, _ in ranges],
        lambda line, err: bad(item_error(line, err)),
    )
    if base is not None:
        digest = hashlib.sha256(
            json.dumps([base.manifest.get("content_hash"), sorted(deleted), digest]).encode()
        ).hexdigest()

    new_images = [indexio.ImageRow(it.id, it.image_rel, it.meta) for it in kept if it.image]
    new_texts = [
        indexio.TextRow(f"{it.id}#{n}", cap, it.id if it.image else None, it.meta)
        for it in kept
        for n, cap in enumerate(it.captions)
    ]
    image_rows = [r for _, r in kept_images] + new_images
    text_rows = [r for _, r in kept_texts] + new_texts

    def shard_arrays(name: str) -> Iterator[np.ndarray]:
        for k, _, _ in ranges:
            yield read_shard(shard_path(shard_dir, k), (name,))[name]

    def base_rows(name: str, rows: list[int]) -> Iterator[np.ndarray]:
        if base is not None and rows:
            src = getattr(base, name)
            for i in range(0, len(rows), 4096):
                yield np.asarray(src[rows[i : i + 4096]])

    img_rows = [r for r, _ in kept_images]
    txt_rows = [r for r, _ in kept_texts]
    ivecs = _concat(
        [*base_rows("image_vectors", img_rows), *shard_arrays("image_vectors")],
        (0, model.dim),
        np.float32,
    )
    tvecs = _concat(
        [*base_rows("text_vectors", txt_rows), *shard_arrays("text_vectors")],
        (0, model.dim),
        np.float32,
    )
    if len(ivecs) != len(image_rows) or len(tvecs) != len(text_rows):
        raise RuntimeError("encoded vectors do not match the item rows (stale shards?)")
    # tokens (4 KiB per image) are streamed into the version, never held whole in memory
    token_chunks = itertools.chain(
        base_rows("image_tokens", img_rows), shard_arrays("image_tokens")
    )

    version = _new_version(out, digest)
    tmp = out / f".building-{version}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        indexes = _write_indexes(tmp, factories, ivecs, tvecs)
        _write_npy(
            tmp / indexio.IMAGE_TOKENS,
            token_chunks,
            (len(image_rows), *model.token_shape),
            np.float16,
        )
        np.save(tmp / indexio.IMAGE_VECTORS, ivecs)
        np.save(tmp / indexio.TEXT_VECTORS, tvecs)
        indexio.write_items(tmp / indexio.ITEMS, image_rows, text_rows)
        seconds = time.perf_counter() - t0
        rate = round(encoded / encode_seconds, 1) if encoded and encode_seconds > 0 else 0.0
        manifest: dict[str, Any] = {
            "format": indexio.FORMAT_VERSION,
            "version": version,
            # encoder and token source (what the re-ranker reads); the service checks both
            "model": manifest_model(model),
            "dim": model.dim,
            "metric": "inner_product",
            "index_type": (
                factories[0]
                if factories[0] == factories[1]
                else f"image:{factories[0]} text:{factories[1]}"
            ),
            "indexes": indexes,
            "counts": {"images": len(image_rows), "texts": len(text_rows)},
            "image_tokens": {"shape": list(model.token_shape), "dtype": "float16"},
            "content_hash": digest,
            "corpus": str(Path(corpus).resolve()) if corpus is not None else None,
            "corpus_selection": selection.as_json() if corpus is not None else None,
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "build_seconds": round(seconds, 2),
            "skipped": len(skipped),
            "build": {
                "engine": engine,
                "device": dev.type,
                "autocast": str(autocast_dtype(dev)).replace("torch.", "")
                if dev.type == "cuda" and joint is not None
                else None,
                "workers": workers,
                "batch_size": batch_size,
                "shard_size": shard_size,
                "factory_arg": factory,
                "shards": len(ranges),
                "resumed_shards": len(done),
                "encoded_items": encoded,
                "encode_seconds": round(encode_seconds, 3),
                "items_per_s": rate,
            },
            "files": {name: indexio.file_sha256(tmp / name) for name in IDENTICAL_FILES},
            "bytes_per_item": _bytes_per_item(tmp, len(image_rows), len(text_rows)),
        }
        if base is not None:
            manifest["base"] = {
                "version": base.manifest.get("version"),
                "appended": len(kept),
                "deleted": len(deleted),
            }
        indexio.write_atomic(
            tmp / indexio.MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode()
        )
        for f in tmp.iterdir():
            indexio.fsync_path(f)
        indexio.fsync_path(tmp)
        tmp.rename(out / version)
        indexio.fsync_path(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    indexio.point_current(out, version)
    shutil.rmtree(shard_dir, ignore_errors=True)
    with contextlib.suppress(OSError):
        shard_dir.parent.rmdir()  # only when no other build's shards are waiting there
    return BuildReport(
        version,
        out / version,
        len(image_rows),
        len(text_rows),
        seconds,
        skipped,
        encoded=encoded,
        resumed_shards=len(done),
        shards=len(ranges),
        encode_seconds=encode_seconds,
        items_per_s=rate,
        manifest=manifest,
    )


# -- encode: local engine ------------------------------------------------------------------


def _encode_local(
    plan: Sequence[PlanItem],
    missing: list[tuple[int, int, int]],
    shard_dir: Path,
    model: BuiltinModel,
    dev: Any,
    batch_size: int,
    workers: int,
    progress: bool,
    on_shard: Any,
) -> None:
    """Decode in `workers` DataLoader processes, encode here, write each shard as it ends."""
    encoder = Encoder(model, dev)
    per_shard = [shard_batches(plan, a, b, batch_size) for _, a, b in missing]
    batches = decoded_batches(
        plan, [b for bs in per_shard for b in bs], encoder.image_size, workers
    )
    with tqdm(
        total=sum(b - a for _, a, b in missing), desc="encoding", unit="item", disable=not progress
    ) as bar:
        for (k, a, b), bs in zip(missing, per_shard, strict=True):
            shard = ShardBuilder(plan[a:b], encoder, batch_size)
            for _ in bs:
                shard.add(next(batches))
            arrays = shard.finish(model.dim, model.token_shape)
            indexio.write_atomic(shard_path(shard_dir, k), shard_bytes(arrays))
            bar.update(b - a)
            on_shard(k, arrays)


def _encode_rgb(
    plan: Sequence[PlanItem],
    missing: list[tuple[int, int, int]],
    shard_dir: Path,
    model: Models,
    batch_size: int,
    progress: bool,
    on_shard: Any,
) -> None:
    """Hugging Face models: decode here, encode `batch_size` images at a time at their own
    size (each model's processor resizes), the same shard files as the fast path."""
    encoder = RGBEncoder(model)
    log.info(
        "encoding %d shard(s) with %s on %s, %d images per batch",
        len(missing),
        model.name,
        model.device,
        batch_size,
    )
    with tqdm(
        total=sum(b - a for _, a, b in missing), desc="encoding", unit="item", disable=not progress
    ) as bar:
        for k, a, b in missing:
            t0 = time.perf_counter()
            shard = ShardBuilder(plan[a:b], encoder, batch_size)
            done = 0
            for positions in shard_batches(plan, a, b, batch_size):
                shard.add([decode_rgb(plan[p]) for p in positions])
                bar.update(len(positions))
                done += len(positions)
            arrays = shard.finish(model.dim, model.token_shape)  # the captions
            indexio.write_atomic(shard_path(shard_dir, k), shard_bytes(arrays))
            bar.update(b - a - done)
            log.info(
                "shard %d: items %d-%d encoded in %.1fs", k, a, b - 1, time.perf_counter() - t0
            )
            on_shard(k, arrays)


def _shard_key(
    corpus: Path | None,
    selection: CorpusSelection,
    plan: Sequence[PlanItem],
    model: BuiltinModel | Models,
    dev: Any,
    batch_size: int,
    shard_size: int,
    base: _Base | None,
) -> str:
    """What decides the shards' bytes: a changed corpus or argument never reuses stale ones."""
    h = hashlib.sha256()
    h.update(
        json.dumps(
            {
                "shard_format": 1,
                "model": model.fingerprint,
                "device": dev.type,
                "autocast": str(autocast_dtype(dev)),
                "batch_size": batch_size,
                "shard_size": shard_size,
                "base": base.manifest.get("version") if base else None,
                "corpus": selection.as_json(),  # a different --split or --images-root never resumes
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


# -- base version (append / delete) ---------------------------------------------------------


def _load_base(out: Path) -> _Base:
    try:
        path = indexio.resolve_current(out)
        manifest = indexio.read_manifest(path)
    except indexio.IndexLoadError as exc:
        raise BuildError(f"--append/--delete need a current version: {exc}") from exc
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


def _read_ids(path: Path) -> list[str]:
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise BuildError(f"cannot read ids file {path}: {exc}") from exc
    return [s for s in (ln.strip() for ln in lines) if s and not s.startswith("#")]


def _item_of_text(row: indexio.TextRow) -> str:
    return row.image_id if row.image_id is not None else row.id.rsplit("#", 1)[0]


def _apply_delete(
    base: _Base | None, delete: Path | None
) -> tuple[list[tuple[int, indexio.ImageRow]], list[tuple[int, indexio.TextRow]], set[str]]:
    """The base rows (with their row numbers) left after deleting the ids in `delete`."""
    if base is None:
        return [], [], set()
    ids = set(_read_ids(delete)) if delete is not None else set()
    known = {r.id for r in base.images} | {_item_of_text(t) for t in base.texts}
    unknown = sorted(ids - known)
    if unknown:
        raise BuildError(
            f"--delete: {len(unknown)} id(s) not in {base.path.name}: "
            f"{', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''}"
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


# -- write -------------------------------------------------------------------------------


def _factories(
    factory: str | None, base: _Base | None, n_img: int, n_txt: int, dim: int
) -> tuple[str, str]:
    """(image, text) factory strings, checked before anything is encoded."""
    chosen = (factory or ann.default_factory(n_img), factory or ann.default_factory(n_txt))
    for f, n in zip(chosen, (n_img, n_txt), strict=True):
        ann.check_factory(f, dim, n)
    return chosen


def _write_indexes(
    tmp: Path, factories: tuple[str, str], ivecs: np.ndarray, tvecs: np.ndarray
) -> dict[str, Any]:
    """Train and fill both indexes, measure recall@10 against exact search, write them."""
    knobs = ann.SearchKnobs()
    info: dict[str, Any] = {}
    for name, file, factory, vecs, other in (
        ("image", indexio.IMAGE_INDEX, factories[0], ivecs, tvecs),
        ("text", indexio.TEXT_INDEX, factories[1], tvecs, ivecs),
    ):
        try:
            index = ann.build_index(factory, vecs)
        except ann.FactoryError as exc:
            raise BuildError(str(exc)) from exc
        # text->image searches query the image index with text vectors, and the other way
        queries = ann.query_sample(other if len(other) else vecs, RECALL_QUERIES)
        recall = ann.recall_at_k(index, vecs, queries, RECALL_K, knobs)
        faiss.write_index(index, str(tmp / file))
        info[name] = {
            "factory": factory,
            "count": int(index.ntotal),
            "bytes_per_vector": round((tmp / file).stat().st_size / max(index.ntotal, 1), 2),
            f"recall_at_{RECALL_K}": round(recall, 4),
            "recall_queries": len(queries),
            "search_params": knobs.as_json(),
        }
        log.info(
            "%s index %s: recall@%d %.4f vs exact (%d queries), %.1f bytes/vector",
            name,
            factory,
            RECALL_K,
            recall,
            len(queries),
            info[name]["bytes_per_vector"],
        )
    return info


def _concat(chunks: Sequence[np.ndarray], empty: tuple[int, ...], dtype: Any) -> np.ndarray:
    if not chunks:
        return np.zeros(empty, dtype)
    return np.ascontiguousarray(np.concatenate(chunks), dtype=dtype)


def _write_npy(
    path: Path, chunks: Iterable[np.ndarray], shape: tuple[int, ...], dtype: Any
) -> None:
    """One .npy written chunk by chunk (tokens can be larger than memory)."""
    arr = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape)
    at = 0
    for chunk in chunks:
        arr[at : at + len(chunk)] = chunk
        at += len(chunk)
    if at != shape[0]:
        raise RuntimeError(f"{path.name}: wrote {at} rows, expected {shape[0]}")
    arr.flush()
    del arr


def _bytes_per_item(directory: Path, images: int, texts: int) -> dict[str, float]:
    """Stored bytes per image row (its index entry, vector and tokens), per caption row, and
    everything (items.sqlite included) per image."""

    def size(*names: str) -> int:
        return sum((directory / n).stat().st_size for n in names)

    return {
        "image": round(
            size(indexio.IMAGE_INDEX, indexio.IMAGE_VECTORS, indexio.IMAGE_TOKENS) / max(images, 1),
            1,
        ),
        "text": round(size(indexio.TEXT_INDEX, indexio.TEXT_VECTORS) / max(texts, 1), 1),
        "total_per_image": round(size(*IDENTICAL_FILES) / max(images, 1), 1),
    }


def _new_version(out: Path, digest: str) -> str:
    base = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + f"-{digest[:8]}"
    version, n = base, 1
    while (out / version).exists():
        n += 1
        version = f"{base}-{n}"
    return version
