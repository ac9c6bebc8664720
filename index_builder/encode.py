"""The encode step: decode images -> encode on a device -> shards.

One encode path for CPU and GPU: pixels are decoded and resized to uint8 (`decode`), moved
to the device, and run under `torch.autocast` (fp16 on a GPU; disabled on CPU, which
encodes in fp32). Vectors come back float32 and re-normalised. On a GPU
(`_encode_local`), DataLoader workers decode and stack page-locked batches for one encoder,
and JPEGs may be decoded on the device (`device_decode`); on CPU, worker processes encode
pieces of shards (a batch of images, a chunk of captions) and this process puts each shard
together (`cpu_encode`).

Every engine (local, CPU pieces, Ray) feeds a `ShardBuilder` (`index_builder.shard`) the
same batch boundaries and caption chunks, so a shard's contents do not depend on which
engine or how many workers made it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from index_builder.decode import (
    PlanItem,
    decode,
    decode_rgb,
    decoded_batches,
    shard_batches,
)
from index_builder.device_decode import DecodeAhead, DeviceTurns, jpeg_decoder, resolve
from index_builder.progress import EncodeProgress
from index_builder.shard import (
    SHARD_FIELDS,
    ShardBuilder,
    read_shard,
    read_shard_bytes,
    shard_bytes,
    shard_path,
    write_shard,
)
from index_builder.stages import Stages
from models.builtin import BuiltinModel, encode_ids, encode_pixels
from models.joint import JointModel
from models.loading import Models

# PlanItem, decode and shard_batches live in `index_builder.decode`, the shard's builder and
# file in `index_builder.shard`; importable from here too
__all__ = [
    "SHARD_FIELDS",
    "Encoder",
    "PlanItem",
    "RGBEncoder",
    "ShardBuilder",
    "autocast_dtype",
    "decode",
    "default_workers",
    "read_shard",
    "read_shard_bytes",
    "shard_batches",
    "shard_bytes",
    "shard_path",
]

log = logging.getLogger("duet.build")

_Out = TypeVar("_Out", np.ndarray, tuple[np.ndarray, np.ndarray])


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The autocast dtype for `device`: fp16 on a GPU, none on CPU (fp32 there: CPU autocast
    is slower than fp32 for a model this small). fp16, not bf16: its 10-bit mantissa keeps
    the index's rankings the CPU build's (top-10 shared 0.9994 against bf16's 0.9946, the
    demo corpus under CPU autocast), it is what the service's GPU step runs, and a batch
    that overflows it is encoded again in fp32 (`Encoder`)."""
    if device.type != "cuda":
        return None
    return torch.float16


def default_workers(device: torch.device) -> int:
    """Workers, by the cores this process may run on. On a GPU the CPU only decodes: cores - 1
    decoding processes (at most 32; this process feeds the GPU). On CPU each worker encodes
    pieces of shards on one thread (`index_builder.cpu_encode`): one per core (at most 32),
    none on a single core."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cores = cores or 1
    if device.type == "cuda":
        return max(0, min(32, cores - 1))
    return min(32, cores) if cores > 1 else 0


class Encoder:
    """A copy of the model on one device; encodes uint8 pixel batches and caption batches."""

    def __init__(self, model: BuiltinModel, device: torch.device) -> None:
        self.device = device
        self.dtype = autocast_dtype(device)
        self.tokenizer = model.tokenizer
        self.image_size = model.model.cfg.image_size
        self.net: JointModel = model.model if device.type == "cpu" else _moved(model, device)
        # a turn on the device for each call's work (`device_decode.DeviceTurns`, when a
        # thread decodes JPEGs there too: `_encode_local`); none needed otherwise
        self.device_turn: Callable[[], contextlib.AbstractContextManager[Any]]
        self.device_turn = contextlib.nullcontext

    def images(
        self, pixels: torch.Tensor | Sequence[torch.Tensor]
    ) -> tuple[np.ndarray, np.ndarray]:
        """uint8 (B, 3, S, S) (or B tensors (3, S, S)) -> ((B, dim) float32 unit vectors,
        (B, T, d) float16 tokens), by the service's own `encode_pixels`."""
        if not isinstance(pixels, torch.Tensor):
            pixels = torch.stack(list(pixels))
        if pixels.device.type == "cpu" and self.device.type == "cuda" and not pixels.is_pinned():
            pixels = pixels.pin_memory()  # page-locked, so the copy can overlap the last batch
        with self.device_turn():
            x = pixels.to(self.device, non_blocking=True).float() / 255.0
            return self._finite(lambda dtype: encode_pixels(self.net, x, dtype))

    def texts(self, texts: Sequence[str]) -> np.ndarray:
        """Captions -> (n, dim) float32 unit vectors, by the service's own `encode_ids`."""
        return self.token_ids(self.tokenizer.batch(list(texts))[0])

    def token_ids(self, ids: np.ndarray | torch.Tensor) -> np.ndarray:
        """Captions already tokenised (zero-padded rows of ids, `WordTokenizer.batch`'s) ->
        (n, dim) float32 unit vectors."""
        rows = torch.as_tensor(ids)
        with self.device_turn():
            rows = rows.to(self.device)
            pad = rows == 0
            return self._finite(lambda dtype: encode_ids(self.net, rows, pad, dtype))

    def _finite(self, run: Callable[[torch.dtype | None], _Out]) -> _Out:
        """`run(self.dtype)`, or `run(None)` (fp32) when the half type overflowed: any of
        its arrays not finite."""
        got = run(self.dtype)
        arrays = got if isinstance(got, tuple) else (got,)
        if self.dtype is not None and not all(np.isfinite(a).all() for a in arrays):
            got = run(None)
        return got


