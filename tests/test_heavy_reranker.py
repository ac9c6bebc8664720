"""The host path with a heavy (Hugging Face) re-ranker, on the real tiny BLIP ITM checkpoint
(tests/hf_checkpoints.py) and an index `duet build --reranker` made with it: image states sent
in float16 and scored as before, a resident table's rows the same as the host's, the pair
budget measured on the model at start, and many requests at once served in calls of that
budget, none degraded or refused."""

from __future__ import annotations

import asyncio
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from app.heavy import concat, heavy_reranker, make_resident, measure_pair_budget, states_of
from app.schemas import SearchOptions
from duet.cli import main
from models.hf import HFBlipReranker, StateTable
from models.loading import load_models
from models.world import write_corpus
from store import indexio
from tests.conftest import in_process_pipeline
from tests.hf_checkpoints import make_blip

N_IMAGES = 120  # more than a request's 50 candidates


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the BLIP checkpoint, an index of the builtin encoder with its states)."""
    root = tmp_path_factory.mktemp("heavy")
    blip = make_blip(root / "blip")
    corpus = write_corpus(root / "corpus", N_IMAGES, 77, progress=False)
    out = root / "idx"
    args = ["build", "--corpus", str(corpus), "--out", str(out), "--no-progress"]
    assert main([*args, "--reranker", str(blip)]) == 0
    return blip, out


def _open(out: Path, fingerprint: str) -> indexio.IndexVersion:
    return indexio.IndexVersion.open(indexio.resolve_current(out), expect_fingerprint=fingerprint)


def _library_itm(blip: HFBlipReranker, texts: list[str], states: np.ndarray) -> np.ndarray:
    """What score_pairs computed before: the states as float32 on the host, then the model."""
    enc = blip.processor.tokenizer(texts, padding=True, truncation=True, return_tensors="pt")
    image = torch.from_numpy(np.asarray(states, np.float32)).to(blip.model.dtype)
    with torch.inference_mode():
        hidden = blip.model.text_encoder(
            input_ids=enc["input_ids"],
            attention_mask=enc["attention_mask"],
            encoder_hidden_states=image,
            encoder_attention_mask=torch.ones(image.shape[:2], dtype=torch.long),
        ).last_hidden_state
        logits = blip.model.itm_head(hidden[:, 0, :]).float()
    return (logits[:, 1] - logits[:, 0]).numpy()


def test_states_in_float16_and_resident_rows_score_as_the_host_path(
    built: tuple[Path, Path],
) -> None:
    blip_dir, out = built
    models = load_models("builtin", str(blip_dir))
    blip = heavy_reranker(models)
    assert isinstance(blip, HFBlipReranker)
    index = _open(out, models.fingerprint)
    rows = np.array([5, 0, 77, 5, 119, 42])
    host = index.token_rows(rows)
    assert host.dtype == np.float16  # what the index stores and what travels
    texts = ["a small red circle left of a square"] * len(rows)
    # duet's scorer (models.blip_itm) against the library's forward: equal to rounding
    np.testing.assert_allclose(
        blip.score_pairs(texts, host), _library_itm(blip, texts, host), rtol=1e-4, atol=1e-6
    )
    expected = blip.score_pairs(texts, host)
    # a read-only memory map (the plain script's read) is scored alike, without a copy warning
    read_only = host.copy()
    read_only.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        np.testing.assert_array_equal(blip.score_pairs(texts, read_only), expected)
    # a table of the states on the model's device (here the CPU) gathers the same rows
    table = StateTable(index.image_tokens, blip.device, blip.model.dtype)
    assert blip.resident(index.image_tokens) is None  # on the CPU the host path reads them
    index.resident = table
    on_device = states_of(index, rows)
    assert isinstance(on_device, torch.Tensor)
    np.testing.assert_array_equal(blip.score_pairs(texts, on_device), expected)
    # a batch mixing a resident version's rows with a host version's
    mixed = concat([on_device[:3], host[3:]])
    np.testing.assert_array_equal(blip.score_pairs(texts, mixed), expected)
    table.release()
    assert table.nbytes == 0
    index.resident = None
    make_resident(models, index)  # CPU: nothing is copied
    assert index.resident is None
    index.close()


def test_pair_budget_is_measured_on_the_heavy_model(built: tuple[Path, Path]) -> None:
    blip_dir, out = built
    models = load_models("builtin", str(blip_dir))
    blip = heavy_reranker(models)
    assert blip is not None
    index = _open(out, models.fingerprint)
    pairs, per_pair = measure_pair_budget(blip, index, candidates=50, deadline_s=2.0, cap=400)
    assert pairs % 50 == 0 and 50 <= pairs <= 400
    assert 0 < per_pair * pairs < 2.0 / 4 * 1.5  # a call of the budget fits the deadline
    # a deadline no call fits: one request's candidates per call, whatever the cap
    assert measure_pair_budget(blip, index, candidates=50, deadline_s=1e-6, cap=4096)[0] == 50
    index.close()


async def test_many_requests_are_answered_whole_in_calls_of_the_budget(
    built: tuple[Path, Path],
) -> None:
    """The GPU's defaults on the host path (one worker, 4096 pairs per call unless measured):
    32 requests at once are all answered with every candidate re-ranked, no call over the
    measured budget, and each answer's scores are BLIP's own."""
    blip_dir, out = built
    models = load_models("builtin", str(blip_dir))
    index = _open(out, models.fingerprint)
    pipeline = in_process_pipeline(
        models,
        index,
        workers=1,
        rerank_max_batch=4096,
        timeout_s=10.0,
        measure_budget=True,
    )
    await pipeline.start()
    try:
        budget = pipeline.worker.rerank_max_batch
        assert budget % 50 == 0 and 50 <= budget <= 4096
        plan = pipeline.plan(SearchOptions(top_k=5, candidates=50))
        queries = [f"a small red circle number {i}" for i in range(32)]
        done = await asyncio.gather(
            *(pipeline.run(index, "text", q, None, plan, 50, 5) for q in queries)
        )
    finally:
        await pipeline.stop()
    answers = [a for a, _ in done]
    assert all(not a.degraded and a.reranked == 50 for a in answers)
    (family,) = list(pipeline.metrics.rerank_batch_size.collect())
    samples = {s.name: s.value for s in family.samples if "le" not in s.labels}
    # every pair scored, in calls cut at the measured budget
    assert samples["duet_rerank_batch_size_sum"] == 32 * 50
    assert samples["duet_rerank_batch_size_count"] >= -(-32 * 50 // budget)
    blip = heavy_reranker(models)
    assert blip is not None
    for q, a in zip(queries[:3], answers[:3], strict=True):
        rows = np.array([r for r, _, _, _ in a.ranked])
        want = 1 / (1 + np.exp(-blip.score_pairs([q] * len(rows), index.token_rows(rows))))
        got = np.array([rr for _, _, rr, _ in a.ranked], np.float64)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    index.close()
