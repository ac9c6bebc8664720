"""The host path with a heavy re-ranker (a Hugging Face cross-encoder, `models.hf`): its
image states resident on its GPU, and its pair budget measured at start on its own forward.

Why (BLIP ITM base, 224 M parameters, 577 states of 768 per image, one H100): the host path
cut batches at `rerank_max_batch`, 4096 pairs on a GPU, so 32 waiting requests became one
call of 1600 pairs whose 1.4 GB of float16 states were gathered from host memory, copied
to float32 and sent to the device by the one worker, longer than the deadline: answers
degraded, and the cost model, which priced that serial host work per pair, refused the rest
(1.3 full answers/s where the plain per-request script answered 21.7). Here the states are
copied to the device once per index version (when they fit), a batch's candidates are
gathered there, and the pairs per call are the smallest batch within 10 % of the best
pairs/s measured with this model at start, no longer than a quarter of the deadline.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from models.hf import HFBlipReranker, StateTable
from store.indexio import IndexVersion

log = logging.getLogger("duet.pipeline")

PROBE_TEXT = "a warm up query"


def heavy_reranker(model: Any) -> HFBlipReranker | None:
    """The model's cross-encoder when it is a Hugging Face one (BLIP ITM), else None."""
    cross = getattr(model, "cross", None)
    return cross if isinstance(cross, HFBlipReranker) else None


def make_resident(model: Any, index: IndexVersion) -> None:
    """Copy `index`'s image states to the heavy re-ranker's GPU, when there is one and they
    fit (`HFBlipReranker.resident`); otherwise its requests read them from the host."""
    reranker = heavy_reranker(model)
    if reranker is None or index.resident is not None or not len(index.image_tokens):
        return
    t0 = time.monotonic()
    table = reranker.resident(index.image_tokens)
    if table is None:
        if reranker.device.type == "cuda":
            log.info("index %s's image states stay on the host (too large)", index.version)
        return
    index.resident = table
    log.info(
        "index %s's image states resident on %s: %.1f MB in %.2fs",
        index.version,
        reranker.device,
        table.nbytes / 1e6,
        time.monotonic() - t0,
    )


def states_of(index: IndexVersion, rows: np.ndarray) -> Any:
    """The image states of `rows`: gathered on the device from a resident table, else read
    from the version's host table."""
    table = index.resident
    if isinstance(table, StateTable):
        return table.rows(rows)
    return index.token_rows(rows)


def concat(parts: list[Any]) -> Any:
    """The states of several queries as one batch: host arrays stay one host array; with a
    device tensor among them (a resident version's rows; the others, of a version not
    resident, are sent to its device) one tensor."""
    tensors = [p for p in parts if not isinstance(p, np.ndarray)]
    if not tensors:
        return np.concatenate(parts)
    import torch

    at = tensors[0]
    return torch.cat(
        [
            p if not isinstance(p, np.ndarray) else torch.from_numpy(p).to(at.device, at.dtype)
            for p in parts
        ]
    )


def measure_pair_budget(
    reranker: HFBlipReranker,
    index: IndexVersion,
    *,
    candidates: int,
    deadline_s: float,
    cap: int,
) -> tuple[int, float]:
    """(pairs per call, seconds per pair at it): calls of 1, 2, 4, ... queries of
    `candidates` pairs each, as requests make them, timed; the smallest within 10 % of the
    best pairs/s, stopping at `cap` pairs or once a call takes a quarter of `deadline_s`
    (a bigger batch would only add waiting, or leave no room for the queue)."""
    total = len(index.image_tokens)
    # what a scorer call costs beyond its pairs, for the length groups
    probe = np.arange(reranker.calibration_pairs) % total
    cost = reranker.calibrate(states_of(index, probe), PROBE_TEXT)
    log.info("heavy re-ranker: a scorer call costs %.0f pair-tokens beyond its pairs", cost)
    rates: dict[int, tuple[float, float]] = {}
    b = 1
    while b * candidates <= max(cap, candidates):
        rows = np.arange(b * candidates) % total
        texts = [PROBE_TEXT] * len(rows)
        try:
            reranker.score_pairs(texts, states_of(index, rows))  # builds the shape's kernels
            t0 = time.perf_counter()
            reranker.score_pairs(texts, states_of(index, rows))
            dt = time.perf_counter() - t0
        except RuntimeError:  # out of device memory: the batches that ran are the choice
            if not rates:
                raise
            log.warning("heavy re-ranker: %d pairs per call do not fit", len(rows))
            break
        rates[b] = (len(rows) / dt, dt / len(rows))
        if dt > deadline_s / 4:
            break
        b *= 2
    best = max(r for r, _ in rates.values())
    chosen = min(q for q, (r, _) in rates.items() if r >= 0.9 * best)
    log.info(
        "heavy re-ranker pair budget: %s pairs/s by queries per call; %d pairs chosen",
        {q: round(r) for q, (r, _) in rates.items()},
        chosen * candidates,
    )
    return chosen * candidates, rates[chosen][1]