class RGBEncoder:
    """Models that take PIL images (`models.loading.Models` with Hugging Face parts) behind the
    `ShardBuilder` interface: `decode_rgb` images in, each model's own processor resizes them.
    No DataLoader workers and no autocast: a plain batched loop."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def images(self, decoded: Sequence[Any]) -> tuple[np.ndarray, np.ndarray]:
        vecs, tokens = self.model.encode_images(list(decoded))
        return np.asarray(vecs, np.float32), np.asarray(tokens, np.float16)

    def texts(self, texts: Sequence[str]) -> np.ndarray:
        return np.asarray(self.model.encode_texts(list(texts)), np.float32)


def _moved(model: BuiltinModel, device: torch.device) -> JointModel:
    import copy

    return copy.deepcopy(model.model).to(device).eval()


def _encode_local(
    plan: Sequence[PlanItem],
    missing: list[tuple[int, int, int]],
    shard_dir: Path,
    model: BuiltinModel,
    dev: Any,
    batch_size: int,
    workers: int,
    progress: bool,
    on_shard: Any,
    stages: Stages,
    gpu_share: float = 0.0,
) -> None:
    """Decode in `workers` DataLoader processes, encode here, write each shard as it ends;
    with a `gpu_share`, the workers only read that share of the JPEGs and the device decodes
    them, in a thread of its own a batch or two ahead (`device_decode.DecodeAhead`).

    The workers start first and decode while the encoder's copy of the model is made on the
    device; a shard is written and checked by a thread of its own while the next
    one encodes (one at most in flight; its error, such as an unreadable image, is raised
    here at the next shard or the end)."""
    per_shard = [shard_batches(plan, a, b, batch_size) for _, a, b in missing]
    jpegs = jpeg_decoder(dev) if gpu_share > 0 else None  # None unless CUDA and torchvision
    size = model.model.cfg.image_size
    batches = decoded_batches(
        plan,
        [b for bs in per_shard for b in bs],
        size,
        workers,
        pin=dev.type == "cuda",
        gpu_share=gpu_share if jpegs is not None else 0.0,
        tokenizer=model.tokenizer,  # the workers tokenise the captions
    )
    ahead: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    turns = DeviceTurns(dev, stages)  # the encoder and the decoding thread, in turns
    if jpegs is not None:  # its thread stops at the `with` block's end, whatever ends it
        decoder = jpegs  # bound for the thread's closure
        batches = ahead = DecodeAhead(
            batches, lambda b: resolve(b, plan, size, dev, decoder, turns)
        )
    try:
        with stages("setup"), turns.turn():
            encoder = Encoder(model, dev)
        if jpegs is not None:
            encoder.device_turn = lambda: turns.turn(waited="device_wait")
    except BaseException:
        ahead.__exit__(None, None, None)
        raise

    total = sum(b - a for _, a, b in missing)
    with (
        EncodeProgress(total, progress) as bar,
        ThreadPoolExecutor(1, "duet-shards") as writer,
        ahead,
    ):
        written: Future[None] | None = None
        for (k, a, b), bs in zip(missing, per_shard, strict=True):
            shard = ShardBuilder(plan[a:b], encoder, batch_size, stages)
            for _ in bs:
                with stages("decode"):
                    batch = next(batches)
                shard.add(batch)
            arrays = shard.finish(model.dim, model.token_shape)
            if written is not None:
                written.result()  # the shard before, on disk and checked
            written = writer.submit(write_shard, shard_dir, k, arrays, on_shard, stages)
            bar.update(b - a)
        if written is not None:
            written.result()


def _encode_rgb(
    plan: Sequence[PlanItem],
    missing: list[tuple[int, int, int]],
    shard_dir: Path,
    model: Models,
    batch_size: int,
    progress: bool,
    on_shard: Any,
    stages: Stages,
) -> None:
    """Hugging Face models: decode here, encode `batch_size` images at a time at their own
    size (each model's processor resizes), the same shard files as the fast path."""
    encoder = RGBEncoder(model)
    log.info(
        "encoding %d shard(s) with %s on %s, %d images per batch",
        len(missing),
        model.name,
        model.device,
        batch_size,
    )
    with EncodeProgress(sum(b - a for _, a, b in missing), progress) as bar:
        for k, a, b in missing:
            t0 = time.perf_counter()
            shard = ShardBuilder(plan[a:b], encoder, batch_size, stages)
            done = 0
            for positions in shard_batches(plan, a, b, batch_size):
                with stages("decode"):
                    batch = [decode_rgb(plan[p]) for p in positions]
                shard.add(batch)
                bar.update(len(positions))
                done += len(positions)
            arrays = shard.finish(model.dim, model.token_shape)  # the captions
            write_shard(shard_dir, k, arrays, on_shard, stages)
            bar.update(b - a - done)
            log.info(
                "shard %d: items %d-%d encoded in %.1fs", k, a, b - 1, time.perf_counter() - t0
            )
