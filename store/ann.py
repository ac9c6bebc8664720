"""Approximate nearest-neighbour pieces shared by the builder (train, add, measure) and the
service (search with per-call parameters).

Everything is inner product on L2-normalised float32 vectors. Index types are FAISS
index-factory strings ("Flat", "IVF1024,Flat", "IVF4096_HNSW32,SQ8", "IVF1024,PQ16", "HNSW32").
Search parameters (nprobe, efSearch) are passed per call (`faiss.SearchParametersIVF` /
`faiss.SearchParametersHNSW`), never set on a shared index: a request handler that sets
`index.nprobe` races every other request using that index.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import faiss
import numpy as np

from models.errors import UserError

_faiss: Any = faiss  # the SWIG module's stubs lack some SearchParameters classes

DEFAULT_NPROBE = 16
DEFAULT_EF_SEARCH = 64
# Exact search up to this many vectors: a Flat scan of 200k x 128 floats is a few ms and
# needs no training; FAISS's guidance puts the switch somewhere between 100k and 1M.
FLAT_MAX = 200_000
HNSW_QUANTIZER_MIN = 1_000_000  # above this, the coarse quantizer itself is an HNSW graph
TRAIN_SEED = 1234  # FAISS's own default, spelled out: the same vectors train the same index
POINTS_PER_CENTROID = 64  # FAISS wants 39..256 training points per centroid
PQ_TRAIN_MIN = 256 * 39  # 256 PQ centroids per sub-quantizer, 39 points each


class FactoryError(UserError, ValueError):
    """A factory string FAISS cannot build, or one this corpus is too small to train."""


def default_factory(n: int) -> str:
    """The index type FAISS recommends for `n` vectors: exact when small, IVF when large."""
    if n <= FLAT_MAX:
        return "Flat"
    nlist = default_nlist(n)
    if n < HNSW_QUANTIZER_MIN:
        return f"IVF{nlist},Flat"
    return f"IVF{nlist}_HNSW32,SQ8"


def default_nlist(n: int) -> int:
    """A power of two in FAISS's 4..16 * sqrt(N) range (aiming at 8 * sqrt(N))."""
    target = 8 * math.sqrt(max(n, 1))
    nlist = 2 ** round(math.log2(target))
    return int(min(max(nlist, 4 * math.sqrt(n)), 16 * math.sqrt(n), 2**18)) or 1


def make_index(factory: str, dim: int) -> faiss.Index:
    """An empty index for `factory` (inner product), or FactoryError naming the string."""
    if not factory.strip():
        raise FactoryError("empty index factory string")
    try:
        return faiss.index_factory(dim, factory, faiss.METRIC_INNER_PRODUCT)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else "unknown error"
        raise FactoryError(
            f"FAISS cannot build index factory string {factory!r} for dimension {dim}: {first}. "
            "Examples: Flat, IVF1024,Flat, IVF4096_HNSW32,SQ8, IVF1024,PQ16 "
            f"(PQ m must divide {dim}), HNSW32"
        ) from exc


def min_training_points(index: faiss.Index) -> int:
    """The fewest training vectors `index` can be trained on (0 if it needs no training)."""
    if index.is_trained:
        return 0
    need = 1
    ivf = _ivf(index)
    if ivf is not None:
        need = max(need, int(ivf.nlist))
    pq = getattr(faiss.downcast_index(ivf if ivf is not None else _inner(index)), "pq", None)
    if pq is not None:
        need = max(need, 2 ** int(pq.nbits))
    return need


def check_factory(factory: str, dim: int, n: int) -> None:
    """Fail before any encoding if `factory` does not parse or `n` vectors cannot train it."""
    index = make_index(factory, dim)
    need = min_training_points(index)
    if need > n:
        raise FactoryError(
            f"index factory {factory!r} needs at least {need} training vectors but this build "
            f"has {n}; use fewer IVF lists / PQ bits, or Flat for a corpus this small"
        )


def training_size(index: faiss.Index, n: int) -> int:
    """How many of `n` vectors to train on: ~64 per IVF centroid, enough for PQ, at most n."""
    if index.is_trained:
        return 0
    ivf = _ivf(index)
    want = POINTS_PER_CENTROID * int(ivf.nlist) if ivf is not None else 0
    if _has_pq(index):
        want = max(want, PQ_TRAIN_MIN)
    if want == 0:  # SQ and other trained types: a sample as large as PQ's
        want = PQ_TRAIN_MIN
    return min(n, want)


