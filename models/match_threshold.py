"""Choose the served score above which a hit reads as "fits the query" (`MATCH_THRESHOLD` in
models/fusion.py, the API's per-hit `match`), on validation splits only.

    python -m models.match_threshold [--model-dir models/weights] [--images 500]
                                     [--captions 500] [--partial 300] [--seeds 999999,999997]

Per split (images and their full captions from world seed s, partial queries such as "two
blue squares" from s - 1, as `models.tune_fusion` reads them), every query is served as the
service serves it by default: the dot product's top 50, re-ranked by the cross-encoder, scored
ADD_λ at λ = DEFAULT_FUSION_LAMBDA. Each of the top 10 hits is judged by whether its scene fits
the query (`models.world.satisfies`); about a third of the partial queries fit no image in
the pool, so they show what "nothing fits" scores. It prints, per threshold, how many fitting
and non-fitting hits it calls right, and the threshold with the best balanced accuracy (the
mean of the two rates; on a tie, the middle of the tied thresholds). Image queries against
the split's captions (a caption hit fits when it describes the query image's scene) are then
read at that threshold, the same one serving both directions.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from models import world
from models.builtin import BuiltinModel
from models.eval_metrics import top_m
from models.eval_pool import Direction, cross_scores, texts_to_images
from models.evaluate import encode_pool
from models.fusion import DEFAULT_FUSION_LAMBDA, fuse
from models.trainconfig import DEFAULT_WEIGHTS, HELD_OUT_SEED_BASE, check_validation_seeds

THRESHOLDS = tuple(round(0.01 * i, 2) for i in range(1, 100))
TOP_K = 10


def served_hits(
    model: BuiltinModel,
    seed: int,
    images: int,
    captions: int,
    partial: int,
    candidates: int = 50,
    top_k: int = TOP_K,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(scores, fits, query has a fit): the served scores (Q, top_k) of each query's hits,
    whether each hit fits its query (Q, top_k), and whether any pool image fits it (Q,)."""
    check_validation_seeds([seed])
    val = list(world.generate(images, seed, n_captions=5))
    scenes = [s.scene for s in val]
    pool = encode_pool(model, [s.image for s in val], [], scenes=scenes)
    texts = [s.captions[0] for s in val[:captions]]
    texts += [t for t, _d in world.partial_queries(partial, seed - 1)]
    fit = np.array([[world.satisfies(t, sc) for sc in scenes] for t in texts], dtype=bool)
    qv = model.encode_texts(texts)
    cand, dots = top_m(qv, pool.image_vecs, candidates)
    d = texts_to_images(pool, texts, qv, fit)
    served = fuse(dots, cross_scores(model, d, np.arange(len(texts)), cand), DEFAULT_FUSION_LAMBDA)
    order = np.argsort(-served, axis=1, kind="stable")[:, :top_k]
    rows = np.take_along_axis(cand, order, axis=1)
    return (
        np.take_along_axis(served, order, axis=1),
        np.take_along_axis(fit, rows, axis=1),
        np.asarray(fit.any(axis=1)),
    )


def served_caption_hits(
    model: BuiltinModel, seed: int, images: int, candidates: int = 50, top_k: int = TOP_K
) -> tuple[np.ndarray, np.ndarray]:
    """Image queries the same way: (scores, fits), each of `images` images of split `seed`
    against the five captions of every image there, a caption hit fitting when it describes
    the query image's scene (not only its own image's)."""
    check_validation_seeds([seed])
    val = list(world.generate(images, seed, n_captions=5))
    scenes = [s.scene for s in val]
    pool = encode_pool(model, [s.image for s in val], [s.captions for s in val], scenes=scenes)
    fit = np.array([[world.satisfies(t, sc) for t in pool.texts] for sc in scenes], dtype=bool)
    cand, dots = top_m(pool.image_vecs, pool.text_vecs, candidates)
    d = Direction(
        "i2t",
        pool.image_vecs,
        pool.text_vecs,
        pool.texts,
        pool.image_tokens,
        lambda q, it: it,
        lambda q, it: q,
        lambda q, it: fit[q, it],
    )
    served = fuse(dots, cross_scores(model, d, np.arange(images), cand), DEFAULT_FUSION_LAMBDA)
    order = np.argsort(-served, axis=1, kind="stable")[:, :top_k]
    rows = np.take_along_axis(cand, order, axis=1)
    return np.take_along_axis(served, order, axis=1), np.take_along_axis(fit, rows, axis=1)


