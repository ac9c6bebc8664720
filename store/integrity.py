"""The checks `IndexVersion.verify` runs before a version serves (docs/reliability.md lists
them): the manifest's file list, the stored vectors' values, the item store's rows.

Each raises IndexLoadError with a message that says what is wrong; none reads a file outside
the version folder, and the names are checked before any file is read.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import sqlite3
import stat
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from store.errors import IndexLoadError
from store.files import file_sha256

# Every model duet serves writes L2-normalised vectors (inner product = cosine). Exact storage
# (Flat, HNSW, the .npy copies) gives them back to float rounding; a lossy code (SQ, PQ) gives
# back an approximation, whose norm stays near 1 too: on random unit vectors (the hardest
# case) SQ8 gave 0.95 to 1.004, IVF64,PQ16 0.77 to 1.16, IVF64,PQ16x4 0.71 to 1.22.
MAX_NORM = 1.01
MAX_NORM_LOSSY = 1.5
CHECK_THREADS = 8  # at most: the files to hash, the item store, the arrays
CHUNK = 65_536  # rows reconstructed at once: 32 MB at dimension 128
_SHA256 = re.compile(r"[0-9a-f]{64}")
_faiss: Any = faiss  # the SWIG module's stubs lack DirectMap


def plain_name(name: object) -> bool:
    """A file name with no folder part: not '', '.', '..', and no '/', '\\' or NUL."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and not any(c in name for c in "/\\\0")
    )


def check_listing(path: Path, files: Any, reads: Iterable[str]) -> None:
    """`files` (manifest.json's name -> sha256) lists every file the version `reads` by a
    plain name, each a regular file inside `path`, with a sha256 written as 64 hex digits.
    Only the names and `stat` are looked at: nothing is read, so a name like
    `../../dev/zero` refuses the version at once."""
    if not isinstance(files, dict):
        raise IndexLoadError(
            f"index {path}: manifest.json's files must map file names to sha256 digests; "
            "rebuild the version"
        )
    for name, digest in files.items():
        if not plain_name(name):
            raise IndexLoadError(
                f"index {path}: manifest.json's files names {name!r}, which is not a plain file "
                "name inside the version folder; rebuild the version"
            )
        if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
            raise IndexLoadError(
                f"index {path}: manifest.json's sha256 of {name} is not 64 hex digits; "
                "rebuild the version"
            )
    missing = [name for name in reads if name not in files]
    if missing:
        raise IndexLoadError(
            f"index {path}: {', '.join(missing)} not listed in manifest.json's files (every "
            "file the version reads must be listed with its sha256); rebuild the version"
        )
    folder = path.resolve()
    for name in files:
        file = path / name
        try:
            mode = file.stat().st_mode
        except OSError as exc:
            raise IndexLoadError(f"index {path}: cannot read {name}: {exc}") from exc
        if not stat.S_ISREG(mode) or file.resolve().parent != folder:
            raise IndexLoadError(
                f"index {path}: {name} is not a regular file inside the version folder "
                "(a link out of it, a device or a folder); rebuild or restore it"
            )


def check_digest(path: Path, name: str, digest: str) -> None:
    """The file `name` in the version folder `path` has the sha256 the manifest lists."""
    try:
        actual = file_sha256(path / name)
    except OSError as exc:
        raise IndexLoadError(f"index {path}: cannot read {name}: {exc}") from exc
    if actual != digest:
        raise IndexLoadError(
            f"index {path}: {name} differs from what the build wrote (sha256 {actual[:12]}..., "
            f"manifest.json says {digest[:12]}...); rebuild or restore it"
        )


def run_checks(checks: Sequence[Callable[[], object]], threads: int | None = None) -> None:
    """Run independent checks at once and raise the first failure in `checks`' order (as
    running them one after another would, had each of them run). Hashing, numpy and SQLite
    let go of the GIL, so on several cores a version is checked in about the time of its
    longest check rather than their sum: at 100k images the item store's rows and the
    files' hashes, each ~1 s on this 2-core machine, ran one after the other before."""
    threads = threads or min(CHECK_THREADS, os.cpu_count() or 1)
    if threads <= 1:
        for check in checks:
            check()
        return
    with ThreadPoolExecutor(threads, thread_name_prefix="duet-verify") as pool:
        futures = [pool.submit(check) for check in checks]
        try:
            for future in futures:
                future.result()
        finally:
            pool.shutdown(cancel_futures=True)  # a failure needs no more of the others


def _rows_of(index: Any) -> Iterator[tuple[int, np.ndarray]]:
    """(first row, vectors) in chunks, as the index stores them (a lossy code decoded). An
    IVF index gets a direct map for the scan and loses it again afterwards."""
    n = int(index.ntotal)
    if n == 0:
        return
    ivf = None
    try:
        index.reconstruct_n(0, 1)
    except RuntimeError:  # IVF without a direct map
        ivf = faiss.extract_index_ivf(index)
        ivf.make_direct_map()
    try:
        for start in range(0, n, CHUNK):
            yield start, np.asarray(index.reconstruct_n(start, min(CHUNK, n - start)))
    finally:
        if ivf is not None:
            ivf.set_direct_map_type(_faiss.DirectMap.NoMap)


