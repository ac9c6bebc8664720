"""Score fusion of the bi-encoder's dot product and the cross-encoder's logit (Rerank-Smart)."""

from __future__ import annotations

import numpy as np

# ADD_lambda weight the service uses by default (DUET_RERANK_FUSION_LAMBDA). Chosen on the
# validation split (world seed 999999) for the shipped weights, never on a test split: with
# this training budget the cross-encoder alone ranks worse than the dot product, fused better.
DEFAULT_FUSION_LAMBDA = 0.8


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
