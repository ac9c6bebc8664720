"""Score fusion of the bi-encoder's dot product and the cross-encoder's logit (Rerank-Smart)."""

from __future__ import annotations

import numpy as np

# ADD_lambda weight the service uses by default (DUET_RERANK_FUSION_LAMBDA). Chosen on six
# validation splits (world seeds 999,999 to 999,989) for the shipped weights, never on a test
# split (`python -m models.tune_fusion --seeds ...`; models/weights/README.md has the sweep).
DEFAULT_FUSION_LAMBDA = 0.1
# A served score (ADD at DEFAULT_FUSION_LAMBDA, the shipped weights) at or above this reads as
# "this hit fits the query": the API's per-hit `match`, the page's "weak" below it. Chosen on
# validation splits only (`python -m models.match_threshold`; docs/api.md has the figures);
# 0.71 for the weights before issue 37's fine-tune (0a5f8cf5), 0.5 for those shipped since.
# Cached answers carry `match`: a new value for the same weights needs a new cache-key prefix
# (app.cache.cache_key).
MATCH_THRESHOLD = 0.5


def sigmoid(logits: np.ndarray) -> np.ndarray:
    """The cross-encoder's match probability from its logit, float64."""
    return 1.0 / (1.0 + np.exp(-np.asarray(logits, dtype=np.float64)))


def add_scores(dots: np.ndarray, scores: np.ndarray, lam: float) -> np.ndarray:
    """ADD_lambda on a re-ranker score that is already a score (a probability, S_gl):
    lam * dot + (1 - lam) * score."""
    return lam * np.asarray(dots, dtype=np.float64) + (1.0 - lam) * np.asarray(
        scores, dtype=np.float64
    )


def norm_add_scores(dots: np.ndarray, scores: np.ndarray, lam: float) -> np.ndarray:
    """NORM_ADD_lambda on a re-ranker score: both 0-1 normalised over the query's candidates."""
    return lam * _minmax(np.asarray(dots, dtype=np.float64)) + (1.0 - lam) * _minmax(
        np.asarray(scores, dtype=np.float64)
    )


def fuse(dots: np.ndarray, logits: np.ndarray, lam: float) -> np.ndarray:
    """ADD_lambda: lam * dot + (1 - lam) * sigmoid(cross-encoder logit); lam = 0 is the CE alone."""
    return add_scores(dots, sigmoid(logits), lam)


def _minmax(x: np.ndarray) -> np.ndarray:
    """0-1 normalise along the last axis (each query's candidates); a constant row -> 0."""
    lo = x.min(axis=-1, keepdims=True)
    span = x.max(axis=-1, keepdims=True) - lo
    return np.divide(x - lo, span, out=np.zeros_like(x, dtype=np.float64), where=span > 0)


def norm_fuse(dots: np.ndarray, logits: np.ndarray, lam: float) -> np.ndarray:
    """NORM_ADD_lambda: ADD_lambda after 0-1 normalising both scores over each query's top-k."""
    return norm_add_scores(dots, sigmoid(logits), lam)


Ranked = tuple[int, float, float | None, float]  # row, dot, re-ranker score, score


def fused_top_k(
    rows: np.ndarray,
    dots: np.ndarray,
    scores: np.ndarray | None,
    fusion: str,
    lam: float | None,
    top_k: int,
) -> list[Ranked]:
    """(row, dot, re-ranker score, score) for the top-k of candidates `rows` (best by dot
    first), best first. `scores` are the re-ranker's own (a probability, S_gl, ...) for the
    first len(scores) candidates, fused with their dots as `fusion` says (none | add |
    norm_add, weight `lam`); `score` is what the hits are ordered by. Candidates left
    unscored (a degraded request) follow the re-ranked ones in dot order, scored by dot."""
    n = 0 if scores is None else len(scores)
    ranked: list[Ranked] = []
    if scores is not None and n:
        if fusion == "none":
            fused = np.asarray(scores, dtype=np.float64)
        else:
            assert lam is not None
            combine = add_scores if fusion == "add" else norm_add_scores
            fused = combine(dots[:n], scores, lam)
        order = np.argsort(-fused, kind="stable")[:top_k]
        ranked = [(int(rows[i]), float(dots[i]), float(scores[i]), float(fused[i])) for i in order]
    rest = top_k - len(ranked)
    ranked += [
        (int(r), float(d), None, float(d))
        for r, d in zip(rows[n : n + rest], dots[n : n + rest], strict=True)
    ]
    return ranked
