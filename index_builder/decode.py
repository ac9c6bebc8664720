"""Decoding a build's images: read, hash, decode and resize each one, in DataLoader worker
processes (or this process), handed to the encoder in the plan's batches and order."""

from __future__ import annotations

import hashlib
import re
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from index_builder.outdir import let_go
from models.builtin import pixel_bytes
from models.images import KEEP_SIDE, open_rgb, orientation, side_for, why_unread

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
    seconds: float = 0.0  # what reading, hashing and decoding it took
    jpeg: bytes | None = None  # the file, left for the device to decode (`defer_jpeg`)
    orientation: int = 1  # the left JPEG's EXIF orientation, for the device to turn it upright


def decode(item: PlanItem, size: int, defer_jpeg: bool = False) -> Decoded:
    """Read, hash, decode and resize one image to `size`; errors come back as text, not
    exceptions. Decoded as the service decodes an upload for the builtin model
    (`models.images.open_rgb`, keeping `side_for(size)` a side). With
    `defer_jpeg`, a JPEG file is only read and hashed: its bytes (and EXIF orientation) come
    back for the GPU to decode (`index_builder.device_decode`)."""
    return _decode(item, side_for(size), _to(size), defer_jpeg)


def left_to_device(pos: int, share: float) -> bool:
    """Whether the image at plan position `pos` is among the `share` (0 to 1) a build leaves
    to the GPU to decode when it is a JPEG (`duet build --decode-jpeg`): spread evenly, by
    position alone (every other one at 0.5), so a rerun or a resumed build leaves the same
    ones whichever worker decodes them."""
    if share >= 1.0 or share <= 0.0:
        return share >= 1.0
    per_mille = round(share * 1000)
    return (pos + 1) * per_mille // 1000 > pos * per_mille // 1000


def decode_at(item: PlanItem, data: bytes, sha: bytes, size: int) -> Decoded:
    """`decode_bytes` of a file already read, resized to `size` as `decode` resizes."""
    return decode_bytes(item, data, sha, side_for(size), _to(size))


def _to(size: int) -> Callable[[Image.Image], Any]:
    return lambda rgb: pixel_bytes([rgb], size)[0]


def decode_rgb(item: PlanItem) -> Decoded:
    """Read, hash and decode one image, not resized (a Hugging Face processor resizes it)."""
    return _decode(item, KEEP_SIDE, lambda rgb: rgb)


JPEG_MAGIC = b"\xff\xd8\xff"


def _decode(
    item: PlanItem, side: int, convert: Callable[[Image.Image], Any], defer_jpeg: bool = False
) -> Decoded:
    start = time.perf_counter()
    assert item.image is not None
    try:
        path = Path(item.image)
        if path.exists() and not path.is_file():  # a named pipe would be read for ever
            raise OSError(f"{item.image} is not a regular file (a folder, a pipe, a device)")
        data = path.read_bytes()  # a missing file: "No such file or directory"
    except OSError as exc:
        return Decoded(
            item.pos,
            None,
            b"\0" * 32,
            f"cannot read image {item.image_rel!r} ({item.image}): {exc}",
        )
    sha = hashlib.sha256(data).digest()
    if defer_jpeg and data.startswith(JPEG_MAGIC):
        turn = orientation(data)
        return Decoded(item.pos, None, sha, "", time.perf_counter() - start, data, turn)
    got = decode_bytes(item, data, sha, side, convert)
    return Decoded(got.pos, got.pixels, sha, got.error, time.perf_counter() - start)


