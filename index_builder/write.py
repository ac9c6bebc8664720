"""Writing a version's files: the FAISS indexes (trained, filled, recall measured), the
arrays, the sizes, the version name."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from index_builder.errors import BuildError
from index_builder.kmeans import gpu_kmeans
from index_builder.sources import _Base
from index_builder.stages import Stages
from store import ann, indexio
from store.manifest import IndexStats

log = logging.getLogger("duet.build")

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


def _factories(
    factory: str | None, base: _Base | None, n_img: int, n_txt: int, dim: int
) -> tuple[str, str]:
    """(image, text) factory strings, checked before anything is encoded."""
    chosen = (factory or ann.default_factory(n_img), factory or ann.default_factory(n_txt))
    for f, n in zip(chosen, (n_img, n_txt), strict=True):
        ann.check_factory(f, dim, n)
    return chosen


def _write_indexes(
    tmp: Path,
    factories: tuple[str, str],
    ivecs: np.ndarray,
    tvecs: np.ndarray,
    stages: Stages | None = None,
    device: str = "cpu",
) -> dict[str, IndexStats]:
    """Train and fill both indexes, measure recall@10 against exact search, write them; FAISS
    on all the cores, an IVF's k-means on the GPU for a CUDA build (`index_builder.kmeans`)."""
    stages = stages or Stages()
    knobs = ann.SearchKnobs()
    with ann.faiss_threads(cpu_threads()):  # every core this process may use
        return _write_both(tmp, factories, ivecs, tvecs, stages, knobs, gpu_kmeans(device))


def cpu_threads() -> int:
    """The cores this process may run on (`taskset`, cgroups' cpusets)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def _write_both(
    tmp: Path,
    factories: tuple[str, str],
    ivecs: np.ndarray,
    tvecs: np.ndarray,
    stages: Stages,
    knobs: ann.SearchKnobs,
    centroids: Callable[[np.ndarray, int, int], np.ndarray] | None,
) -> dict[str, IndexStats]:
    info: dict[str, IndexStats] = {}
    for name, file, factory, vecs, other in (
        ("image", indexio.IMAGE_INDEX, factories[0], ivecs, tvecs),
        ("text", indexio.TEXT_INDEX, factories[1], tvecs, ivecs),
    ):
        try:
            with stages("faiss"):
                index = ann.build_index(factory, vecs, centroids=centroids)
        except ann.FactoryError as exc:
            raise BuildError(str(exc)) from exc
        # text->image searches query the image index with text vectors, and the other way
        with stages("recall"):
            queries = ann.query_sample(other if len(other) else vecs, RECALL_QUERIES)
            recall = ann.recall_at_k(index, vecs, queries, RECALL_K, knobs)
        with stages("write"):
            _write_faiss(index, tmp / file)
        info[name] = IndexStats(
            factory=factory,
            count=int(index.ntotal),
            bytes_per_vector=round((tmp / file).stat().st_size / max(index.ntotal, 1), 2),
            recall_at_10=round(recall, 4),  # RECALL_K
            recall_queries=len(queries),
            search_params=knobs.as_json(),
        )
        log.info(
            "%s index %s: recall@%d %.4f vs exact (%d queries), %.1f bytes/vector",
            name,
            factory,
            RECALL_K,
            recall,
            len(queries),
            info[name].bytes_per_vector,
        )
    return info


def _concat(chunks: Sequence[np.ndarray], empty: tuple[int, ...], dtype: Any) -> np.ndarray:
    if not chunks:
        return np.zeros(empty, dtype)
    return np.ascontiguousarray(np.concatenate(chunks), dtype=dtype)


def _write_faiss(index: Any, path: Path) -> None:
    """`faiss.write_index` through Python's file: a failed write or close is the OSError
    the system gave (a full disk: "No space left on device", with the path), which the CLI
    reports in a line. Written by FAISS's own file, it failed as a RuntimeError (a
    traceback), and a failed close only printed a line and left a file cut short."""
    try:
        with path.open("wb") as fh:
            writer = faiss.PyCallbackIOWriter(fh.write)  # type: ignore[attr-defined]
            faiss.write_index(index, writer)
            del writer  # flushes what it holds into `fh`, before `fh` closes
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, str(path)) from exc


def _write_npy(
    path: Path, chunks: Iterable[np.ndarray], shape: tuple[int, ...], dtype: Any
) -> None:
    """One .npy written chunk by chunk (tokens can be larger than memory), by plain writes:
    a full disk is then an OSError ("No space left on device") that the build reports, where
    the memory map it used to write through killed the process with SIGBUS, without a word."""
    dtype, shape = np.dtype(dtype), tuple(int(n) for n in shape)  # numpy ints: no header
    header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False}
    at = 0
    try:
        with path.open("wb") as fh:
            try:  # the header numpy writes itself: version 1.0 where the shape fits
                np.lib.format.write_array_header_1_0(fh, {**header, "shape": shape})
            except ValueError:
                np.lib.format.write_array_header_2_0(fh, {**header, "shape": shape})
            for chunk in chunks:
                rows = np.ascontiguousarray(chunk, dtype=dtype)
                if rows.shape[1:] != shape[1:]:
                    raise RuntimeError(f"{path.name}: rows of {rows.shape[1:]}, not {shape[1:]}")
                fh.write(rows.data)
                at += len(rows)
    except OSError as exc:  # a write's error names no file: the path, for the message
        raise OSError(exc.errno, exc.strerror, str(path)) from exc
    if at != shape[0]:
        raise RuntimeError(f"{path.name}: wrote {at} rows, expected {shape[0]}")


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
