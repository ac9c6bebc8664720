"""`duet train --device`: the default and --device cpu are one run on a CPU-only machine, cuda
without a GPU is refused up front, and (on a GPU host) a run on cuda gives a model that loads
and validates like the CPU's."""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import models.train as train_module
from models.builtin import WEIGHTS_FILE, BuiltinModel
from models.joint import CROSS_ENCODER
from models.train import train
from models.trainconfig import DEFAULT_WEIGHTS, TrainConfig
from tests.conftest import CHILD_PYTHONPATH, DUET
from tests.test_train import TINY as TRAIN_TINY

# test_train's toy run with the fewest tower steps (one thread: the same sums every time)
TINY = replace(TRAIN_TINY, tower_steps=2, threads=1)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _no_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    """These runs compare weights: the 300-image validation would only cost time."""
    monkeypatch.setattr(train_module, "validate_model", lambda runtime, images: ({}, {}))


def _recorded(out: Path) -> dict[str, Any]:
    return dict(json.loads((out / "train.json").read_text()))


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / WEIGHTS_FILE))


def test_device_is_a_train_option_and_recorded_only_when_asked_for() -> None:
    from duet.cli import parser
    from duet.commands.train import config_of
    from models.train import _command

    def parsed(*args: str) -> TrainConfig:
        return config_of(parser().parse_args(["train", "--out", "o", *args]))

    assert parsed().device == "auto" == TrainConfig().device
    assert parsed("--device", "cuda") == replace(parsed(), device="cuda")
    with pytest.raises(SystemExit) as exc:
        parsed("--device", "gpu")
    assert exc.value.code == 2
    assert "--device" not in _command(TrainConfig(), Path("o"), None)
    argv = shlex.split(_command(replace(TINY, device="cuda"), Path("o"), None))
    assert "--device" in argv and parsed(*argv[4:]).device == "cuda"


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="auto is the GPU on this machine")
def test_default_and_cpu_write_the_same_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_validation(monkeypatch)
    train(TINY, tmp_path / "auto", progress=False)
    train(replace(TINY, device="cpu"), tmp_path / "cpu", progress=False)
    for name in (WEIGHTS_FILE, "han.safetensors"):
        assert (tmp_path / "auto" / name).read_bytes() == (tmp_path / "cpu" / name).read_bytes()
    auto, cpu = _recorded(tmp_path / "auto"), _recorded(tmp_path / "cpu")
    assert auto["device"] == cpu["device"] == "cpu"
    assert "--device" not in auto["command"] and "--device cpu" in cpu["command"]


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cli_cuda_without_a_gpu_is_refused_before_any_work(tmp_path: Path) -> None:
    out = tmp_path / "o"
    proc = subprocess.run(
        [*DUET, "train", "--out", str(out), "--device", "cuda", "--no-progress"],
        env={**os.environ, "PYTHONPATH": CHILD_PYTHONPATH},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "device cuda" in proc.stderr and "no CUDA GPU" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not out.exists()  # nothing rendered, trained or written


def _figures(validation: dict[str, Any]) -> dict[str, float]:
    """Every recall of a validation table, keyed mode/direction/metric."""
    return {
        f"{mode}/{side}/{k}": float(v)
        for mode, sides in validation.items()
        for side, metrics in sides.items()
        for k, v in metrics.items()
    }


@pytest.mark.slow
@needs_cuda
def test_cuda_run_starts_from_the_cpus_draws_and_stays_near_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every layer is drawn on the CPU and every batch is the CPU run's, so after a few steps
    the two runs' weights differ only by the kernels' rounding (a few learning-rate steps)."""
    _no_validation(monkeypatch)
    train(replace(TINY, device="cuda"), tmp_path / "cuda", progress=False)
    train(replace(TINY, device="cpu"), tmp_path / "cpu", progress=False)
    assert _recorded(tmp_path / "cuda")["device"].startswith("cuda")
    gpu, cpu = _weights(tmp_path / "cuda"), _weights(tmp_path / "cpu")
    assert gpu.keys() == cpu.keys()  # the same file: the same keys, dtypes and shapes
    for k in cpu:
        assert gpu[k].dtype == cpu[k].dtype and gpu[k].shape == cpu[k].shape, k
        assert torch.allclose(gpu[k].float(), cpu[k].float(), atol=0.05), k
    for device in ("cpu", "cuda"):
        model = BuiltinModel.load(tmp_path / "cuda", device=device)
        assert model.encode_texts(["a red circle"]).shape == (1, model.dim)


@pytest.mark.slow
@needs_cuda
def test_cuda_fine_tune_keeps_the_encoders_and_validates_like_the_cpus(tmp_path: Path) -> None:
    """The later GPU session's run (a warm, mined stage 2 with moves on the shipped encoders),
    at toy length: the encoders stay bit for bit, the validation is the CPU fine-tune's."""
    tune = replace(TINY, ce_warm=True, ce_lr=3e-4, ce_mine=10, ce_move=0.5, ce_steps=3, han_steps=0)
    tune = replace(tune, threads=8)  # validation runs on the CPU: a GPU host has the cores
    for device in ("cuda", "cpu"):
        train(replace(tune, device=device), tmp_path / device, False, init_from=DEFAULT_WEIGHTS)
    source, tuned = _weights(DEFAULT_WEIGHTS), _weights(tmp_path / "cuda")
    assert source.keys() == tuned.keys()
    for k in source:
        if not k.startswith(CROSS_ENCODER):
            assert torch.equal(source[k], tuned[k]), k
    assert not all(torch.equal(source[k], tuned[k]) for k in source)
    on_gpu, on_cpu = _recorded(tmp_path / "cuda"), _recorded(tmp_path / "cpu")
    assert "--device cuda" in on_gpu["command"] and on_gpu["device"].startswith("cuda")
    gpu, cpu = _figures(on_gpu["validation"]), _figures(on_cpu["validation"])
    assert gpu.keys() == cpu.keys() and gpu
    for k, v in gpu.items():  # one of 300 images is 0.33 points: a few near-ties may flip
        assert math.isfinite(v) and abs(v - cpu[k]) <= 1.5, (k, v, cpu[k])