def decode_bytes(
    item: PlanItem, data: bytes, sha: bytes, side: int, convert: Callable[[Image.Image], Any]
) -> Decoded:
    """Decode an image file's bytes on the CPU (`models.images.open_rgb`, keeping `side`
    pixels), `convert` the RGB image."""
    if not data:
        return Decoded(
            item.pos, None, sha, f"cannot read image {item.image_rel!r} ({item.image}): empty file"
        )
    try:
        with warnings.catch_warnings():  # Pillow warns past its limit: an image too large
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            pix = convert(open_rgb(data, side))
    except (Image.DecompressionBombWarning, Image.DecompressionBombError) as exc:
        return Decoded(item.pos, None, sha, _too_large(item, exc))
    except UnidentifiedImageError:
        return Decoded(
            item.pos,
            None,
            sha,
            f"cannot read image {item.image_rel!r} ({item.image}): {why_unread(data)}",
        )
    except Exception as exc:  # whatever a decoder raises, the file is at fault (as an upload)
        return Decoded(
            item.pos, None, sha, f"cannot read image {item.image_rel!r} ({item.image}): {exc}"
        )
    return Decoded(item.pos, pix, sha, "")


def _too_large(item: PlanItem, exc: Exception) -> str:
    """An image past Pillow's decompression-bomb limit, told as one clear error."""
    found = re.search(r"\((\d+) pixels\)", str(exc))
    pixels = f"{int(found.group(1)):,} pixels" if found else "too many pixels"
    return (
        f"cannot read image {item.image_rel!r} ({item.image}): {pixels}, more than the "
        f"{Image.MAX_IMAGE_PIXELS:,} the builder decodes (Pillow's decompression-bomb limit); "
        "scale it down"
    )


class Tokenizer(Protocol):
    def ids(self, text: str) -> list[int]: ...


@dataclass
class CaptionIds:
    """Captions tokenised (`WordTokenizer.ids`), end to end: each caption's ids in `ids`,
    its length in `lengths`. What a loader worker hands back with a batch, so that the
    process feeding a GPU does not tokenise a build's millions of captions itself."""

    ids: np.ndarray  # int32, every caption's ids, one caption after another
    lengths: np.ndarray  # int64, one per caption

    @classmethod
    def of(cls, texts: Sequence[str], tokenizer: Tokenizer) -> CaptionIds:
        seqs = [tokenizer.ids(t) for t in texts]
        lengths = np.fromiter(map(len, seqs), np.int64, len(seqs))
        ids = np.fromiter((i for s in seqs for i in s), np.int32, int(lengths.sum()))
        return cls(ids, lengths)

    @classmethod
    def joined(cls, parts: Sequence[CaptionIds]) -> CaptionIds:
        if not parts:
            return cls(np.zeros(0, np.int32), np.zeros(0, np.int64))
        return cls(
            np.concatenate([p.ids for p in parts]), np.concatenate([p.lengths for p in parts])
        )

    def __len__(self) -> int:
        return len(self.lengths)

    def split(self, counts: Sequence[int]) -> list[CaptionIds]:
        """Consecutive runs of `counts` captions each (one item's captions a run)."""
        ends = np.cumsum(counts)
        token_ends = np.concatenate([[0], np.cumsum(self.lengths)])
        out, start = [], 0
        for end in ends.tolist():
            out.append(
                CaptionIds(self.ids[token_ends[start] : token_ends[end]], self.lengths[start:end])
            )
            start = end
        return out

    def padded(self, which: Sequence[int]) -> np.ndarray:
        """The captions at `which`, one row each, their ids zero-padded to the longest of
        them: (len(which), width) int64, what `WordTokenizer.batch` makes of their texts."""
        at = np.asarray(which, np.int64)
        lens = self.lengths[at]
        starts = (np.cumsum(self.lengths) - self.lengths)[at]
        row = np.repeat(np.arange(len(at)), lens)
        col = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)
        out = np.zeros((len(at), int(lens.max()) if len(at) else 0), np.int64)
        out[row, col] = self.ids[np.repeat(starts, lens) + col]
        return out


