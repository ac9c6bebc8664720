"""A CUDA build's JPEGs shared between the decode workers and the GPU (`duet build
--decode-jpeg SHARE`), and the thread that has the GPU decode ahead of the encoder
(`device_decode.DecodeAhead`): what of them runs on a CPU, with PIL standing in for
nvJPEG at the decoder's boundary."""

from __future__ import annotations

import io
import json
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

import index_builder.encode as encode_mod
from index_builder.decode import DecodedBatch, PlanItem, decode, left_to_device
from index_builder.device_decode import (
    DecodeAhead,
    DeviceTurns,
    gpu_share_of,
    jpeg_decoder,
    jpeg_key,
)
from index_builder.encode import _encode_local, read_shard, shard_batches, shard_path
from index_builder.errors import BuildError
from index_builder.stages import Stages
from models.builtin import BuiltinModel, encode_pixels
from models.world import PhotoStyle, write_corpus


def _pil(data: list[torch.Tensor]) -> list[torch.Tensor]:
    """Stands in for nvJPEG: the files' full-size RGB pixels, (3, H, W) uint8."""
    imgs = [Image.open(io.BytesIO(d.numpy().tobytes())).convert("RGB") for d in data]
    return [torch.from_numpy(np.asarray(i).copy()).permute(2, 0, 1) for i in imgs]


def test_the_share_left_to_the_gpu_is_spread_evenly_by_position() -> None:
    for share in (0.1, 0.25, 0.4, 0.5, 0.75, 0.9):
        picked = [p for p in range(1000) if left_to_device(p, share)]
        assert len(picked) == round(share * 1000)
        gaps = np.diff(picked)  # evenly: no run of the CPU's longer than the share implies
        assert gaps.max() <= int(np.ceil(1 / share)) and gaps.min() >= int(1 / share)
    assert [left_to_device(p, 0.5) for p in range(4)] == [False, True, False, True]
    assert not any(left_to_device(p, 0.0) for p in range(50))
    assert all(left_to_device(p, 1.0) for p in range(50))


