"""HAN's matching head: alignment against a hand computation, masking, invariances."""

from __future__ import annotations

import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from models import world
from models.builtin import BuiltinModel
from models.han import HAN, HANConfig, HANReranker, align_and_match, regions_of, save_han
from models.late import kmeans_regions
from models.losses import softmax_triplet_loss
from models.train_han import han_scores, train_han


def test_align_and_match_hand_computed() -> None:
    words = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
    regions = torch.tensor([[[2.0, 0.0], [0.0, 3.0], [1.0, 1.0]]])
    beta = 2.0
    got = align_and_match(
        words, torch.ones(1, 2, dtype=torch.bool), regions, torch.ones(1, 3, dtype=torch.bool), beta
    )
    # by hand: word 1's cosines to the regions are 1, 0, 1/sqrt2
    c = 1 / math.sqrt(2)
    a = np.exp(beta * np.array([1.0, 0.0, c]))
    a /= a.sum()
    aligned = a[0] * np.array([2.0, 0.0]) + a[1] * np.array([0.0, 3.0]) + a[2] * np.array([1, 1])
    r1 = aligned[0] / np.linalg.norm(aligned)
    # word 2 is word 1 mirrored (x <-> y) against regions 2, 1, 3 with lengths 3, 2, sqrt2
    a2 = np.exp(beta * np.array([0.0, 1.0, c]))
    a2 /= a2.sum()
    aligned2 = (
        a2[0] * np.array([2.0, 0.0]) + a2[1] * np.array([0.0, 3.0]) + a2[2] * np.array([1, 1])
    )
    r2 = aligned2[1] / np.linalg.norm(aligned2)
    assert float(got[0]) == pytest.approx((r1 + r2) / 2, abs=1e-6)


def test_padding_and_order_do_not_change_the_score() -> None:
    torch.manual_seed(0)
    model = HAN(HANConfig(word_dim=8, region_dim=6, dim=16, layers=2)).eval()
    words, regions = torch.randn(3, 5, 8), torch.randn(3, 4, 6)
    wm, rm = torch.ones(3, 5, dtype=torch.bool), torch.ones(3, 4, dtype=torch.bool)
    base = model(words, wm, regions, rm)
    assert base.shape == (3,) and torch.all(base.abs() <= 1 + 1e-5)
    # extra padded words and regions (garbage values) are ignored
    pw = torch.cat([words, 100 * torch.randn(3, 2, 8)], dim=1)
    pr = torch.cat([regions, 100 * torch.randn(3, 3, 6)], dim=1)
    pwm = torch.cat([wm, torch.zeros(3, 2, dtype=torch.bool)], dim=1)
    prm = torch.cat([rm, torch.zeros(3, 3, dtype=torch.bool)], dim=1)
    torch.testing.assert_close(model(pw, pwm, pr, prm), base, atol=1e-5, rtol=1e-5)
    # regions are a set: their order does not matter
    perm = torch.tensor([2, 0, 3, 1])
    torch.testing.assert_close(model(words, wm, regions[:, perm], rm), base, atol=1e-5, rtol=1e-5)


def test_han_trains_with_the_softmax_triplet_loss() -> None:
    """A few steps on matched (sentence, image) pairs raise positives above negatives."""
    torch.manual_seed(0)
    b, n, m, d = 8, 4, 5, 12
    model = HAN(HANConfig(word_dim=d, region_dim=d, dim=d, layers=1))
    regions = torch.randn(b, m, d)
    words = regions[:, :n] + 0.3 * torch.randn(b, n, d)  # each caption "describes" its image
    wm = torch.ones(b, n, dtype=torch.bool)

    def scores() -> torch.Tensor:  # (captions, images)
        return han_scores(model, words, wm, regions)

    def accuracy() -> float:
        with torch.no_grad():
            return float((scores().argmax(dim=1) == torch.arange(b)).float().mean())

    before = accuracy()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(30):
        loss = softmax_triplet_loss(scores(), margin=0.2, p=8.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert before < 0.5 and accuracy() >= 0.75


def test_batch_score_matrix_is_every_pair() -> None:
    torch.manual_seed(1)
    model = HAN(HANConfig(word_dim=6, region_dim=6, dim=8)).eval()
    words, regions = torch.randn(3, 4, 6), torch.randn(3, 5, 6)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    with torch.no_grad():
        got = han_scores(model, words, mask, regions)
    for i in range(3):
        for j in range(3):
            with torch.no_grad():
                want = model(
                    words[i : i + 1],
                    mask[i : i + 1],
                    regions[j : j + 1],
                    torch.ones(1, 5, dtype=torch.bool),
                )
            assert float(got[i, j]) == pytest.approx(float(want[0]), abs=1e-5)


def test_regions_are_the_patches_or_their_kmeans_centres() -> None:
    rng = np.random.default_rng(0)
    few = rng.normal(size=(2, 16, 4)).astype(np.float32)
    np.testing.assert_array_equal(regions_of(few), few)  # 16 patches <= 32 regions: as they are
    many = rng.normal(size=(2, 40, 4)).astype(np.float32)
    got = regions_of(many, k=32)
    assert got.shape == (2, 32, 4)
    np.testing.assert_allclose(got[1], kmeans_regions(many[1], 32))


def test_saved_head_scores_what_it_scored_before(model: BuiltinModel, tmp_path: Path) -> None:
    assert HANReranker.load(tmp_path, model) is None  # no head in this directory
    torch.manual_seed(2)
    head = HAN(HANConfig()).eval()
    save_han(head, tmp_path)
    loaded = HANReranker.load(tmp_path, model)
    assert loaded is not None
    texts = ["a red circle above a blue square", "a small green cross in the center"]
    tokens = model.encode_images(
        [world.render(random.Random(i), world.sample_scene(random.Random(i))) for i in range(2)]
    )[1]
    words, mask = model.text_token_features(texts)
    with torch.no_grad():
        want = head(
            torch.from_numpy(words),
            torch.from_numpy(mask),
            torch.from_numpy(tokens.astype(np.float32)),
            torch.ones(2, tokens.shape[1], dtype=torch.bool),
        ).numpy()
    np.testing.assert_allclose(loaded.score_pairs(texts, tokens), want, atol=1e-5)
    assert loaded.score_pairs([], tokens[:0]).shape == (0,)


def test_train_han_runs_on_the_models_features(model: BuiltinModel) -> None:
    samples = list(world.generate(12, seed=5, n_captions=2))
    torch.manual_seed(3)
    head = train_han(
        model.model,
        model.tokenizer,
        samples,
        steps=3,
        batch=8,
        lr=1e-3,
        p=8.0,
        margin=0.2,
        rng=random.Random(0),
        progress=False,
    )
    assert not head.training
    assert head.word_proj.in_features == model.model.cfg.d_model
