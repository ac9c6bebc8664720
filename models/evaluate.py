"""Recall@K of the bi-encoder alone and with cross-encoder re-ranking (the papers' protocol), and
partial-query precision, of a model over images and captions held in memory: `duet train`'s
validation. The images and captions are encoded into a pool and scored by the same evaluator
as `duet eval` (`models.eval_modes`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from PIL import Image

from models import world
from models.builtin import BuiltinModel
from models.eval_metrics import KS, fit_matrix
from models.eval_modes import Plan, evaluate_partial_pool, evaluate_pool
from models.eval_pool import Pool
from models.fusion import DEFAULT_FUSION_LAMBDA, fuse

# pairs per cross-encoder call here (duet eval's is eval_pool.PAIR_BATCH): validation numbers
# stay bit for bit those of earlier runs
PAIR_BATCH = 1024


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
    pool = encode_pool(model, images, captions, batch)
    fusions = [("rerank", fuse, fusion_lambda), *((f"ADD_{lam}", fuse, lam) for lam in sweep)]
    plan = Plan(
        candidates=candidates,
        modes=("dot", "coop"),
        fusions=fusions,
        pair_batch=PAIR_BATCH,
        digits=None,
    )
    result = evaluate_pool(pool, model, plan)
    modes, fused = result["modes"], result["sweeps"]["fusion"]
    return {
        "dot": _recalls(modes["dot"]),
        "ce_only": _recalls(modes["coop"]),
        **{name: _recalls(r) for name, r in fused.items()},
    }


def _recalls(entry: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """An `evaluate_pool` entry's recalls per direction, without its timings."""
    return {"t2i": entry["t2i"], "i2t": entry["i2t"]}


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


def encode_pool(
    model: BuiltinModel,
    images: Sequence[Image.Image],
    captions: Sequence[Sequence[str]],
    batch: int = 256,
    scenes: Sequence[world.Scene] | None = None,
) -> Pool:
    """The pool of `images` and their `captions` (image i's captions are the text queries it
    answers), encoded `batch` at a time; `scenes`, when given, are the images'."""
    iv, itok = encode_images(model, images, batch)
    texts = [c for caps in captions for c in caps]
    owner = np.array([i for i, caps in enumerate(captions) for _ in caps], dtype=np.int64)
    tv = (
        np.concatenate(
            [model.encode_texts(texts[s : s + batch]) for s in range(0, len(texts), batch)]
        )
        if texts
        else np.zeros((0, iv.shape[1]), dtype=np.float32)
    )
    found: list[world.Scene | None] = [*scenes] if scenes is not None else [None] * len(images)
    return Pool(iv, itok, tv, texts, owner, len(images), len(texts), found)


def partial_precision(
    model: BuiltinModel,
    images: Sequence[Image.Image],
    scenes: Sequence[world.Scene],
    queries: Sequence[tuple[str, world.Desc]],
    candidates: int = 50,
    lambdas: Sequence[float] = (DEFAULT_FUSION_LAMBDA,),
    batch: int = 256,
) -> dict[str, dict[str, float]]:
    """P@1 / P@10 (`models.eval_metrics.precision`) of partial text queries over `images`
    (whose scenes are `scenes`): dot, the cross-encoder alone over the top `candidates`, and
    ADD_λ per λ."""
    pool = encode_pool(model, images, [], batch, scenes)
    texts = [t for t, _d in queries]
    fit = fit_matrix([d for _t, d in queries], scenes)
    result = evaluate_partial_pool(
        pool,
        texts,
        model.encode_texts(texts),
        fit,
        model,
        candidates=candidates,
        lambdas=lambdas,
        pair_batch=PAIR_BATCH,
    )
    modes = dict(result["modes"])
    return {"dot": modes.pop("dot"), "ce_only": modes.pop("coop"), **modes}


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
