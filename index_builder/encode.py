"""The encode step: decode images (DataLoader workers) -> encode on a device -> shards.

One code path for CPU and GPU: pixels are decoded and resized on the CPU (uint8), moved to
the device, and run under `torch.autocast` (bf16 where the GPU supports it, else fp16;
disabled on CPU, which encodes in fp32). Vectors come back float32 and re-normalised.

Both engines (local and Ray) feed decoded batches into a `ShardBuilder` with the same batch
boundaries, so a shard's contents do not depend on which engine or how many workers made it.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from PIL import Image
from tqdm import tqdm

from models.builtin import BuiltinModel, encode_ids, encode_pixels, pixel_bytes
from models.joint import JointModel
from models.loading import Models
from store import indexio

log = logging.getLogger("duet.build")

TEXT_BATCH_MIN = 256


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The autocast dtype for `device`: bf16 on GPUs that have it, fp16 on older ones, none
    on CPU (fp32 there: CPU autocast is slower than fp32 for a model this small)."""
    if device.type != "cuda":
        return None
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def default_workers(device: torch.device) -> int:
    """Decoding workers. On a GPU the CPU only decodes: cores - 1 (at most 8). On CPU the
    encoder needs the cores itself (on 2 cores, 1 worker made the 2,000-image demo build
    1.3-1.8x slower than 0), so a quarter of them, at most 4."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cores = cores or 1
    if device.type == "cuda":
        return max(0, min(8, cores - 1))
    return min(4, cores // 4)


class Encoder:
    """A copy of the model on one device; encodes uint8 pixel batches and caption batches."""

    def __init__(self, model: BuiltinModel, device: torch.device) -> None:
        self.device = device
        self.dtype = autocast_dtype(device)
        self.tokenizer = model.tokenizer
        self.image_size = model.model.cfg.image_size
        self.net: JointModel = model.model if device.type == "cpu" else _moved(model, device)

    def images(
        self, pixels: torch.Tensor | Sequence[torch.Tensor]
    ) -> tuple[np.ndarray, np.ndarray]:
        """uint8 (B, 3, S, S) (or B tensors (3, S, S)) -> ((B, dim) float32 unit vectors,
        (B, T, d) float16 tokens), by the service's own `encode_pixels`."""
        if not isinstance(pixels, torch.Tensor):
            pixels = torch.stack(list(pixels))
        if self.device.type == "cuda":  # page-locked, so the copy can overlap the last batch
            pixels = pixels.pin_memory()
        x = pixels.to(self.device, non_blocking=True).float() / 255.0
        return encode_pixels(self.net, x, self.dtype)

    def texts(self, texts: Sequence[str]) -> np.ndarray:
        """Captions -> (n, dim) float32 unit vectors, by the service's own `encode_ids`."""
        ids, pad = self.tokenizer.batch(list(texts))
        return encode_ids(self.net, ids.to(self.device), pad.to(self.device), self.dtype)


class ImageEncoder(Protocol):
    """What a `ShardBuilder` calls: a batch of decoded images, then the shard's captions."""

    def images(self, decoded: Sequence[Any]) -> tuple[np.ndarray, np.ndarray]: ...

    def texts(self, texts: Sequence[str]) -> np.ndarray: ...


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


# -- the work plan -----------------------------------------------------------------------


@dataclass(frozen=True)
class PlanItem:
    """One corpus item to encode: its image (if any) and captions, in corpus order."""

    pos: int
    id: str
    image: str | None  # absolute path
    image_rel: str | None
    line: int
    captions: tuple[str, ...]


@dataclass(frozen=True)
class Decoded:
    """A decoded image, or why it could not be: what a loader worker hands back."""

    pos: int
    pixels: Any  # uint8 tensor (3, S, S) from `decode`, an RGB PIL image from `decode_rgb`
    sha256: bytes
    error: str


