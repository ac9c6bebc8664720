"""Stage 2's moved views (models.ce_moves): moves that keep every shape in the picture, the
moved pictures and layouts, and the pairs and grounding targets of the rows shown moved, on
the shipped model and a small held-out world; then through the real `train()`."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from models import world
from models.builtin import BuiltinModel
from models.ce_moves import MAX_MOVE, move_of, moved, moved_images, moved_layout, step_layouts
from models.ce_negatives import CePool, ce_pairs, ce_pool
from models.trainconfig import HELD_OUT_SEED_BASE, TrainConfig

SAMPLES = list(world.generate(40, HELD_OUT_SEED_BASE + 71_000))


def test_moves_stay_small_and_keep_every_shape_in_the_picture() -> None:
    rng = random.Random(0)
    seen = set()
    for s in SAMPLES * 5:
        dx, dy = move_of(rng, s.layout)
        seen.add((dx, dy))
        assert abs(dx) <= MAX_MOVE and abs(dy) <= MAX_MOVE
        for _t, x, y, r in moved_layout(s.layout, dx, dy):
            # PIL paints from x - r to x + r inclusive: both inside the picture
            assert x - r >= 0 and x + r <= world.IMAGE_SIZE - 1, (s.scene, dx)
            assert y - r >= 0 and y + r <= world.IMAGE_SIZE - 1, (s.scene, dy)
    assert len(seen) > 30  # the moves spread over the allowed square, not a few corners
    # a shape touching the left edge can only move right
    thing = SAMPLES[0].layout[0][0]
    assert all(move_of(rng, [(thing, 7.0, 32.0, 7.0)])[0] >= 0 for _ in range(50))
    # one touching the far edge (its last painted column 63) only left
    assert all(move_of(rng, [(thing, 56.0, 32.0, 7.0)])[0] <= 0 for _ in range(50))


def test_moved_pictures_match_their_moves() -> None:
    images, moves = moved_images(random.Random(1), SAMPLES[:10])
    assert moves.shape == (10, 2) and bool(moves.abs().max() <= MAX_MOVE)
    assert (moves != 0).any(dim=1).sum() >= 7
    for s, image, (dx, dy) in zip(SAMPLES, images, moves.tolist(), strict=False):
        before, after = np.asarray(s.image), np.asarray(image)
        assert np.array_equal(np.asarray(moved(s.image, dx, dy)), after)
        h, w = before.shape[:2]
        # every pixel of the picture lands dx, dy further on
        src = before[max(0, -dy) : h - max(0, dy), max(0, -dx) : w - max(0, dx)]
        dst = after[max(0, dy) : h - max(0, -dy), max(0, dx) : w - max(0, -dx)]
        assert np.array_equal(src, dst)


@pytest.fixture(scope="module")
def moved_pool() -> tuple[CePool, BuiltinModel]:
    model = BuiltinModel.load()
    pool = ce_pool(model.model, model.tokenizer, SAMPLES, 0.5, random.Random(0), False, 20, 0, True)
    return pool, model


def test_rows_shown_moved_pair_their_captions_with_the_moved_states(
    moved_pool: tuple[CePool, BuiltinModel],
) -> None:
    pool, model = moved_pool
    assert pool.moved_states is not None and pool.moves is not None
    assert pool.moved_states.shape == pool.states.shape
    moved_rows = (pool.moves != 0).any(dim=1)
    # moved states differ from the plain ones exactly where the picture moved
    changed = (pool.moved_states.float() - pool.states.float()).abs().amax(dim=(1, 2)) > 1e-3
    assert torch.equal(changed, moved_rows)
    idx = torch.arange(12)
    shown = torch.tensor([k % 2 == 0 for k in range(12)])
    tok = model.tokenizer
    pairs = ce_pairs(model.model, tok, pool, idx, random.Random(2), 20, 0.5, shown)
    plain = ce_pairs(model.model, tok, pool, idx, random.Random(2), 20, 0.5)
    want = torch.where(shown[:, None, None], pool.moved_states[idx], pool.states[idx]).float()
    assert torch.equal(pairs.img[:12], want)  # the positives
    assert torch.equal(plain.img[:12], pool.states[idx].float())
    assert pairs.texts == plain.texts  # the same draws otherwise
    # the perturbed scene's caption and the ranked wrong caption are shown against the same
    # (moved or not) image; every other pair (wrong images, twins) is as without moves
    assert len(pairs.img) == len(plain.img) and torch.equal(pairs.t_idx, plain.t_idx)
    perturbed = (pairs.t_idx >= 12) & (pairs.t_idx < 24)
    assert torch.equal(pairs.img[perturbed], want[pairs.t_idx[perturbed] - 12])
    # the ranked wrong captions: one per row that has one, in row order, each beside its row's
    # image as shown
    after = -1
    for image in pairs.img[pairs.t_idx >= 24]:
        rows = [r for r in range(12) if r > after and torch.equal(want[r], image)]
        assert rows, "a ranked caption shown against an image other than its row's as shown"
        after = rows[0]
    rest = pairs.t_idx < 12
    rest[:12] = False
    assert torch.equal(pairs.img[rest], plain.img[rest])


def test_without_moves_the_pool_draws_the_same_random_numbers(
    moved_pool: tuple[CePool, BuiltinModel],
) -> None:
    _pool, model = moved_pool
    plain, off = random.Random(4), random.Random(4)
    ce_pool(model.model, model.tokenizer, SAMPLES[:10], 0.5, plain, False, 20, 0)
    ce_pool(model.model, model.tokenizer, SAMPLES[:10], 0.5, off, False, 20, 0, False)
    assert plain.getstate() == off.getstate()


def test_grounding_targets_follow_the_moved_things() -> None:
    moves = torch.tensor([[3, -2], [0, 0], [-4, 4]])
    shown = torch.tensor([True, True, False])
    layouts = step_layouts(SAMPLES, [0, 1, 2], moves, shown)
    (_t, x, y, r), *_ = layouts[0]
    _t0, x0, y0, r0 = SAMPLES[0].layout[0]
    assert (x, y, r) == (x0 + 3, y0 - 2, r0)
    assert layouts[1] == SAMPLES[1].layout and layouts[2] == SAMPLES[2].layout
    assert step_layouts(SAMPLES, [0, 1], None, None) == [SAMPLES[0].layout, SAMPLES[1].layout]


def test_train_shows_moved_images_when_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import models.train_ce as train_ce
    from models.train import train

    shown: list[torch.Tensor | None] = []
    real = ce_pairs

    def spying(*args: Any, **kw: Any) -> Any:  # the real pairs, what each step showed moved
        shown.append(args[7] if len(args) > 7 else kw.get("shown"))
        return real(*args, **kw)

    monkeypatch.setattr(train_ce, "ce_pairs", spying)
    tiny = TrainConfig(images=48, steps=2, batch=8, warmup=1, easy_steps=1, ce_steps=6)
    tiny = replace(tiny, ce_batch=8, han_steps=0, tower_steps=2, val_images=24)
    out = train(replace(tiny, ce_move=0.5), tmp_path / "m", progress=False)
    assert "--ce-move 0.5" in str(out["command"])
    assert len(shown) == 6 and all(s is not None for s in shown)
    share = torch.cat([s for s in shown if s is not None]).float().mean()
    assert 0.25 < share < 0.75
    shown.clear()
    train(tiny, tmp_path / "p", progress=False)
    assert shown == [None] * 6  # off: nothing moved, no pool of moved states