def training_sample(n: int, size: int, seed: int = TRAIN_SEED) -> np.ndarray:
    """Sorted row numbers of a seeded sample: the same (n, size, seed), the same rows."""
    if size >= n:
        return np.arange(n)
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(n, size=size, replace=False))


def build_index(
    factory: str,
    vectors: np.ndarray,
    seed: int = TRAIN_SEED,
    centroids: Callable[[np.ndarray, int, int], np.ndarray] | None = None,
) -> faiss.Index:
    """Make, train (on a seeded sample) and fill an index; deterministic for the same input.

    HNSW graphs built by several threads depend on thread timing, so an HNSW index is filled
    on a single thread: the same vectors give the same bytes.

    `centroids(sample, nlist, seed)`, when given, makes an IVF's coarse centroids from the
    training sample instead of FAISS's k-means (`index_builder.kmeans`: on a CUDA build's
    GPU); FAISS then trains the rest (an SQ or PQ encoder). Only for a bare IVF (no
    pre-transform) whose coarse quantizer is flat or HNSW; others keep FAISS's k-means.
    """
    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    n, dim = vectors.shape
    index = make_index(factory, dim)
    if not index.is_trained:
        need = min_training_points(index)
        if n < need:
            raise FactoryError(
                f"index factory {factory!r} needs at least {need} training vectors, got {n}"
            )
        _seed(index, seed)
        sample = vectors[training_sample(n, training_size(index, n), seed)]
        ivf: Any = faiss.downcast_index(index) if centroids is not None else None
        if centroids is not None and _plain_quantizer(ivf):
            made = np.ascontiguousarray(centroids(sample, int(ivf.nlist), seed), dtype=np.float32)
            if made.shape != (ivf.nlist, ivf.d):
                raise ValueError(f"{made.shape} centroids for {ivf.nlist} lists of {ivf.d}")
            # an IVF whose quantizer holds its nlist centroids skips k-means in train();
            # an HNSW quantizer's graph built on one thread: the same centroids, the same bytes
            with faiss_threads(1):
                ivf.quantizer.add(made)
        try:
            index.train(sample)
        except RuntimeError as exc:
            raise FactoryError(
                f"training {factory!r} on {len(sample)} vectors failed: {exc}"
            ) from exc
    with faiss_threads(1 if _add_builds_a_graph(index) else None):
        index.add(vectors)
    return index


def _plain_quantizer(ivf: Any) -> bool:
    """An IVF whose empty coarse quantizer is flat or HNSW: one that takes centroids as they
    are (an IMI's, a residual or PQ quantizer's would not)."""
    if not isinstance(ivf, faiss.IndexIVF) or ivf.quantizer.ntotal:
        return False
    return isinstance(faiss.downcast_index(ivf.quantizer), faiss.IndexFlat | faiss.IndexHNSWFlat)


@contextlib.contextmanager
def faiss_threads(n: int | None) -> Iterator[None]:
    """FAISS on `n` OpenMP threads within the block (None: as it is), then as before. One
    thread: an HNSW graph's bytes do not depend on thread timing."""
    threads = faiss.omp_get_max_threads()
    if n is not None:
        faiss.omp_set_num_threads(n)
    try:
        yield
    finally:
        faiss.omp_set_num_threads(threads)


def _add_builds_a_graph(index: faiss.Index) -> bool:
    """Whether adding to `index` inserts into an HNSW graph, which several threads build in
    an order that depends on their timing. An IVF with an HNSW coarse quantizer only searches
    that graph when it adds (its lists are filled in id order whatever the threads): it adds
    on every core, and gives the same bytes as on one (1M images and 5M captions: ~68 s on
    one core of the 2-core machine, 11 us a vector)."""
    return isinstance(faiss.downcast_index(index), faiss.IndexHNSW)


