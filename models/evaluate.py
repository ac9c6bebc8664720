"""Recall@K of the bi-encoder alone and with cross-encoder re-ranking (the papers' protocol)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from PIL import Image

from models import world
from models.builtin import BuiltinModel
from models.fusion import DEFAULT_FUSION_LAMBDA, fuse

KS = (1, 5, 10)
P_KS = (1, 10)


def recall(good: np.ndarray) -> dict[str, float]:
    """`good[q, r]` is True when the item at rank r answers query q -> R@1/5/10 in percent."""
    return {f"R@{k}": float(100.0 * good[:, :k].any(axis=1).mean()) for k in KS}


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


def _recall(ranked: np.ndarray, hit: np.ndarray) -> dict[str, float]:
    """`ranked` (Q, M) item indices per query; `hit[q, i]` is True when item i answers query q."""
    rows = np.arange(ranked.shape[0])[:, None]
    return recall(hit[rows, ranked])


def evaluate(
    model: BuiltinModel,
    images: Sequence[Image.Image],
    captions: Sequence[Sequence[str]],
    candidates: int = 20,
    batch: int = 256,
    fusion_lambda: float = DEFAULT_FUSION_LAMBDA,
    sweep: Sequence[float] = (),
) -> dict[str, dict[str, dict[str, float]]]:
    """R@1/5/10 for text->image and image->text: dot-only, cross-encoder alone over the top
    `candidates`, and the service's default re-rank (ADD_lambda fusion of both).

    Every caption of image i is a query whose answer is image i; every image is a query
    answered by any of its captions. Recalls are percentages, as the papers print them.
    Each λ of `sweep` adds the mode `ADD_λ` (the same scores fused with that weight).
    """
    texts = [c for caps in captions for c in caps]
    owner = np.array([i for i, caps in enumerate(captions) for _ in caps])
    iv, itok = encode_images(model, images, batch)
    tv = np.concatenate(
        [model.encode_texts(texts[s : s + batch]) for s in range(0, len(texts), batch)]
    )
    sim = tv @ iv.T  # (texts, images)
    hit_t2i = owner[:, None] == np.arange(len(images))[None, :]
    m = min(candidates, len(images))
    cand_t2i = np.argsort(-sim, axis=1, kind="stable")[:, :m]
    cand_i2t = np.argsort(-sim.T, axis=1, kind="stable")[:, : min(candidates, len(texts))]

    def ce(q_texts: list[str], toks: np.ndarray) -> np.ndarray:
        out = [
            model.score_pairs(q_texts[s : s + 1024], toks[s : s + 1024])
            for s in range(0, len(q_texts), 1024)
        ]
        return np.concatenate(out)

    t2i_pairs_text = [texts[q] for q in range(len(texts)) for _ in range(m)]
    s_t2i = ce(t2i_pairs_text, itok[cand_t2i.reshape(-1)]).reshape(cand_t2i.shape)
    mi = cand_i2t.shape[1]
    i2t_pairs_text = [texts[j] for j in cand_i2t.reshape(-1)]
    s_i2t = ce(i2t_pairs_text, np.repeat(itok, mi, axis=0)).reshape(cand_i2t.shape)
    d_t2i = np.take_along_axis(sim, cand_t2i, axis=1)
    d_i2t = np.take_along_axis(sim.T, cand_i2t, axis=1)
    swept = {
        f"ADD_{lam}": {
            "t2i": _recall(reorder(cand_t2i, fuse(d_t2i, s_t2i, lam)), hit_t2i),
            "i2t": _recall(reorder(cand_i2t, fuse(d_i2t, s_i2t, lam)), hit_t2i.T),
        }
        for lam in sweep
    }
    return {
        "dot": {"t2i": _recall(cand_t2i, hit_t2i), "i2t": _recall(cand_i2t, hit_t2i.T)},
        "ce_only": {
            "t2i": _recall(reorder(cand_t2i, s_t2i), hit_t2i),
            "i2t": _recall(reorder(cand_i2t, s_i2t), hit_t2i.T),
        },
        "rerank": {
            "t2i": _recall(reorder(cand_t2i, fuse(d_t2i, s_t2i, fusion_lambda)), hit_t2i),
            "i2t": _recall(reorder(cand_i2t, fuse(d_i2t, s_i2t, fusion_lambda)), hit_t2i.T),
        },
        **swept,
    }


def encode_images(
    model: BuiltinModel, images: Sequence[Image.Image], batch: int = 256
) -> tuple[np.ndarray, np.ndarray]:
    """(vectors, image states) of `images`, encoded `batch` at a time."""
    vecs, toks = [], []
    for s in range(0, len(images), batch):
        v, t = model.encode_images(images[s : s + batch])
        vecs.append(v)
        toks.append(t)
    return np.concatenate(vecs), np.concatenate(toks)


def partial_precision(
    model: BuiltinModel,
    images: Sequence[Image.Image],
    scenes: Sequence[world.Scene],
    queries: Sequence[tuple[str, world.Desc]],
    candidates: int = 50,
    lambdas: Sequence[float] = (DEFAULT_FUSION_LAMBDA,),
    batch: int = 256,
) -> dict[str, dict[str, float]]:
    """P@1 / P@10 (`precision`) of partial text queries over `images` (whose scenes are
    `scenes`): dot, the cross-encoder alone over the top `candidates`, and ADD_λ per λ."""
    iv, itok = encode_images(model, images, batch)
    texts = [t for t, _d in queries]
    fit = fit_matrix([d for _t, d in queries], scenes)
    sim = model.encode_texts(texts) @ iv.T
    cand = np.argsort(-sim, axis=1, kind="stable")[:, : min(candidates, len(images))]
    dots = np.take_along_axis(sim, cand, axis=1)
    pairs = [texts[q] for q in range(len(texts)) for _ in range(cand.shape[1])]
    flat = cand.reshape(-1)
    logits = np.concatenate(
        [
            model.score_pairs(pairs[s : s + 1024], itok[flat[s : s + 1024]])
            for s in range(0, len(pairs), 1024)
        ]
    ).reshape(cand.shape)
    out = {"dot": precision(cand, fit), "ce_only": precision(reorder(cand, logits), fit)}
    for lam in lambdas:
        out[f"ADD_{lam}"] = precision(reorder(cand, fuse(dots, logits, lam)), fit)
    return out


def format_table(result: dict[str, dict[str, dict[str, float]]]) -> str:
    """Markdown table of an `evaluate` result."""
    lines = [
        "| mode | t2i R@1 | t2i R@5 | t2i R@10 | i2t R@1 | i2t R@5 | i2t R@10 |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode, r in result.items():
        cells = [f"{r[d][f'R@{k}']:.1f}" for d in ("t2i", "i2t") for k in KS]
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
