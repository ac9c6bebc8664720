"""IVF k-means on a CUDA build's GPU, in torch: FAISS's own k-means (spherical for inner
product, its 10 iterations, a seeded random start, empty clusters split from populated ones)
with the assignment and the centroid sums as matrix products on the device. FAISS then only
trains the rest of the index (an SQ8 or PQ encoder) and fills it (`store.ann.build_index`'s
`centroids`). Without faiss-gpu, FAISS trains a coarse quantizer on the CPU's cores: at a
million images and five million captions (`IVF8192_HNSW32,SQ8`, `IVF16384_HNSW32,SQ8`) that
is the largest part of the build after encoding.

Deterministic for the same input on the same device: the sums are matrix products with a
one-hot matrix, not atomic adds, and the splits draw from a seeded generator."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from store.ann import TRAIN_SEED

NITER = 10  # FAISS's ClusteringParameters default, which an IVF trains with
EPS = 1 / 1024  # FAISS's perturbation of a split centroid
BLOCK = 1 << 25  # scores per (rows x centroids) block: 128 MB of float32


def spherical_kmeans(
    x: np.ndarray, k: int, device: torch.device, niter: int = NITER, seed: int = TRAIN_SEED
) -> np.ndarray:
    """(k, d) unit centroids of the unit rows of `x` (n >= k), float32."""
    rng = np.random.default_rng(seed)
    n, _ = x.shape
    if n < k:
        raise ValueError(f"k-means of {n} vectors into {k} clusters")
    xs = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(device)
    cent = xs[torch.from_numpy(rng.permutation(n)[:k]).to(device)].clone()
    rows = max(1, BLOCK // k)
    for _ in range(niter):
        sums = torch.zeros_like(cent)
        counts = torch.zeros(k, dtype=torch.float32, device=device)
        for lo in range(0, n, rows):
            part = xs[lo : lo + rows]
            best = (part @ cent.T).argmax(dim=1)
            onehot = torch.zeros(len(part), k, device=device)  # sums without atomic adds
            onehot.scatter_(1, best.unsqueeze(1), 1.0)
            sums += onehot.T @ part
            counts += onehot.sum(dim=0)
        cent = sums / counts.clamp(min=1.0).unsqueeze(1)
        cent = _split_empty(cent, counts.cpu().numpy(), n, rng)
        cent = F.normalize(cent, dim=1)
    return cent.cpu().numpy()


def _split_empty(
    cent: torch.Tensor, counts: np.ndarray, n: int, rng: np.random.Generator
) -> torch.Tensor:
    """Each empty cluster takes half of a populated one, chosen with odds by its size, as
    FAISS does: the two centroids moved apart by EPS, alternately along the dimensions."""
    empty = np.flatnonzero(counts == 0)
    if not len(empty):
        return cent
    out = cent.clone()
    sizes = counts.astype(np.float64)
    up = torch.ones(cent.shape[1], device=cent.device)
    up[1::2] = -1.0
    for ci in empty:
        weights = np.clip(sizes - 1.0, 0.0, None)
        if weights.sum() <= 0:
            break
        cj = int(rng.choice(len(sizes), p=weights / weights.sum()))
        base = out[cj].clone()
        out[ci] = base * (1 + EPS * up)
        out[cj] = base * (1 - EPS * up)
        sizes[ci] = sizes[cj] // 2
        sizes[cj] -= sizes[ci]
    return out


def gpu_kmeans(device: str) -> Callable[[np.ndarray, int, int], np.ndarray] | None:
    """For a CUDA build: the IVF centroids made on its GPU (`spherical_kmeans`). None on the
    CPU, where FAISS's own k-means runs on every core."""
    if device != "cuda" or not torch.cuda.is_available():
        return None
    dev = torch.device("cuda")

    def make(sample: np.ndarray, k: int, seed: int) -> np.ndarray:
        try:
            return spherical_kmeans(sample, k, dev, seed=seed)
        finally:
            torch.cuda.empty_cache()  # the sample and score blocks: ~1 GB at 16k lists

    return make