@dataclass(frozen=True)
class SearchKnobs:
    """Per-call search parameters; None means the index's own default."""

    nprobe: int | None = DEFAULT_NPROBE
    ef_search: int | None = DEFAULT_EF_SEARCH

    def as_json(self) -> dict[str, int | None]:
        return {"nprobe": self.nprobe, "efSearch": self.ef_search}


class _Params:
    """A faiss.SearchParameters plus the nested objects it points at (kept alive with it)."""

    def __init__(self, params: Any, keep: list[Any]) -> None:
        self.params = params
        self.keep = keep


def search_params(index: faiss.Index, knobs: SearchKnobs) -> _Params | None:
    """The per-call parameters for `index` (None for exact indexes, which take none)."""
    keep: list[Any] = []
    inner = faiss.downcast_index(index)
    if isinstance(inner, faiss.IndexPreTransform):
        sub = search_params(faiss.downcast_index(inner.index), knobs)
        if sub is None:
            return None
        p: Any = _faiss.SearchParametersPreTransform()
        p.index_params = sub.params
        return _Params(p, [sub, *keep])
    if isinstance(inner, faiss.IndexIVF):
        p = _faiss.SearchParametersIVF()
        if knobs.nprobe is not None:
            p.nprobe = int(min(knobs.nprobe, inner.nlist))
        q = faiss.downcast_index(inner.quantizer)
        if isinstance(q, faiss.IndexHNSW) and knobs.ef_search is not None:
            qp = _faiss.SearchParametersHNSW()
            qp.efSearch = int(knobs.ef_search)
            p.quantizer_params = qp
            keep.append(qp)
        return _Params(p, keep)
    if isinstance(inner, faiss.IndexHNSW):
        p = _faiss.SearchParametersHNSW()
        if knobs.ef_search is not None:
            p.efSearch = int(knobs.ef_search)
        return _Params(p, keep)
    return None


class TorchFlat:
    """Exact inner-product search as one matmul + top-k on a torch device: Flat search on a
    GPU host whose FAISS has no GPU support (torch's CUDA build without faiss-gpu). Answers
    like a FAISS index: (scores, rows) with rows -1 and scores -inf past `ntotal`."""

    def __init__(self, vectors: np.ndarray, device: str) -> None:
        import torch

        self._torch = torch
        self.vectors = torch.from_numpy(np.ascontiguousarray(vectors, dtype=np.float32)).to(device)
        self.ntotal, self.d = self.vectors.shape
        self.metric_type = faiss.METRIC_INNER_PRODUCT

    def reconstruct_n(self, start: int, n: int) -> np.ndarray:
        """Stored vectors start .. start + n - 1, as FAISS's method of that name gives them."""
        return np.asarray(self.vectors[start : start + n].cpu().numpy())

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        torch = self._torch
        n = len(queries)
        scores = np.full((n, k), -np.inf, dtype=np.float32)
        rows = np.full((n, k), -1, dtype=np.int64)
        take = min(k, self.ntotal)
        if take:
            with torch.inference_mode():
                q = torch.from_numpy(queries).to(self.vectors.device)
                top = (q @ self.vectors.T).topk(take, dim=1)
            scores[:, :take] = top.values.cpu().numpy()
            rows[:, :take] = top.indices.cpu().numpy()
        return scores, rows


def flat_vectors(index: Any) -> np.ndarray | None:
    """The stored vectors of an exact (Flat) index, as `place` may have made it, in row
    order; None for any other kind (IVF, HNSW, PQ: their vectors are not all kept)."""
    if isinstance(index, TorchFlat):
        return np.asarray(index.vectors.cpu().numpy(), dtype=np.float32)
    gpu_flat = getattr(faiss, "GpuIndexFlat", None)  # faiss-gpu's, reconstructs the same
    if not isinstance(index, gpu_flat or ()) and not isinstance(
        faiss.downcast_index(index), faiss.IndexFlat
    ):
        return None
    if index.ntotal == 0:
        return np.zeros((0, index.d), np.float32)
    return np.asarray(index.reconstruct_n(0, index.ntotal), dtype=np.float32)