def sweep(
    scores: np.ndarray, fits: np.ndarray, thresholds: Sequence[float] = THRESHOLDS
) -> list[dict[str, float]]:
    """Per threshold t (a hit "matches" when its score >= t): the share of fitting hits called
    a match (TPR), of non-fitting hits called weak (TNR), their mean (balanced accuracy), the
    precision of "match" and F1."""
    s, f = scores.reshape(-1), fits.reshape(-1)
    out = []
    for t in thresholds:
        called = s >= t
        tp, fp = int((called & f).sum()), int((called & ~f).sum())
        tpr = tp / max(1, int(f.sum()))
        tnr = int((~called & ~f).sum()) / max(1, int((~f).sum()))
        prec = tp / max(1, tp + fp)
        f1 = 2 * prec * tpr / (prec + tpr) if prec + tpr else 0.0
        out.append(
            {"threshold": t, "TPR": tpr, "TNR": tnr, "BA": (tpr + tnr) / 2, "P": prec, "F1": f1}
        )
    return out


def calibration(
    scores: np.ndarray, fits: np.ndarray, edges: Sequence[float] = (0, 0.1, 0.5, 0.8, 0.9)
) -> list[dict[str, Any]]:
    """Per score band [lo, hi): the hits in it and the share of them that fit, which is what
    a score says of a hit when it is read as a probability."""
    s, f = scores.reshape(-1), fits.reshape(-1)
    out = []
    for lo, hi in zip(edges, [*edges[1:], 1.01], strict=True):
        inside = (s >= lo) & (s < hi)
        n = int(inside.sum())
        out.append({"band": f"{lo:g}-{min(hi, 1):g}", "hits": n, "fit": int(f[inside].sum())})
    return out


def choose(rows: Sequence[dict[str, float]]) -> dict[str, float]:
    """The row with the best balanced accuracy; when several thresholds tie, the middle one
    (the farthest from either edge of the plateau)."""
    best = max(round(r["BA"], 6) for r in rows)
    tied = [r for r in rows if round(r["BA"], 6) == best]
    return tied[len(tied) // 2]


def main() -> None:
    """Print the sweep and the chosen threshold (JSON with --json)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", type=Path, default=DEFAULT_WEIGHTS)
    p.add_argument("--images", type=int, default=500)
    p.add_argument("--captions", type=int, default=500, help="full-caption queries per split")
    p.add_argument("--partial", type=int, default=300, help="partial queries per split")
    p.add_argument("--seeds", default=f"{HELD_OUT_SEED_BASE - 1},{HELD_OUT_SEED_BASE - 3}")
    p.add_argument(
        "--image-queries",
        type=int,
        default=500,
        help="image->caption queries per split, read at the chosen threshold (0: none)",
    )
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    check_validation_seeds(seeds)
    model = BuiltinModel.load(args.model_dir)
    parts = [served_hits(model, s, args.images, args.captions, args.partial) for s in seeds]
    scores = np.concatenate([p_[0] for p_ in parts])
    fits = np.concatenate([p_[1] for p_ in parts])
    has_fit = np.concatenate([p_[2] for p_ in parts])
    rows = sweep(scores, fits)
    best = choose(rows)
    t = best["threshold"]
    top_match = scores[:, 0] >= t
    summary = {
        "model": model.fingerprint,
        "seeds": seeds,
        "queries": len(scores),
        "hits": int(scores.size),
        "fitting hits": int(fits.sum()),
        "chosen": best,
        "queries with no fitting image": int((~has_fit).sum()),
        "... whose first hit is marked weak": int((~top_match & ~has_fit).sum()),
        "queries whose first hit fits": int(fits[:, 0].sum()),
        "... and is marked match": int((top_match & fits[:, 0]).sum()),
        "hits by score band, and how many fit": calibration(scores, fits),
        "median score, fitting / not fitting hits": [
            round(float(np.median(scores[fits])), 4),
            round(float(np.median(scores[~fits])), 4),
        ],
    }
    if args.image_queries:  # read at the chosen threshold, not used to choose it
        i2t = [served_caption_hits(model, s, args.image_queries) for s in seeds]
        i_scores = np.concatenate([p_[0] for p_ in i2t])
        i_fits = np.concatenate([p_[1] for p_ in i2t])
        summary["image queries at the chosen threshold"] = {
            "queries": len(i_scores),
            "hits": int(i_scores.size),
            "fitting hits": int(i_fits.sum()),
            **sweep(i_scores, i_fits, [t])[0],
        }
    if args.json:
        print(json.dumps({"summary": summary, "sweep": rows}, indent=1))
        return
    print("| threshold | TPR | TNR | balanced acc. | precision | F1 |\n|---|---|---|---|---|---|")
    for r in rows:
        if round(r["threshold"] * 100) % 5 == 0 or r is best:
            print(
                f"| {r['threshold']:.2f} | {r['TPR']:.4f} | {r['TNR']:.4f} | {r['BA']:.4f} "
                f"| {r['P']:.4f} | {r['F1']:.4f} |"
            )
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