def _lossy(index: Any) -> bool:
    """Whether the index stores a lossy code of each vector (SQ, PQ, ...) instead of it."""
    if not isinstance(index, faiss.Index):
        return False  # ann.TorchFlat: the exact vectors
    inner = faiss.downcast_index(index)
    while isinstance(inner, faiss.IndexPreTransform):
        inner = faiss.downcast_index(inner.index)
    if isinstance(inner, faiss.IndexHNSW):
        inner = faiss.downcast_index(inner.storage)
    if isinstance(inner, faiss.IndexIVF):
        return not isinstance(inner, faiss.IndexIVFFlat)
    return not isinstance(inner, faiss.IndexFlat)


def check_norms(where: str, chunks: Iterable[tuple[int, np.ndarray]], limit: float) -> None:
    """Every vector finite with an L2 norm of at most `limit`."""
    for start, block in chunks:
        norms = np.sqrt(np.einsum("ij,ij->i", block, block, dtype=np.float64))
        bad = ~(norms <= limit)  # NaN compares false
        if bad.any():
            row = start + int(np.argmax(bad))
            what = (
                "NaN or infinite values"
                if not np.isfinite(block[row - start]).all()
                else f"a vector of norm {norms[row - start]:.3g}"
            )
            raise IndexLoadError(
                f"{where} holds {what} at row {row}; the model's vectors have norm 1 "
                f"(at most {limit:g} here); rebuild the version"
            )


def check_index_vectors(where: str, index: Any) -> None:
    """The vectors a FAISS index (or `ann.TorchFlat`) holds, and an IVF index's centroids,
    finite and of about unit norm."""
    ivf: Any = None
    if isinstance(index, faiss.Index):
        with contextlib.suppress(RuntimeError):  # raised when the index is not IVF
            ivf = faiss.extract_index_ivf(index)
    if ivf is not None:
        listed = sum(int(ivf.invlists.list_size(i)) for i in range(ivf.nlist))
        if listed != index.ntotal:  # FAISS leaves out a vector it could not assign (NaN)
            raise IndexLoadError(
                f"{where} counts {index.ntotal} vectors but its inverted lists hold {listed}; "
                "rebuild the version"
            )
        check_norms(f"{where} (its IVF centroids)", _rows_of(ivf.quantizer), MAX_NORM)
    check_norms(where, _rows_of(index), MAX_NORM_LOSSY if _lossy(index) else MAX_NORM)


def check_array(where: str, arr: np.ndarray, limit: float | None) -> None:
    """A stored array finite everywhere; with `limit`, rows of at most that L2 norm."""
    for start in range(0, len(arr), 4096):
        block = np.asarray(arr[start : start + 4096])
        if limit is not None:
            check_norms(where, [(start, block.reshape(len(block), -1))], limit)
        elif not np.isfinite(block).all():
            raise IndexLoadError(
                f"{where} holds NaN or infinite values (from row {start}); rebuild the version"
            )


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text} is out of range")
    return value


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


# one decoder for every row: `json.loads` with options builds a new one per call, which took
# a third of the start-up check's time per row
_META = json.JSONDecoder(parse_float=_finite, parse_constant=_no_constant)


def decode_meta(text: object) -> dict[str, Any]:
    """An item's meta column: a JSON object of finite numbers (what a response can carry),
    or ValueError."""
    if not isinstance(text, str):
        raise ValueError(f"meta is {type(text).__name__}, not JSON text")
    try:
        obj = _META.decode(text)
    except RecursionError as exc:
        raise ValueError("meta is nested too deeply") from exc
    if not isinstance(obj, dict):
        raise ValueError(f"meta is a JSON {type(obj).__name__}, not an object")
    return obj


# columns and the SQLite types each row must have
_TYPES = {
    "images": "typeof(id) != 'text' OR typeof(path) NOT IN ('text', 'null')",
    "texts": "typeof(id) != 'text' OR typeof(text) != 'text' "
    "OR typeof(image_id) NOT IN ('text', 'null')",
}


def check_rows(where: str, execute: Callable[[str], Any]) -> None:
    """Every row of both item tables: ids, paths and texts of the right type, and its meta
    a JSON object (`decode_meta`). `execute` runs one SQL statement and gives its cursor."""
    for table, wrong in _TYPES.items():
        bad = execute(f"SELECT row FROM {table} WHERE {wrong} LIMIT 1").fetchone()
        if bad is not None:
            raise IndexLoadError(
                f"{where}: table {table} row {bad[0]} has a value of the wrong type; "
                "rebuild the version"
            )
        try:
            last: object = None  # a caption's meta is often its image's, as its neighbours'
            for row, meta in execute(f"SELECT row, meta FROM {table}"):
                if meta == last and isinstance(meta, str):
                    continue
                last = meta
                try:
                    decode_meta(meta)
                except ValueError as exc:
                    raise IndexLoadError(
                        f"{where}: table {table} row {row} has unreadable meta ({exc}); "
                        "rebuild the version"
                    ) from exc
        except sqlite3.Error as exc:
            raise IndexLoadError(f"{where} is unreadable: {exc}") from exc
