"""The shipped model loads, encodes and scores; losses match hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from models import world
from models.builtin import BuiltinModel, ModelLoadError
from models.losses import ce_bce_loss, cmr_loss


def test_shipped_weights_load_with_stable_fingerprint(model: BuiltinModel) -> None:
    again = BuiltinModel.load()
    assert again.fingerprint == model.fingerprint
    assert model.fingerprint.startswith("duet-joint:")


def test_vectors_are_l2_normalised(model: BuiltinModel) -> None:
    samples = list(world.generate(4, seed=1_000_500))
    t = model.encode_texts([s.captions[0] for s in samples])
    v, toks = model.encode_images([s.image for s in samples])
    assert t.shape == v.shape == (4, model.dim) and t.dtype == v.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(t, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    assert toks.shape == (4, *model.token_shape) and toks.dtype == np.float16


def test_batching_does_not_change_results(model: BuiltinModel) -> None:
    samples = list(world.generate(6, seed=1_000_501))
    caps = [s.captions[0] for s in samples]
    _, toks = model.encode_images([s.image for s in samples])
    together = model.score_pairs(caps, toks)
    alone = np.array([model.score_pairs([c], toks[i : i + 1])[0] for i, c in enumerate(caps)])
    np.testing.assert_allclose(together, alone, atol=1e-4)
    np.testing.assert_allclose(model.encode_texts(caps)[2], model.encode_texts([caps[2]])[0],
                               atol=1e-5)


def test_cross_encoder_prefers_the_true_caption(model: BuiltinModel) -> None:
    samples = list(world.generate(50, seed=1_000_502))
    _, toks = model.encode_images([s.image for s in samples])
    right = model.score_pairs([s.captions[0] for s in samples], toks)
    wrong = model.score_pairs([samples[(i + 1) % 50].captions[0] for i in range(50)], toks)
    assert (right > wrong).mean() > 0.9


def test_missing_model_dir_says_how_to_fix(tmp_path: object) -> None:
    with pytest.raises(ModelLoadError, match="duet train"):
        BuiltinModel.load(tmp_path)  # type: ignore[arg-type]


def test_cmr_loss_hand_computed() -> None:
    sim = torch.tensor([[2.0, 0.0], [1.0, 3.0]])
    # rows: -log softmax([2,0])[0], -log softmax([1,3])[1]; columns: [2,1] -> 0, [0,3] -> 1
    rows = (math.log(1 + math.exp(-2)) + math.log(1 + math.exp(-2))) / 2
    cols = (math.log(1 + math.exp(-1)) + math.log(1 + math.exp(-3))) / 2
    assert cmr_loss(sim).item() == pytest.approx((rows + cols) / 2, rel=1e-6)
    extra = torch.tensor([[0.5], [4.0]])
    cols_x = (-math.log(math.exp(2) / (math.exp(2) + math.exp(1) + math.exp(0.5)))
              - math.log(math.exp(3) / (math.exp(0) + math.exp(3) + math.exp(4)))) / 2
    assert cmr_loss(sim, extra).item() == pytest.approx((rows + cols_x) / 2, rel=1e-6)


def test_ce_bce_loss_hand_computed() -> None:
    pos = torch.tensor([2.0])
    neg = torch.tensor([-1.0, 0.5])

    def softplus(x: float) -> float:
        return math.log(1 + math.exp(x))
    # positives weighted by #neg/#pos = 2; both classes count equally
    want = (2 * softplus(-2.0) + softplus(-1.0) + softplus(0.5)) / 4
    assert ce_bce_loss(pos, neg).item() == pytest.approx(want, rel=1e-6)
