"""`duet soup` (models.soup): the mean of fine-tuned cross-encoders over shared encoders, at toy
size through the real `train()`; sources that do not share their encoders are refused."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from duet.cli import main
from models import world
from models.builtin import WEIGHTS_FILE, BuiltinModel
from models.joint import CROSS_ENCODER
from models.soup import SoupError, averaged, soup
from models.train import train
from models.trainconfig import HELD_OUT_SEED_BASE, TrainConfig

TINY = TrainConfig(
    images=40,
    steps=2,
    batch=8,
    warmup=1,
    easy_steps=1,
    tower_steps=2,
    ce_steps=2,
    ce_batch=8,
    val_images=24,  # validation's figures are not what these tests check
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("soup")
    train(replace(TINY, han_steps=2, han_batch=4), root / "base", progress=False)
    warm = replace(TINY, ce_warm=True, ce_steps=3, han_steps=0)  # as `duet soup`'s hint says
    for name, seed in (("a", 1), ("b", 2), ("c", 3)):
        train(replace(warm, seed=seed), root / name, progress=False, init_from=root / "base")
    train(replace(TINY, seed=5, han_steps=0), root / "other", progress=False)
    return {p.name: p for p in root.iterdir()}


def test_the_soup_is_the_mean_cross_encoder_over_the_shared_encoders(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    sources = [runs["a"], runs["b"], runs["c"]]
    summary = soup(tmp_path / "s", sources, val_images=24)
    got = load_file(str(tmp_path / "s" / WEIGHTS_FILE))
    each = [load_file(str(s / WEIGHTS_FILE)) for s in sources]
    moved = 0
    for key, value in got.items():
        if key.startswith(CROSS_ENCODER):
            want = (each[0][key].double() + each[1][key].double() + each[2][key].double()) / 3
            assert torch.allclose(value.double(), want, atol=1e-6), key
            moved += not torch.equal(each[0][key], each[1][key])
        else:
            assert torch.equal(value, each[0][key]), key
    assert moved > 10  # the fine-tunes did differ, so the mean is a new cross-encoder
    # it loads, the HAN head and vocabulary come along, the record names every source
    model = BuiltinModel.load(tmp_path / "s")
    assert model.fingerprint == summary["fingerprint"]
    assert (tmp_path / "s" / "han.safetensors").is_file()
    record = json.loads((tmp_path / "s" / "train.json").read_text())
    assert [r["fingerprint"] for r in record["soup_of"]] == [
        BuiltinModel.load(s).fingerprint for s in sources
    ]
    assert all("--ce-warm" in r["command"] for r in record["soup_of"])
    assert "validation" in record and "validation_partial" in record
    # the soup's cross-encoder scores a pair near the fine-tunes' range, not far beyond it
    picture = next(iter(world.generate(1, HELD_OUT_SEED_BASE + 123))).image
    scores = [_score(BuiltinModel.load(s), picture) for s in sources]
    assert min(scores) - 0.5 <= _score(model, picture) <= max(scores) + 0.5


def _score(model: BuiltinModel, picture: Image.Image) -> float:
    return float(model.score_pairs(["a red circle"], model.encode_images([picture])[1])[0])


def test_sources_with_other_encoders_are_refused(runs: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(SoupError, match="do not share their encoders"):
        averaged([runs["a"], runs["other"]])
    with pytest.raises(SoupError, match="two or more"):
        averaged([runs["a"]])
    with pytest.raises(SoupError, match=r"no model\.safetensors"):
        averaged([runs["a"], tmp_path])
    with pytest.raises(SoupError, match="given twice"):
        averaged([runs["a"], runs["b"], runs["a"]])
    before = {f.name: f.read_bytes() for f in runs["a"].iterdir()}
    with pytest.raises(SoupError, match="one of the sources"):
        soup(runs["a"], [runs["a"], runs["b"]])
    assert {f.name: f.read_bytes() for f in runs["a"].iterdir()} == before  # nothing touched


def test_a_reused_out_keeps_no_stale_han_head(runs: dict[str, Path], tmp_path: Path) -> None:
    import shutil

    out = tmp_path / "s"
    shutil.copytree(runs["a"], out)  # a model with a HAN head was here before
    nohan = [tmp_path / "b", tmp_path / "c"]
    for src, name in zip(nohan, ("b", "c"), strict=True):
        shutil.copytree(runs[name], src)
        for f in ("han.safetensors", "han.json"):
            (src / f).unlink()
    soup(out, nohan, val_images=0)
    assert not (out / "han.safetensors").exists() and not (out / "han.json").exists()


def test_cli_soup_writes_a_model_or_says_why_not(
    runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["soup", "--out", str(tmp_path / "s"), "--val-images", "24"]
    assert main([*argv, str(runs["a"]), str(runs["b"])]) == 0
    assert "averaged 2 cross-encoders" in capsys.readouterr().out
    assert BuiltinModel.load(tmp_path / "s").fingerprint.startswith("duet-joint:")
    code = main(["soup", "--out", str(tmp_path / "t"), str(runs["a"]), str(runs["other"])])
    err = capsys.readouterr().err
    assert code == 2 and "do not share their encoders" in err and "--from" in err
    assert not (tmp_path / "t").exists()  # nothing written when refused
