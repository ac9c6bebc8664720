"""The serving cross-encoder (models.inference) computes JointModel.itm_logits exactly."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from models.builtin import BuiltinModel
from models.inference import CrossEncoderRuntime
from models.joint import JointConfig, JointModel


def _reference(
    model: JointModel,
    states: torch.Tensor,
    pad: torch.Tensor,
    owner: torch.Tensor,
    img: torch.Tensor,
) -> torch.Tensor:
    with torch.inference_mode():
        return model.itm_logits(states[owner], pad[owner], img)


@pytest.mark.parametrize("fusion_layers", [1, 2, 4])
def test_runtime_equals_the_training_forward(fusion_layers: int) -> None:
    """Sentences of different lengths (padded in the reference), interleaved pairs."""
    torch.manual_seed(0)
    cfg = JointConfig(vocab_size=50, d_model=32, n_heads=4, fusion_layers=fusion_layers)
    model = JointModel(cfg).eval()
    ids = torch.tensor([[2, 5, 6, 7, 0, 0], [2, 9, 0, 0, 0, 0], [2, 3, 4, 5, 6, 7]])
    pad = ids == 0
    with torch.inference_mode():
        states = model.text_tokens(ids, pad)
    owner = torch.tensor([2, 0, 1, 0, 2, 2, 1])
    img = torch.randn(len(owner), cfg.grid * cfg.grid, cfg.d_model)
    got = CrossEncoderRuntime(model).logits(states, (~pad).sum(1).tolist(), owner, img)
    np.testing.assert_allclose(
        got.numpy(), _reference(model, states, pad, owner, img).numpy(), rtol=1e-4, atol=1e-5
    )
    # a reduced-precision path (a GPU's fp16 / bf16; bf16 also runs on the CPU) stays close
    low = CrossEncoderRuntime(model, "bf16").logits(states, (~pad).sum(1).tolist(), owner, img)
    np.testing.assert_allclose(low.numpy(), got.numpy(), atol=0.1)
    assert CrossEncoderRuntime(model).logits(states, [4, 2, 6], owner[:0], img[:0]).shape == (0,)


def test_shipped_model_scores_equal_the_training_forward(model: BuiltinModel) -> None:
    texts = ["a red circle", "two blue squares above a small green cross", "a red circle"]
    rng = np.random.default_rng(0)
    toks = rng.standard_normal((3, *model.token_shape)).astype(np.float16)
    ids, pad = model.tokenizer.batch(texts)
    with torch.inference_mode():
        states = model.model.text_tokens(ids, pad)
        ref = model.model.itm_logits(states, pad, torch.from_numpy(toks).float())
    np.testing.assert_allclose(model.score_pairs(texts, toks), ref.numpy(), rtol=1e-4, atol=1e-5)


def test_unknown_precision_is_refused() -> None:
    with pytest.raises(ValueError, match="precision"):
        CrossEncoderRuntime(JointModel(JointConfig(vocab_size=10)), "int4")  # type: ignore[arg-type]


def test_an_image_querys_captions_are_scored_in_one_masked_call(model: BuiltinModel) -> None:
    """Few pairs per sentence length (an image query's candidate captions) go through one
    padded, masked call; one sentence against many images through the runtime. Both give
    the training forward's logits."""
    from models.builtin import FEW_PAIRS_PER_LENGTH

    words = ["red", "circle", "above", "a", "small", "blue", "square", "two", "green", "cross"]
    captions = [" ".join(words[: 1 + k % len(words)]) for k in range(12)]  # 10 lengths
    rng = np.random.default_rng(1)
    one = rng.standard_normal((1, *model.token_shape)).astype(np.float16)
    many = rng.standard_normal((40, *model.token_shape)).astype(np.float16)
    cases = [(captions, np.repeat(one, len(captions), axis=0)), (["a red circle"] * 40, many)]
    for texts, toks in cases:
        ids, pad = model.tokenizer.batch(texts)
        with torch.inference_mode():
            states = model.model.text_tokens(ids, pad)
            ref = model.model.itm_logits(states, pad, torch.from_numpy(toks).float())
        lengths = len(set((~pad).sum(1).tolist()))
        masked = len(texts) < FEW_PAIRS_PER_LENGTH * lengths
        assert masked == (texts is captions)
        calls: list[int] = []
        runtime = model.cross.logits

        def counted(*args: Any, calls: list[int] = calls, runtime: Any = runtime) -> torch.Tensor:
            calls.append(1)
            return runtime(*args)

        model.cross.logits = counted  # type: ignore[method-assign,assignment]
        try:
            got = model.score_pairs(texts, toks)
        finally:
            del model.cross.logits  # the class's method again
        assert calls == ([] if masked else [1])
        np.testing.assert_allclose(got, ref.numpy(), rtol=1e-4, atol=1e-5)