def place(index: faiss.Index, device: str) -> Any:
    """`index` ready to search on `device`: on a CUDA device a Flat index moves to the GPU,
    through faiss-gpu where it is importable, else as a `TorchFlat`; IVF and HNSW indexes
    stay FAISS on the CPU (their GPU forms need faiss-gpu and tuning of their own)."""
    if not device.startswith("cuda") or not isinstance(
        faiss.downcast_index(index), faiss.IndexFlat
    ):
        return index
    if hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0:
        res = _faiss.StandardGpuResources()
        gpu = _faiss.index_cpu_to_gpu(res, 0, index)
        gpu.keep_resources = res  # the resources must live as long as the index
        return gpu
    return TorchFlat(index.reconstruct_n(0, index.ntotal), device)


def search(
    index: Any, queries: np.ndarray, k: int, knobs: SearchKnobs | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(scores, rows) of the top-k by inner product, with per-call parameters; thread-safe.
    `index` is a FAISS index or what `place` made of one. One query searches on one OpenMP
    thread: FAISS splits its queries between threads, so a second has nothing to do but
    costs the hand-off, and on a busy CPU waits for a core (the service's search of 10,000
    captions for an image query: 1.43 -> 0.32-0.34 ms)."""
    q = np.ascontiguousarray(np.atleast_2d(queries), dtype=np.float32)
    if isinstance(index, TorchFlat):
        return index.search(q, k)
    params = search_params(index, knobs or SearchKnobs())
    with faiss_threads(1 if len(q) == 1 else None):
        if params is None:
            return index.search(q, k)
        return index.search(q, k, params=params.params)


def recall_at_k(
    index: faiss.Index,
    vectors: np.ndarray,
    queries: np.ndarray,
    k: int = 10,
    knobs: SearchKnobs | None = None,
) -> float:
    """Recall@k of `index` against exact inner-product search over `vectors`.

    A returned row counts when its exact score reaches the exact k-th best score, so rows
    tied with the k-th (duplicate captions, say) are not counted as misses.
    """
    if len(queries) == 0 or len(vectors) == 0:
        return 1.0
    k = min(k, vectors.shape[0])
    _, got = search(index, queries, k, knobs)
    queries = np.ascontiguousarray(queries, np.float32)
    vectors = np.ascontiguousarray(vectors, np.float32)
    # the exact k-th best score per query, without a (queries x N) score matrix
    exact, _ = faiss.knn(queries, vectors, k, metric=faiss.METRIC_INNER_PRODUCT)
    kth = exact[:, k - 1]
    hits = 0
    for query, rows, bar in zip(queries, got, kth, strict=True):
        found = np.unique(rows[rows >= 0])
        hits += min(k, int((vectors[found] @ query >= bar - 1e-6).sum()))
    return hits / (k * len(queries))


def query_sample(queries: np.ndarray, size: int = 1000, seed: int = TRAIN_SEED) -> np.ndarray:
    """A seeded sample of up to `size` query vectors."""
    return queries[training_sample(len(queries), min(size, len(queries)), seed + 1)]


def bytes_per_vector(index: faiss.Index) -> float:
    """Serialized size of `index` divided by the vectors it holds."""
    if index.ntotal == 0:
        return 0.0
    return round(float(faiss.serialize_index(index).nbytes) / index.ntotal, 2)


def _inner(index: faiss.Index) -> faiss.Index:
    inner = faiss.downcast_index(index)
    while isinstance(inner, faiss.IndexPreTransform):
        inner = faiss.downcast_index(inner.index)
    return inner


def _ivf(index: faiss.Index) -> Any:
    try:
        return faiss.extract_index_ivf(index)
    except RuntimeError:
        return None


def _has_pq(index: faiss.Index) -> bool:
    ivf = _ivf(index)
    target = faiss.downcast_index(ivf) if ivf is not None else _inner(index)
    return getattr(target, "pq", None) is not None


def _seed(index: faiss.Index, seed: int) -> None:
    """Pin the k-means seeds FAISS uses (IVF coarse quantizer, PQ codebooks)."""
    ivf = _ivf(index)
    if ivf is not None:
        ivf.cp.seed = seed
        target = faiss.downcast_index(ivf)
    else:
        target = _inner(index)
    pq = getattr(target, "pq", None)
    if pq is not None:
        pq.cp.seed = seed
    if hasattr(target, "do_polysemous_training"):
        # only reorders codes for polysemous search, which duet does not use; slow to train
        target.do_polysemous_training = False
