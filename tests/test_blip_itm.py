"""BLIP ITM's text encoder as duet scores pairs with it (`models.blip_itm`): the same logits
as the module's own forward, on a real (small, random) `BlipForImageTextRetrieval`, for
sentences shorter than a head's dimensions (the query carried to the states) and longer
(keys and values made), with padding, over several layers; and the re-ranker's two ways on
the tiny checkpoint the other adapter tests use."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from models.blip_itm import BlipItmScorer
from models.hf import HFBlipReranker, length_groups
from models.masked_cross import pin_attention
from tests.hf_checkpoints import make_blip

HEADS, HIDDEN, WIDTH, STATES = 4, 64, 48, 17  # a head has 16 dimensions


def _model(device: str = "cpu", dtype: torch.dtype = torch.float32) -> Any:
    import transformers as tf

    torch.manual_seed(3)
    layer = {"num_attention_heads": HEADS, "intermediate_size": 128, "num_hidden_layers": 3}
    cfg = tf.BlipConfig(
        text_config={
            **layer,
            "hidden_size": HIDDEN,
            "encoder_hidden_size": WIDTH,
            "vocab_size": 50,
            "max_position_embeddings": 40,
            "pad_token_id": 0,
            "is_decoder": True,
            "initializer_range": 0.2,  # logits that differ from pair to pair
        },
        vision_config={**layer, "hidden_size": WIDTH, "image_size": 16, "patch_size": 4},
        projection_dim=16,
    )
    model = tf.BlipForImageTextRetrieval(cfg).eval()
    with torch.no_grad():  # the library starts biases at 0 and norms at 1: a test of them
        for name, p in model.named_parameters():
            if name.endswith("bias") or "LayerNorm" in name or "layer_norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model.to(device, dtype)


def _reference(model: Any, ids: torch.Tensor, mask: torch.Tensor, states: torch.Tensor) -> Any:
    with torch.inference_mode():
        hidden = model.text_encoder(
            input_ids=ids,
            attention_mask=mask,
            encoder_hidden_states=states,
            encoder_attention_mask=torch.ones(
                states.shape[:2], dtype=torch.long, device=states.device
            ),
        ).last_hidden_state
        out = model.itm_head(hidden[:, 0]).float()
    return out[:, 1] - out[:, 0]


def _pairs(n: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """n pairs of `length`-token ids, the later ones padded, and random states."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 50, (n, length), generator=g)
    mask = torch.ones(n, length, dtype=torch.long)
    for i in range(1, n):
        mask[i, length - i % (length - 1) :] = 0
    ids[mask == 0] = 0
    return ids, mask, torch.randn(n, STATES, WIDTH, generator=g)


@pytest.mark.parametrize("length", [5, 15, 16, 30])
def test_the_scorer_gives_the_modules_logits(length: int) -> None:
    model = _model()
    scorer = BlipItmScorer.of(model)
    assert scorer is not None and scorer.head_dim == 16
    ids, mask, states = _pairs(8, length, seed=length)
    want = _reference(model, ids, mask, states)
    got = scorer.logits(ids, mask, states)
    assert want.std() > 0.05  # pairs that score differently: the comparison can fail
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_pairs_are_grouped_by_sentence_length() -> None:
    groups = length_groups(np.array([3, 12, 8, 9, 1, 16, 17]), step=8)
    assert [g.tolist() for g in groups] == [[0, 2, 4], [1, 3, 5], [6]]


def test_groups_too_small_to_pay_for_their_call_join_the_next_longer() -> None:
    lengths = np.array([3, 12, 8, 9, 1, 16, 17, 30, 31, 29])
    split = [[0, 2, 4], [1, 3, 5], [6], [7, 8, 9]]
    assert [g.tolist() for g in length_groups(lengths, 8, call_cost=0)] == split
    # padding [0, 2, 4] to 16 tokens is 3 x 8 = 24 pair-tokens: under 25 it joins; the six
    # then to 17 is 6 x 1 = 6 (joins); those seven to 31 is 7 x 14 = 98 (stays apart)
    merged = length_groups(lengths, 8, call_cost=25)
    assert [g.tolist() for g in merged] == [[0, 1, 2, 3, 4, 5, 6], [7, 8, 9]]
    assert [g.tolist() for g in length_groups(lengths, 8, call_cost=23)] == [
        [0, 2, 4],
        [1, 3, 5, 6],
        [7, 8, 9],
    ]
    whole = length_groups(lengths, 8, call_cost=1e9)  # every pair in one padded call
    assert [g.tolist() for g in whole] == [list(range(10))]


