"""Rankings over a pool and the metrics read from them: recall@K (the papers' full-caption
protocol) and precision@K (partial queries, judged by whether each hit's scene fits)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from models import world

KS = (1, 5, 10)
P_KS = (1, 10)
QUERY_CHUNK = 1024  # queries scored against the whole pool at once: bounds the (chunk, pool) matrix


def recall(good: np.ndarray, digits: int | None = None) -> dict[str, float]:
    """`good[q, r]` is True when the item at rank r answers query q -> R@1/5/10 in percent,
    rounded to `digits` decimals (None: as computed)."""
    got = {f"R@{k}": float(100.0 * good[:, :k].any(axis=1).mean()) for k in KS}
    return got if digits is None else {k: round(v, digits) for k, v in got.items()}


def fit_matrix(descs: Sequence[world.Desc], scenes: Sequence[world.Scene]) -> np.ndarray:
    """(queries, pool) bool: query q's description fits pool scene i."""
    return np.array([[world.satisfies(d, s) for s in scenes] for d in descs], dtype=bool)


def precision(ranked: np.ndarray, fit: np.ndarray) -> dict[str, float]:
    """P@1 and P@10 of `ranked` (Q, M) pool rows per query, best first, given `fit` (Q, pool):
    the share of the top k whose scene fits the query, out of min(k, scenes in the pool that fit
    it) so that 1.0 is always attainable. Queries that nothing fits are left out."""
    have = fit.sum(axis=1)
    keep = have > 0
    got = np.take_along_axis(fit, ranked, axis=1)[keep]
    return {
        f"P@{k}": round(float((got[:, :k].sum(axis=1) / np.minimum(k, have[keep])).mean()), 4)
        for k in P_KS
    }


def reorder(cand: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """Each query's candidates (Q, M) sorted by `scores` (Q, M), best first (stable)."""
    return np.take_along_axis(cand, np.argsort(-scores, axis=1, kind="stable"), axis=1)


def top_m(queries: np.ndarray, items: np.ndarray, m: int) -> tuple[np.ndarray, np.ndarray]:
    """(indices, dots), both (Q, m), best first, by exact inner product; equal dots keep pool
    order, so the result is the first m of a stable sort of every item."""
    m = min(m, len(items))
    out_i, out_d = [], []
    for s in range(0, len(queries), QUERY_CHUNK):
        sim = queries[s : s + QUERY_CHUNK] @ items.T
        best = _best_m(sim, m)
        d = np.take_along_axis(sim, best, axis=1)
        order = np.argsort(-d, axis=1, kind="stable")
        out_i.append(np.take_along_axis(best, order, axis=1))
        out_d.append(np.take_along_axis(d, order, axis=1))
    return np.concatenate(out_i), np.concatenate(out_d)


def _best_m(sim: np.ndarray, m: int) -> np.ndarray:
    """Per row of `sim`, the indices (ascending) of its m largest values, found without sorting
    the row; of the values equal to the m-th largest, the earliest rows' (as a stable sort
    takes them: duplicate captions or images tie exactly)."""
    if m >= sim.shape[1]:
        return np.broadcast_to(np.arange(sim.shape[1]), sim.shape)
    kth = -np.partition(-sim, m - 1, axis=1)[:, m - 1 : m]
    keep = sim > kth
    at = sim == kth
    room = m - keep.sum(axis=1)  # places left for values equal to the m-th
    tied = np.flatnonzero(at.sum(axis=1) > room)
    keep |= at
    if len(tied):
        first = np.cumsum(at[tied], axis=1) <= room[tied, None]
        keep[tied] = (sim[tied] > kth[tied]) | (at[tied] & first)
    return np.nonzero(keep)[1].reshape(len(sim), m)
