"""The cross-encoder alone as it reads deeper into the dot product's list (Rerank-Smart Table 8),
on validation splits only: R@1 at each depth M from one scoring of the deepest list, and the
queries that going from the shallowest to the deepest M loses and wins.

    python -m models.ce_depth [--model-dir models/weights] [--seeds 999999,999997]
                              [--images 1000] [--depths 10,20,50] [--show 10] [--device cpu]

A query lost at depth M is one whose image the cross-encoder put first among the top 10 but
not among the top M: an image between ranks 11 and M outscored it. Each such image is judged
by its scene too (`fits`: the caption describes it word for word, a tie no ranking can break).
Seeds at or above 1,000,000 are refused: those are the test splits, never tuned on.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from models import world
from models.builtin import BuiltinModel
from models.device import DEVICES
from models.eval_pool import Pool, cross_scores, directions
from models.evaluate import PAIR_BATCH, encode_pool
from models.trainconfig import DEFAULT_WEIGHTS, HELD_OUT_SEED_BASE, check_validation_seeds

# the validation split (`duet train`'s and models.tune_fusion's) and a second one beside it;
# 999,998 draws the validation partial queries
SEEDS = (HELD_OUT_SEED_BASE - 1, HELD_OUT_SEED_BASE - 3)
DEPTHS = (10, 20, 50)


def depth_split(
    model: BuiltinModel, samples: Sequence[world.Sample], depths: Sequence[int] = DEPTHS
) -> dict[str, Any]:
    """Per direction: R@1 of the cross-encoder alone at each depth, fit-R@1 (the first hit's
    scene satisfies the caption) at each depth, and the queries lost and won from the
    shallowest depth to the deepest (lists of {"query", "put_first", "fits"})."""
    scenes = [s.scene for s in samples]
    pool = encode_pool(model, [s.image for s in samples], [s.captions for s in samples])
    deepest, out = max(depths), {}
    for d in directions(pool):
        queries = np.arange(len(d.query_vecs))
        sims = d.query_vecs @ d.item_vecs.T
        cand = np.argsort(-sims, axis=1, kind="stable")[:, :deepest]
        scores = cross_scores(model, d, queries, cand, PAIR_BATCH)
        firsts = {m: cand[queries, np.argmax(scores[:, :m], axis=1)] for m in sorted(set(depths))}
        hits = {m: d.is_hit(queries[:, None], f[:, None])[:, 0] for m, f in firsts.items()}
        fits = {m: _fits(d.name, pool, f, scenes) for m, f in firsts.items()}
        lo, hi = min(depths), deepest
        out[d.name] = {
            "queries": len(queries),
            "R@1": {m: round(100 * float(h.mean()), 2) for m, h in hits.items()},
            "fit R@1": {m: round(100 * float(f.mean()), 2) for m, f in fits.items()},
            "lost": _changed(d.name, pool, hits[lo] & ~hits[hi], firsts[hi], fits[hi], scenes),
            "won": _changed(d.name, pool, ~hits[lo] & hits[hi], firsts[lo], fits[lo], scenes),
        }
    return out


def _fits(
    direction: str, pool: Pool, first: np.ndarray, scenes: Sequence[world.Scene]
) -> np.ndarray:
    """Per query, whether its first hit fits: the hit image's scene satisfies the caption
    (t2i), or the image's scene satisfies the hit caption (i2t)."""
    pairs: Iterable[tuple[int, int]] = (
        zip(pool.owner.tolist(), first.tolist(), strict=True)
        if direction == "t2i"
        else ((int(pool.owner[c]), q) for q, c in enumerate(first.tolist()))
    )
    return np.array([world.satisfies(world.full_desc(scenes[a]), scenes[b]) for a, b in pairs])


def _changed(
    direction: str,
    pool: Pool,
    which: np.ndarray,
    first: np.ndarray,
    fit: np.ndarray,
    scenes: Sequence[world.Scene],
) -> list[dict[str, Any]]:
    """The queries `which` marks: the query, and what was put first instead of its answer."""
    rows = []
    for q in np.flatnonzero(which).tolist():
        if direction == "t2i":
            query, other = pool.texts[q], _say(scenes[int(first[q])])
        else:
            query, other = _say(scenes[q]), pool.texts[int(first[q])]
        rows.append({"query": query, "put_first": other, "fits": bool(fit[q])})
    return rows


def _say(scene: world.Scene) -> str:
    """A caption of `scene` naming everything in it (the same one every time)."""
    return world.describe(random.Random(0), world.full_desc(scene))


def depth_report(
    model: BuiltinModel, seeds: Sequence[int], images: int, depths: Sequence[int] = DEPTHS
) -> dict[str, Any]:
    """`depth_split` per validation seed, and the splits' queries pooled per direction."""
    check_validation_seeds(seeds)
    splits = {
        seed: depth_split(model, list(world.generate(images, seed)), depths) for seed in seeds
    }
    pooled = {}
    for name in ("t2i", "i2t"):
        parts = [s[name] for s in splits.values()]
        n = sum(p["queries"] for p in parts)
        pooled[name] = {
            "queries": n,
            "R@1": {
                m: round(sum(p["R@1"][m] * p["queries"] for p in parts) / n, 2) for m in depths
            },
            "lost": sum(len(p["lost"]) for p in parts),
            "won": sum(len(p["won"]) for p in parts),
        }
    return {"splits": splits, "pooled": pooled}


def format_report(report: dict[str, Any], show: int = 10) -> str:
    """The pooled table, then each split's lost queries (at most `show` per direction)."""
    depths = list(next(iter(report["pooled"].values()))["R@1"])
    lines = [
        "| direction | queries | " + " | ".join(f"R@1 M = {m}" for m in depths) + " | lost | won |",
        "|---|---|" + "---|" * len(depths) + "---|---|",
    ]
    for name, p in report["pooled"].items():
        cells = " | ".join(f"{p['R@1'][m]:.2f}" for m in depths)
        lines.append(f"| {name} | {p['queries']} | {cells} | {p['lost']} | {p['won']} |")
    for seed, split in report["splits"].items():
        for name, r in split.items():
            for row in r["lost"][:show]:
                lines.append(f"lost, seed {seed} {name}: {json.dumps(row)}")
    return "\n".join(lines)


def main() -> None:
    """Print the pooled table and the lost queries; --json prints the whole report."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", type=Path, default=DEFAULT_WEIGHTS)
    p.add_argument(
        "--device",
        choices=DEVICES,
        default="cpu",
        help="where the model runs (cuda: the same figures, in fp32, in minutes; default cpu)",
    )
    p.add_argument("--seeds", default=",".join(str(s) for s in SEEDS), help="validation seeds")
    p.add_argument("--images", type=int, default=1000, help="images per split (5 captions each)")
    p.add_argument("--depths", default=",".join(str(m) for m in DEPTHS))
    p.add_argument("--show", type=int, default=10, help="lost queries listed per split")
    p.add_argument("--json", action="store_true", help="the whole report as JSON")
    args = p.parse_args()
    report = depth_report(
        BuiltinModel.load(args.model_dir, args.device, "fp32"),
        [int(s) for s in args.seeds.split(",")],
        args.images,
        [int(m) for m in args.depths.split(",")],
    )
    print(json.dumps(report, indent=1) if args.json else format_report(report, args.show))


if __name__ == "__main__":
    main()