def decode(item: PlanItem, size: int) -> Decoded:
    """Read, hash, decode and resize one image; errors come back as text, not exceptions."""
    return _decode(item, lambda rgb: pixel_bytes([rgb], size)[0])


def decode_rgb(item: PlanItem) -> Decoded:
    """Read, hash and decode one image, not resized (a Hugging Face processor resizes it)."""
    return _decode(item, lambda rgb: rgb)


def _decode(item: PlanItem, convert: Callable[[Image.Image], Any]) -> Decoded:
    assert item.image is not None
    try:
        data = Path(item.image).read_bytes()
    except OSError as exc:
        return Decoded(
            item.pos,
            None,
            b"\0" * 32,
            f"cannot read image {item.image_rel!r} ({item.image}): {exc}",
        )
    sha = hashlib.sha256(data).digest()
    try:
        img = Image.open(io.BytesIO(data))
        img.load()
        pix = convert(img.convert("RGB"))
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        return Decoded(
            item.pos, None, sha, f"cannot read image {item.image_rel!r} ({item.image}): {exc}"
        )
    return Decoded(item.pos, pix, sha, "")


class DecodeDataset(torch.utils.data.Dataset[Decoded]):
    """Images of the plan by position, decoded in DataLoader workers."""

    def __init__(self, plan: Sequence[PlanItem], size: int) -> None:
        self.plan = plan
        self.size = size

    def __len__(self) -> int:
        return len(self.plan)

    def __getitem__(self, pos: int) -> Decoded:
        return decode(self.plan[pos], self.size)


def _as_list(batch: list[Decoded]) -> list[Decoded]:
    return batch


def shard_batches(
    plan: Sequence[PlanItem], start: int, stop: int, batch_size: int
) -> list[list[int]]:
    """Positions of the images in plan[start:stop], cut into batches (never across shards)."""
    with_image = [it.pos for it in plan[start:stop] if it.image is not None]
    return [with_image[i : i + batch_size] for i in range(0, len(with_image), batch_size)]


def decoded_batches(
    plan: Sequence[PlanItem], batches: list[list[int]], size: int, workers: int
) -> Iterator[list[Decoded]]:
    """The decoded batches, in order, from `workers` DataLoader processes (0 = this one)."""
    if not batches:
        return iter(())
    loader = torch.utils.data.DataLoader(
        DecodeDataset(plan, size),
        batch_sampler=batches,
        num_workers=workers,
        collate_fn=_as_list,
        prefetch_factor=4 if workers else None,
        persistent_workers=False,
    )
    return iter(loader)


# -- one shard ---------------------------------------------------------------------------

SHARD_FIELDS = (
    "image_ok",
    "image_sha",
    "image_error",
    "image_vectors",
    "image_tokens",
    "text_vectors",
)


class ShardBuilder:
    """Collects one shard's encoded image batches, then encodes its captions."""

    def __init__(self, items: Sequence[PlanItem], encoder: ImageEncoder, batch_size: int) -> None:
        self.items = list(items)
        self.encoder = encoder
        self.batch_size = batch_size
        self.decoded: list[Decoded] = []
        self.vecs: list[np.ndarray] = []
        self.toks: list[np.ndarray] = []

    def add(self, batch: list[Decoded]) -> None:
        """Encode the decodable images of one batch."""
        self.decoded.extend(batch)
        good = [d.pixels for d in batch if d.pixels is not None]
        if good:
            vec, tok = self.encoder.images(good)
            self.vecs.append(vec)
            self.toks.append(tok)

    def finish(self, dim: int, token_shape: tuple[int, int]) -> dict[str, np.ndarray]:
        """Encode the captions of every item whose image decoded (or that has none)."""
        ok = {d.pos: d.pixels is not None for d in self.decoded}
        texts = [c for it in self.items if it.image is None or ok[it.pos] for c in it.captions]
        step = max(self.batch_size, TEXT_BATCH_MIN)
        tvecs = [self.encoder.texts(texts[i : i + step]) for i in range(0, len(texts), step)]
        return {
            "image_ok": np.array([ok[d.pos] for d in self.decoded], dtype=bool),
            "image_sha": np.array(
                [np.frombuffer(d.sha256, np.uint8) for d in self.decoded], dtype=np.uint8
            ).reshape(-1, 32),
            "image_error": np.array([d.error for d in self.decoded], dtype=np.str_),
            "image_vectors": (
                np.concatenate(self.vecs) if self.vecs else np.zeros((0, dim), np.float32)
            ),
            "image_tokens": (
                np.concatenate(self.toks).astype(np.float16)
                if self.toks
                else np.zeros((0, *token_shape), np.float16)
            ),
            "text_vectors": (np.concatenate(tvecs) if tvecs else np.zeros((0, dim), np.float32)),
        }


