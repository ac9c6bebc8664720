"""benchmarks/border_probe.py on a small validation split: moved images, counts that agree
with models.ce_depth, test seeds refused."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

import numpy as np
import pytest
import torch

from models import world
from models.builtin import BuiltinModel
from models.ce_depth import depth_split
from models.trainconfig import HELD_OUT_SEED_BASE
from tests.conftest import REPO


def _load() -> ModuleType:
    """The benchmark is a script, not a package module: load it from its path."""
    spec = importlib.util.spec_from_file_location(
        "border_probe", REPO / "benchmarks" / "border_probe.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


border_probe = _load()


def test_moved_shifts_the_picture_over_its_background() -> None:
    image = next(world.generate(1, HELD_OUT_SEED_BASE - 1)).image
    before = np.asarray(image)
    after = np.asarray(border_probe.moved(image, 4, -4))
    assert after.shape == before.shape
    assert np.array_equal(after[:-4, 4:], before[4:, :-4])  # 4 px right, 4 px up
    assert (after[-4:, :] == before[0, 0]).all() and (after[:, :4] == before[0, 0]).all()


def test_counts_agree_with_ce_depth(model: BuiltinModel) -> None:
    seed = HELD_OUT_SEED_BASE - 1
    rows, counts = border_probe.probe_split(model, seed, 60)
    lost = depth_split(model, list(world.generate(60, seed)), (10, 50))["t2i"]["lost"]
    assert counts["queries"] == 300 and counts["lost"] == len(lost) == len(rows)
    assert 0 <= counts["mended"] <= counts["lost"] and 0 <= counts["seen"] <= counts["blind"]
    assert counts["blind"] < 30  # the shipped cross-encoder reads most own images right
    assert counts["read"] == 0  # no probe given, nothing read


def test_the_linear_probe_reads_the_stored_states(model: BuiltinModel) -> None:
    head = border_probe.linear_probe(model, images=400, steps=300)
    samples = list(world.generate(80, HELD_OUT_SEED_BASE - 1))
    states = border_probe._states(model, [s.image for s in samples])
    right = border_probe.read_right(head, states, [s.layout for s in samples])
    assert len(right) == 80 and sum(right) >= 40  # the states say what is where
    # a probe that never learnt reads almost nothing right
    blank = border_probe.linear_probe(model, images=40, steps=0)
    assert sum(border_probe.read_right(blank, states, [s.layout for s in samples])) < 20
    before = torch.random.get_rng_state()
    border_probe.linear_probe(model, images=40, steps=2)
    assert torch.equal(torch.random.get_rng_state(), before)  # torch's global stream untouched


def test_test_seeds_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        border_probe.main(["--seeds", str(HELD_OUT_SEED_BASE + 2026)])
    assert "validation seeds only" in capsys.readouterr().err
