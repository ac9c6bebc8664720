"""A heavy re-ranker's ceiling: pairs/s of a BLIP ITM checkpoint's plain forward (what the
plain script runs, `HFBlipReranker.plain_scores`) against duet's scorer (`score_pairs`,
`models.blip_itm`), at several pairs per call, with the states already on the device (as a
resident table's rows are), and the largest logit difference between the two.

Texts are the demo world's captions, one per pair, so lengths vary as queries' do (the
scorer's hardest case: a served request's pairs share one sentence). The scorer's call cost
is measured first, as the service does at start (`HFBlipReranker.calibrate`), so its length
groups are the ones the service would form.

    python benchmarks/blip_base.py --out /tmp/blip-base --device cuda
    python benchmarks/blip_ceiling.py /tmp/blip-base --device cuda --out gpu-out/blip_ceiling.md
    python benchmarks/blip_ceiling.py /tmp/blip-base --pairs 50 --seconds 1   # the CPU
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from functools import partial
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.ce_ceiling import _rate  # noqa: E402


def measure(
    directory: Path, device: str, sizes: list[int], seconds: float
) -> list[dict[str, float]]:
    import torch

    from models.hf import HFBlipReranker
    from models.world import captions, sample_scene

    reranker = HFBlipReranker(directory, device)
    sync = torch.cuda.synchronize if reranker.device.type == "cuda" else (lambda: None)
    # what serving measures at start (app.heavy): a scorer call's own cost, for the groups
    probe = torch.randn(reranker.calibration_pairs, *reranker.token_shape)
    cost = reranker.calibrate(probe.to(reranker.device, reranker.model.dtype))
    print(f"a scorer call costs {cost:.0f} pair-tokens beyond its pairs", flush=True)
    rng = random.Random(5)
    rows = []
    for n in sizes:
        texts = [captions(rng, sample_scene(rng), 1)[0] for _ in range(n)]
        states = torch.randn(n, *reranker.token_shape, generator=torch.Generator().manual_seed(n))
        states = states.to(reranker.device, reranker.model.dtype)
        plain = _rate(partial(reranker.plain_scores, texts, states), n, seconds, sync)
        duet = _rate(partial(reranker.score_pairs, texts, states), n, seconds, sync)
        diff = np.abs(reranker.plain_scores(texts, states) - reranker.score_pairs(texts, states))
        row = {"pairs": n, "plain": plain, "duet": duet, "max_abs_diff": float(diff.max())}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def report(rows: list[dict[str, float]], directory: Path, device: str) -> str:
    lines = [
        f"BLIP ITM `{directory}` on {device}: pairs/s, the states on the device\n",
        "| pairs per call | plain forward | duet scorer | duet / plain | max logit diff |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['pairs']} | {r['plain']:,.0f} | {r['duet']:,.0f} | "
            f"{r['duet'] / r['plain']:.2f}x | {r['max_abs_diff']:.2g} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", type=Path, help="a BLIP ITM directory (benchmarks/blip_base.py)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--pairs", default="50,400,1600", help="pairs per call, comma-separated")
    p.add_argument("--seconds", type=float, default=1.0, help="timed seconds per cell")
    p.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = p.parse_args()
    rows = measure(
        args.checkpoint, args.device, [int(x) for x in args.pairs.split(",")], args.seconds
    )
    text = report(rows, args.checkpoint, args.device)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