def test_a_model_not_laid_out_as_blip_gets_no_scorer() -> None:
    assert BlipItmScorer.of(object()) is None
    model = _model()
    model.text_encoder.config.position_embedding_type = "relative_key"
    assert BlipItmScorer.of(model) is None


def test_the_reranker_scores_as_its_plain_forward(tmp_path: Path) -> None:
    reranker = HFBlipReranker(make_blip(tmp_path / "blip"), "cpu")
    assert reranker.scorer is not None
    rng = np.random.default_rng(0)
    states = rng.standard_normal((6, *reranker.token_shape)).astype(np.float16)
    texts = ["a small red circle", "x", "three yellow diamonds and a purple star above"] * 2
    lengths = reranker.processor.tokenizer(texts, padding=True, return_tensors="np")
    assert len(length_groups(lengths["attention_mask"].sum(axis=1))) == 2  # scored apart
    plain = reranker.plain_scores(texts, states)
    np.testing.assert_allclose(reranker.score_pairs(texts, states), plain, rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="6 texts but 2"):
        reranker.score_pairs(texts, states[:2])
    cost = reranker.calibrate(states[:4])  # measured on this CPU: a number, kept
    assert reranker.call_cost == cost
    probe = reranker.processor.tokenizer(["a warm up query"])["input_ids"][0]
    assert 0 <= cost <= 4 * len(probe)  # no more than the pair-tokens it timed
    reranker.call_cost = 1e9  # every pair in one call, padded: the same logits
    np.testing.assert_allclose(reranker.score_pairs(texts, states), plain, rtol=1e-4, atol=1e-6)
    reranker.call_cost = 0.0
    reranker.processor.tokenizer.padding_side = "left"  # the scorer cuts columns from the right
    np.testing.assert_array_equal(
        reranker.score_pairs(texts, states), reranker.plain_scores(texts, states)
    )
    reranker.processor.tokenizer.padding_side = "right"
    reranker.scorer = None  # the fallback is the plain forward
    np.testing.assert_array_equal(reranker.score_pairs(texts, states), plain)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_on_cuda_the_scorer_is_as_near_the_fp32_logits_as_the_module(dtype: torch.dtype) -> None:
    """In half precision neither way gives the fp32 logits; the scorer's rounding error is
    held to about the module's own."""
    exact = _model("cuda")
    half = copy.deepcopy(exact).to(dtype)
    scorer = BlipItmScorer.of(half)
    assert scorer is not None
    ids, mask, states = _pairs(64, 12, seed=1)
    ids, mask = ids.cuda(), mask.cuda()
    want = _reference(exact, ids, mask, states.cuda())
    assert want.std() > 0.05
    module = (_reference(half, ids, mask, states.to("cuda", dtype)) - want).abs().max()
    got = (scorer.logits(ids, mask, states.to("cuda", dtype)) - want).abs().max()
    assert got <= 2 * module + 1e-3, (float(got), float(module))


def test_attention_is_pinned_for_the_process_on_cuda_only() -> None:
    """The host path's and the scorer's attention kernels: cuDNN's (a graph per new shape)
    switched off process-wide on CUDA, so no worker's leaving a kernel context re-enables
    it under another; on the CPU torch's own choice stays."""
    flags = torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled()
    pin_attention(torch.device("cpu"))
    assert (
        torch.backends.cuda.cudnn_sdp_enabled(),
        torch.backends.cuda.flash_sdp_enabled(),
    ) == flags
    if torch.cuda.is_available():
        pin_attention(torch.device("cuda"))
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.mem_efficient_sdp_enabled()