def shard_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    """A shard file: its arrays as consecutive .npy records (no zip, so no timestamps)."""
    buf = io.BytesIO()
    for name in SHARD_FIELDS:
        np.save(buf, arrays[name], allow_pickle=False)
    return buf.getvalue()


def shard_path(shard_dir: Path, k: int) -> Path:
    return shard_dir / f"shard-{k:06d}.npy"


def read_shard(path: Path, fields: Sequence[str] = SHARD_FIELDS) -> dict[str, np.ndarray]:
    """A shard's arrays (only `fields`; reading stops after the last one asked for)."""
    with path.open("rb") as fh:
        return _read_fields(fh, fields)


def read_shard_bytes(data: bytes, fields: Sequence[str] = SHARD_FIELDS) -> dict[str, np.ndarray]:
    return _read_fields(io.BytesIO(data), fields)


def _read_fields(fh: Any, fields: Sequence[str]) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for name in SHARD_FIELDS:
        if len(out) == len(fields):
            break
        arr = np.load(fh, allow_pickle=False)
        if name in fields:
            out[name] = arr
    return out


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
) -> None:
    """Decode in `workers` DataLoader processes, encode here, write each shard as it ends."""
    encoder = Encoder(model, dev)
    per_shard = [shard_batches(plan, a, b, batch_size) for _, a, b in missing]
    batches = decoded_batches(
        plan, [b for bs in per_shard for b in bs], encoder.image_size, workers
    )
    with tqdm(
        total=sum(b - a for _, a, b in missing), desc="encoding", unit="item", disable=not progress
    ) as bar:
        for (k, a, b), bs in zip(missing, per_shard, strict=True):
            shard = ShardBuilder(plan[a:b], encoder, batch_size)
            for _ in bs:
                shard.add(next(batches))
            arrays = shard.finish(model.dim, model.token_shape)
            indexio.write_atomic(shard_path(shard_dir, k), shard_bytes(arrays))
            bar.update(b - a)
            on_shard(k, arrays)


def _encode_rgb(
    plan: Sequence[PlanItem],
    missing: list[tuple[int, int, int]],
    shard_dir: Path,
    model: Models,
    batch_size: int,
    progress: bool,
    on_shard: Any,
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
    with tqdm(
        total=sum(b - a for _, a, b in missing), desc="encoding", unit="item", disable=not progress
    ) as bar:
        for k, a, b in missing:
            t0 = time.perf_counter()
            shard = ShardBuilder(plan[a:b], encoder, batch_size)
            done = 0
            for positions in shard_batches(plan, a, b, batch_size):
                shard.add([decode_rgb(plan[p]) for p in positions])
                bar.update(len(positions))
                done += len(positions)
            arrays = shard.finish(model.dim, model.token_shape)  # the captions
            indexio.write_atomic(shard_path(shard_dir, k), shard_bytes(arrays))
            bar.update(b - a - done)
            log.info(
                "shard %d: items %d-%d encoded in %.1fs", k, a, b - 1, time.perf_counter() - t0
            )
            on_shard(k, arrays)
