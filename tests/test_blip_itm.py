"""BLIP ITM's text encoder as duet scores pairs with it (`models.blip_itm`): the same logits
as the module's own forward, on a real (small, random) `BlipForImageTextRetrieval`, for
sentences shorter than a head's dimensions (the query carried to the states) and longer
(keys and values made), with padding, over several layers; and the re-ranker's two ways on
the tiny checkpoint the other adapter tests use."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from models.blip_itm import BlipItmScorer
from models.hf import HFBlipReranker, length_groups
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
    return tf.BlipForImageTextRetrieval(cfg).eval().to(device, dtype)


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
    reranker.scorer = None  # the fallback is the plain forward
    np.testing.assert_array_equal(reranker.score_pairs(texts, states), plain)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_on_cuda_the_scorer_gives_the_modules_logits_in_half_precision(
    dtype: torch.dtype,
) -> None:
    model = _model("cuda", dtype)
    scorer = BlipItmScorer.of(model)
    assert scorer is not None
    ids, mask, states = _pairs(64, 12, seed=1)
    want = _reference(model, ids.cuda(), mask.cuda(), states.to("cuda", dtype))
    got = scorer.logits(ids.cuda(), mask.cuda(), states.to("cuda", dtype))
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.05)
