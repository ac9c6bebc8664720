"""Choose the service's fusion weight λ on the validation split (never a test split).

    python -m models.tune_fusion [--model-dir models/weights] [--images 1000] [--candidates 50]
                                 [--seeds 999999,999997,...] [--device cpu]

For λ from 0 to 1 in steps of 0.1 it prints full-caption R@1 (text->image, image->text) over
the validation images (world seed 999,999) and P@1 / P@10 of partial queries (world seed
999,998) over the same images, with the cross-encoder re-ranking the dot product's top
`candidates` (the service's default M), and the λ with the best mean of the three R@1 / P@1.
With several `--seeds` (validation splits, as `models.ce_depth` reads them: images from seed s,
partial queries from s - 1) each figure is the mean over the splits.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from models import world
from models.builtin import BuiltinModel
from models.device import DEVICES
from models.evaluate import evaluate, partial_precision
from models.trainconfig import DEFAULT_WEIGHTS, HELD_OUT_SEED_BASE, check_validation_seeds

LAMBDAS = tuple(round(0.1 * i, 1) for i in range(11))


def sweep(
    model: BuiltinModel,
    images: int,
    candidates: int,
    queries: int = 300,
    seeds: Sequence[int] = (HELD_OUT_SEED_BASE - 1,),
) -> dict[str, dict[str, float]]:
    """{"ADD_λ": {"t2i R@1", "i2t R@1", "P@1", "P@10", "score"}, "dot", "ce_only"}: the mean
    over the validation splits `seeds` (never a test seed)."""
    check_validation_seeds(seeds)
    splits = [_split(model, images, candidates, queries, seed) for seed in seeds]
    out = {}
    for key in splits[0]:
        mean = {m: sum(r[key][m] for r in splits) / len(splits) for m in splits[0][key]}
        out[key] = {m: round(v, 4 if m.startswith("P@") else 2) for m, v in mean.items()}
    return out


def _split(
    model: BuiltinModel, images: int, candidates: int, queries: int, seed: int
) -> dict[str, dict[str, float]]:
    """One validation split's figures, unrounded: images from `seed`, partial queries from
    `seed - 1`."""
    val = list(world.generate(images, seed, n_captions=5))
    full = evaluate(
        model,
        [s.image for s in val],
        [s.captions for s in val],
        candidates=candidates,
        sweep=LAMBDAS,
    )
    part = partial_precision(
        model,
        [s.image for s in val],
        [s.scene for s in val],
        world.partial_queries(queries, seed - 1),
        candidates=candidates,
        lambdas=LAMBDAS,
    )
    out = {}
    for lam in LAMBDAS:
        key = f"ADD_{lam}"
        t2i, i2t = full[key]["t2i"]["R@1"], full[key]["i2t"]["R@1"]
        p1 = 100 * part[key]["P@1"]
        out[key] = {
            "t2i R@1": t2i,
            "i2t R@1": i2t,
            "P@1": part[key]["P@1"],
            "P@10": part[key]["P@10"],
            "score": (t2i + i2t + p1) / 3,
        }
    for mode in ("dot", "ce_only"):
        out[mode] = {
            "t2i R@1": full[mode]["t2i"]["R@1"],
            "i2t R@1": full[mode]["i2t"]["R@1"],
            "P@1": part[mode]["P@1"],
            "P@10": part[mode]["P@10"],
        }
    return out


def main() -> None:
    """Print the sweep as JSON lines and the chosen λ."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", type=Path, default=DEFAULT_WEIGHTS)
    p.add_argument(
        "--device",
        choices=DEVICES,
        default="cpu",
        help="where the model runs (cuda: the same figures, in fp32, in minutes; default cpu)",
    )
    p.add_argument("--images", type=int, default=1000)
    p.add_argument("--candidates", type=int, default=50)
    p.add_argument(
        "--seeds",
        default=str(HELD_OUT_SEED_BASE - 1),
        help="validation splits, comma-separated (each figure is their mean)",
    )
    args = p.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    model = BuiltinModel.load(args.model_dir, args.device, "fp32")
    res = sweep(model, args.images, args.candidates, seeds=seeds)
    for key, r in res.items():
        print(json.dumps({"mode": key, **r}))
    best = max((k for k in res if k.startswith("ADD_")), key=lambda k: res[k]["score"])
    print(f"best: {best}")


if __name__ == "__main__":
    main()
