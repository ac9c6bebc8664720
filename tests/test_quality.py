"""The shipped weights on a generated test split never seen in training (the papers' protocol)."""

from __future__ import annotations

import pytest

from models import world
from models.builtin import BuiltinModel
from models.evaluate import evaluate, format_table
from models.trainconfig import HELD_OUT_SEED_BASE

pytestmark = pytest.mark.slow


def test_recall_dot_vs_reranked(model: BuiltinModel) -> None:
    split = list(world.generate(1000, HELD_OUT_SEED_BASE + 2026, n_captions=5))
    result = evaluate(model, [s.image for s in split], [s.captions for s in split], candidates=20)
    print("\n" + format_table(result))
    dot, rr = result["dot"], result["rerank"]
    # re-ranking must lift text->image R@1 over the bi-encoder alone
    assert rr["t2i"]["R@1"] > dot["t2i"]["R@1"]
    # and the model must be a real retriever, not noise (chance R@10 is 1%)
    assert dot["t2i"]["R@10"] > 40 and dot["i2t"]["R@10"] > 40
    assert rr["i2t"]["R@1"] >= dot["i2t"]["R@1"]