def test_decode_jpeg_takes_cpu_gpu_or_a_share_and_keys_each_apart(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert gpu_share_of("cpu", cuda, fast_path=True) == 0.0
    for bad in ("nvjpeg", "0", "1", "1.5", "-0.2", "half", "0.0004", "0.9996", "inf", "nan"):
        with pytest.raises(BuildError, match="unknown --decode-jpeg"):
            gpu_share_of(bad, cuda, fast_path=True)
    with pytest.raises(BuildError, match="builtin model with --engine local"):
        gpu_share_of("0.4", cuda, fast_path=False)
    with caplog.at_level("WARNING", logger="duet.build"):
        assert gpu_share_of("0.4", cpu, fast_path=True) == 0.0  # said, then ignored
    assert "JPEGs are decoded on the CPU" in caplog.text
    keys = {jpeg_key(s) for s in (0.0, 1.0, 0.4, 0.5)}
    assert keys == {"cpu", "gpu", "gpu 0.4", "gpu 0.5"}


def test_a_split_batch_holds_cpu_rows_and_gpu_jpegs_merged_in_order(tmp_path: Path) -> None:
    manifest = write_corpus(
        tmp_path / "c", 6, seed=21, progress=False, photo=PhotoStyle(size=(96, 72), tiles=1)
    )
    lines = [json.loads(x) for x in manifest.read_text().splitlines()]
    plan = [
        PlanItem(i, x["id"], str(manifest.parent / x["image"]), x["image"], i + 1, ())
        for i, x in enumerate(lines)
    ]
    from index_builder.device_decode import resolve

    batch = DecodedBatch.collate([decode(it, 16, left_to_device(it.pos, 0.5)) for it in plan])
    assert batch.rows == [0, 2, 4] and [r for r, _ in batch.deferred] == [1, 3, 5]
    got = resolve(batch, plan, 16, torch.device("cpu"), _pil)
    cpu = DecodedBatch.collate([decode(it, 16) for it in plan]).pixels
    assert got.pixels is not None and cpu is not None and got.pixels.shape == cpu.shape
    diff = (got.pixels.int() - cpu.int()).abs()
    assert int(diff[[0, 2, 4]].max()) == 0  # the workers' rows: the CPU's pixels exactly
    assert float(diff[[1, 3, 5]].float().mean()) < 3  # the GPU's: a full decode, resized there


def test_the_ahead_thread_keeps_order_and_raises_where_its_batch_failed() -> None:
    items = [DecodedBatch([], torch.tensor([i]), [0], []) for i in range(6)]
    seen: list[int] = []

    def fix(b: DecodedBatch) -> DecodedBatch:
        assert b.pixels is not None
        seen.append(int(b.pixels[0]))
        return DecodedBatch([], b.pixels * 10, [0], [])

    with DecodeAhead(iter(items), fix) as ahead:
        got = [int(b.pixels[0]) for b in ahead if b.pixels is not None]
    assert got == [10 * i for i in range(6)] and seen == list(range(6))

    def broken(b: DecodedBatch) -> DecodedBatch:
        if b.pixels is not None and int(b.pixels[0]) == 3:
            raise ValueError("batch 3 is broken")
        return fix(b)

    ahead = DecodeAhead(iter(items), broken)
    assert [int(next(ahead).pixels[0]) for _ in range(3)] == [0, 10, 20]  # type: ignore[index]
    with pytest.raises(ValueError, match="batch 3 is broken"):
        next(ahead)
    with pytest.raises(StopIteration):
        next(ahead)
    assert not ahead._thread.is_alive()


def test_an_encoder_that_stops_early_stops_the_ahead_thread() -> None:
    pulled: list[int] = []

    def endless() -> object:
        i = 0
        while True:
            pulled.append(i)
            yield DecodedBatch([], None, [], [])
            i += 1

    before = threading.active_count()
    ahead = DecodeAhead(endless(), lambda b: b, depth=2)  # type: ignore[arg-type]
    next(ahead)
    time.sleep(0.3)  # the thread fills its queue, then waits
    assert len(pulled) <= 5  # never more than `depth` ahead (plus the one in its hand)
    ahead.close()
    assert not ahead._thread.is_alive() and threading.active_count() == before


@pytest.mark.parametrize("workers", [0, 2])
def test_a_split_encode_step_matches_the_workers_alone_to_the_last_digits(
    tmp_path: Path, model: BuiltinModel, monkeypatch: pytest.MonkeyPatch, workers: int
) -> None:
    """The GPU build's encode loop, run on the CPU with PIL at nvJPEG's place: half the
    JPEGs go through the ahead thread, the rest through the workers; every shard holds the
    same items, in order, and vectors within a decode's difference of the workers alone. The
    decoder and the encoder each work on the device only in a turn of their own."""
    manifest = write_corpus(
        tmp_path / "c", 10, seed=23, progress=False, photo=PhotoStyle(size=(96, 72), tiles=1)
    )
    lines = [json.loads(x) for x in manifest.read_text().splitlines()]
    plan = [
        PlanItem(
            i, x["id"], str(manifest.parent / x["image"]), x["image"], i + 1, tuple(x["captions"])
        )
        for i, x in enumerate(lines)
    ]
    missing = [(0, 0, 4), (1, 4, 8), (2, 8, 10)]
    made: list[DeviceTurns] = []
    in_turn: list[tuple[str, bool]] = []

    class Turns(DeviceTurns):
        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            made.append(self)

    def decoder(dev: torch.device) -> Any:
        def run(data: list[torch.Tensor]) -> list[torch.Tensor]:
            in_turn.append(("decoder", made[-1].held()))
            return _pil(data)

        return run

    def pixels_in_turn(*args: Any) -> Any:
        in_turn.append(("encoder", made[-1].held()))
        return encode_pixels(*args)

    monkeypatch.setattr(encode_mod, "jpeg_decoder", decoder)
    monkeypatch.setattr(encode_mod, "DeviceTurns", Turns)
    monkeypatch.setattr(encode_mod, "encode_pixels", pixels_in_turn)

    def run(share: float, out: Path) -> dict[int, dict[str, np.ndarray]]:
        out.mkdir()
        stages = Stages()
        args = (plan, missing, out, model, torch.device("cpu"), 3, workers, False)
        _encode_local(*args, lambda k, a: None, stages, gpu_share=share)
        assert (stages.seconds["device_decode"] > 0) == (share > 0)
        return {k: read_shard(shard_path(out, k)) for k, _, _ in missing}

    alone = run(0.0, tmp_path / "a")
    assert {who for who, _ in in_turn} == {"encoder"}  # no decoding thread: no turns needed
    in_turn.clear()
    split = run(0.5, tmp_path / "b")
    assert {who for who, _ in in_turn} == {"encoder", "decoder"} and all(h for _, h in in_turn)
    for k, _, _ in missing:
        a, b = alone[k], split[k]
        assert (a["image_sha"] == b["image_sha"]).all() and b["image_ok"].all()
        cos = (a["image_vectors"] * b["image_vectors"]).sum(1)
        assert cos.min() > 0.98  # the GPU's half: a full decode resized there
        np.testing.assert_array_equal(a["text_vectors"], b["text_vectors"])
        np.testing.assert_array_equal(a["image_vectors"][::2], b["image_vectors"][::2])
    assert shard_batches(plan, 0, 4, 3) == [[0, 1, 2], [3]]


@pytest.mark.skipif(
    not torch.cuda.is_available() or jpeg_decoder(torch.device("cuda")) is None,
    reason="needs a CUDA GPU and torchvision",
)
def test_a_cuda_build_with_its_jpegs_shared_agrees_with_the_workers_alone(
    tmp_path: Path, model: BuiltinModel
) -> None:
    """On a GPU host, many small batches (so the decoding thread and the encoder take many
    turns on the device): every image's vector with half or all of the JPEGs on nvJPEG is
    the workers-alone vector to a decode's difference, never another image's."""
    from index_builder.build import build

    manifest = write_corpus(
        tmp_path / "c", 96, seed=29, progress=False, photo=PhotoStyle(size=(160, 120), tiles=2)
    )
    args: dict[str, Any] = {"progress": False, "device": "cuda", "batch_size": 8, "workers": 2}
    cpu = build(manifest, tmp_path / "cpu", model, **args)
    ref = np.load(cpu.path / "image_vectors.npy")
    for share in ("0.5", "gpu"):
        got = build(manifest, tmp_path / share, model, decode_jpeg=share, **args)
        assert got.manifest.build is not None
        assert got.manifest.build.jpeg == ("gpu 0.5" if share == "0.5" else "gpu")
        vecs = np.load(got.path / "image_vectors.npy")
        cos = (vecs * ref).sum(1)
        assert cos.min() > 0.98, (share, cos.min())
        assert ((vecs @ ref.T).argmax(1) == np.arange(len(ref))).mean() > 0.95