@dataclass
class DecodedBatch:
    """A batch as the encoder takes it: each image's outcome in batch order (`items`, their
    pixels dropped) and the decoded images' pixels, one row each in batch order: those the
    CPU decoded stacked in `pixels` (uint8 (n, 3, S, S), page-locked when they feed a GPU)
    at rows `rows`, the JPEGs left for the device to decode (`deferred`) at the others.
    With `captions`, every caption of its items tokenised, in item order (`Collate`)."""

    items: list[Decoded]
    pixels: torch.Tensor | None
    rows: list[int]
    deferred: list[tuple[int, Decoded]]  # (row, the image with its `jpeg` bytes)
    captions: CaptionIds | None = None

    @classmethod
    def collate(cls, batch: list[Decoded]) -> DecodedBatch:
        """Stack a batch's pixels (in the worker that decoded it, when there are workers)."""
        good = [d for d in batch if not d.error]
        rows = [r for r, d in enumerate(good) if d.pixels is not None]
        deferred = [(r, d) for r, d in enumerate(good) if d.jpeg is not None]
        tensors = [good[r].pixels for r in rows]
        pixels = torch.stack(tensors) if tensors and isinstance(tensors[0], torch.Tensor) else None
        items = [Decoded(d.pos, None, d.sha256, d.error, d.seconds) for d in batch]
        return cls(items, pixels, rows if pixels is not None else [], deferred)

    def pin_memory(self) -> DecodedBatch:
        """What a DataLoader's pin-memory thread calls."""
        if self.pixels is not None:
            self.pixels = self.pixels.pin_memory()
        return self

    def ok(self) -> list[bool]:
        """Whether each image decoded (an image the device will decode counts as decoded)."""
        return [not d.error for d in self.items]


class Collate:
    """A loader worker's `collate_fn`: the batch stacked (`DecodedBatch.collate`) and, with a
    `tokenizer`, every caption of its items tokenised there (those of an image that failed
    too: a shard encodes all its captions)."""

    def __init__(self, plan: Sequence[PlanItem], tokenizer: Tokenizer | None = None) -> None:
        self.plan = plan
        self.tokenizer = tokenizer

    def __call__(self, batch: list[Decoded]) -> DecodedBatch:
        out = DecodedBatch.collate(batch)
        if self.tokenizer is not None:
            texts = [c for d in batch for c in self.plan[d.pos].captions]
            out.captions = CaptionIds.of(texts, self.tokenizer)
        return out


class DecodeDataset(torch.utils.data.Dataset[Decoded]):
    """Images of the plan by position, decoded in DataLoader workers; the JPEGs among the
    `gpu_share` of positions (`left_to_device`) only read and hashed, for the GPU."""

    def __init__(self, plan: Sequence[PlanItem], size: int, gpu_share: float = 0.0) -> None:
        self.plan = plan
        self.size = size
        self.gpu_share = gpu_share

    def __len__(self) -> int:
        return len(self.plan)

    def __getitem__(self, pos: int) -> Decoded:
        return decode(self.plan[pos], self.size, left_to_device(pos, self.gpu_share))


def shard_batches(
    plan: Sequence[PlanItem], start: int, stop: int, batch_size: int
) -> list[list[int]]:
    """Positions of the images in plan[start:stop], cut into batches (never across shards)."""
    with_image = [it.pos for it in plan[start:stop] if it.image is not None]
    return [with_image[i : i + batch_size] for i in range(0, len(with_image), batch_size)]


def decoded_batches(
    plan: Sequence[PlanItem],
    batches: list[list[int]],
    size: int,
    workers: int,
    pin: bool = False,
    gpu_share: float = 0.0,
    tokenizer: Tokenizer | None = None,
) -> Iterator[DecodedBatch]:
    """The decoded batches, in order, from `workers` DataLoader processes (0 = this one),
    stacked there; page-locked by the loader's own thread with `pin` (a CUDA build). The
    JPEGs among `gpu_share` of the positions are left for the device (`left_to_device`).
    With a `tokenizer`, each batch's captions come tokenised too (`Collate`)."""
    if not batches:
        return iter(())
    loader = torch.utils.data.DataLoader(
        DecodeDataset(plan, size, gpu_share),
        batch_sampler=batches,
        num_workers=workers,
        collate_fn=Collate(plan, tokenizer),
        pin_memory=pin,
        prefetch_factor=4 if workers else None,
        persistent_workers=False,
        worker_init_fn=let_go,  # the --out lock is the build's, not its workers'
    )
    return iter(loader)
