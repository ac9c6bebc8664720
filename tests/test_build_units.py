"""The CPU build's pieces of work (`index_builder.cpu_encode`): batches of a shard's images
and chunks of its captions spread over the workers, put together into the very shards a
whole-shard encoder writes, an image that fails to decode included."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from index_builder.cpu_encode import _one_thread, encode_cpu_shards, shard_units
from index_builder.decode import PlanItem, decode, shard_batches
from index_builder.encode import SHARD_FIELDS, Encoder, ShardBuilder, read_shard, shard_path
from index_builder.stages import Stages
from models.builtin import BuiltinModel


def _plan(corpus: Path, n: int, broken: int, tmp: Path) -> list[PlanItem]:
    lines = [json.loads(x) for x in corpus.read_text().splitlines()[:n]]
    bad = tmp / "broken.png"
    bad.write_bytes(b"\x89PNG not really")
    plan = []
    for i, x in enumerate(lines):
        image = bad if i == broken else corpus.parent / x["image"]
        plan.append(PlanItem(i, x["id"], str(image), x["image"], i + 1, tuple(x["captions"])))
    return plan


def _whole_shard(
    plan: list[PlanItem], a: int, b: int, model: BuiltinModel
) -> dict[str, np.ndarray]:
    """A shard as one process encodes it in one go (as the Ray engine's actors do)."""
    shard = ShardBuilder(plan[a:b], Encoder(model, torch.device("cpu")), 3)
    with _one_thread():
        for positions in shard_batches(plan, a, b, 3):
            shard.add([decode(plan[p], model.model.cfg.image_size) for p in positions])
        return shard.finish(model.dim, model.token_shape)


@pytest.mark.parametrize("workers", [0, 2])
def test_units_put_together_are_the_whole_shards_bytes(
    tmp_path: Path, corpus: Path, model: BuiltinModel, workers: int
) -> None:
    plan = _plan(corpus, 10, broken=5, tmp=tmp_path)
    missing = [(0, 0, 4), (1, 4, 8), (2, 8, 10)]
    units, counts, orders = shard_units(plan, missing, 3)
    assert counts == [2 + 1, 2 + 1, 1 + 1] and sum(counts) == len(units)
    assert [u.shard for u in units] == [0, 0, 0, 1, 1, 1, 2, 2]
    assert units[2].texts and len(units[2].texts) == 4 * 5 and len(orders[0]) == 20
    stages = Stages()
    checked: list[int] = []
    encode_cpu_shards(
        plan, missing, tmp_path, model, 3, workers, False, lambda k, _: checked.append(k), stages
    )
    assert checked == [0, 1, 2]
    assert stages.seconds["encode_texts"] > 0 and stages.seconds["decode_busy"] > 0
    for k, a, b in missing:
        got, want = read_shard(shard_path(tmp_path, k)), _whole_shard(plan, a, b, model)
        for name in SHARD_FIELDS:
            assert got[name].dtype == want[name].dtype, (k, name)
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"shard {k} {name}")
    broken = read_shard(shard_path(tmp_path, 1))
    assert broken["image_ok"].tolist() == [True, False, True, True]
    assert len(broken["text_vectors"]) == 3 * 5  # the broken image's captions left out
