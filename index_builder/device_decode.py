"""On a GPU host, JPEGs decoded on the GPU: `torchvision.io.decode_jpeg(device="cuda")`
(nvJPEG), then resized there like `models.builtin.pixel_bytes` resizes on the CPU (bilinear,
antialiased). Only when the build runs on CUDA and torchvision is installed; torchvision is
not a dependency of duet, so without it every image is decoded by PIL in the loader workers.

The loader workers still read and hash every file (`decode(..., defer_jpeg=True)`); other
formats are decoded there. A JPEG the device cannot decode (CMYK, progressive on some nvJPEG
versions, a broken file) is decoded by PIL here instead, which names the file if it cannot
either. The device turns each picture upright by the EXIF orientation the worker read from
the file's headers, as PIL does on the CPU. nvJPEG decodes at full size (it has no DCT
scaling) and its IDCT and the GPU resize differ from libjpeg's scaled decode and PIL's resize
by a level or so per pixel: vectors differ in the last digits, as autocast makes them
(benchmarks/build_devices.py reports the agreement)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from index_builder.decode import Decoded, DecodedBatch, PlanItem, decode_at
from index_builder.errors import BuildError
from models.images import upright

log = logging.getLogger("duet.build")

# input pixels resized in one call at most (64 MPix: ~0.8 GB as float32 RGB)
RESIZE_PIXELS = 64 * 1024 * 1024

# file bytes (uint8 1-D CPU tensors) -> RGB images (3, H, W) uint8 on the device
JpegDecoder = Callable[[list[torch.Tensor]], list[torch.Tensor]]


def jpeg_decoder(device: torch.device) -> JpegDecoder | None:
    """nvJPEG through torchvision on a CUDA `device`; None on CPU or without torchvision."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    try:
        from torchvision.io import ImageReadMode, decode_jpeg
    except ImportError:
        return None

    def run(data: list[torch.Tensor]) -> list[torch.Tensor]:
        out = decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
        return list(out) if isinstance(out, list | tuple) else [out]

    return run


def decode_on_gpu(asked: str, device: torch.device, fast_path: bool) -> bool:
    """Whether a build decodes its JPEGs on the GPU (`duet build --decode-jpeg`): "gpu" on a
    CUDA device, for the builtin model's local engine (`fast_path`), with torchvision there;
    a clear BuildError otherwise, and a warning where the build runs on the CPU anyway."""
    if asked not in ("cpu", "gpu"):
        raise BuildError(f"unknown --decode-jpeg {asked!r}: use cpu or gpu")
    if asked == "cpu":
        return False
    if device.type != "cuda":
        log.warning(
            "--decode-jpeg gpu: the build runs on %s, so JPEGs are decoded on the CPU", device
        )
        return False
    if not fast_path:
        raise BuildError(
            "--decode-jpeg gpu is for duet's builtin model with --engine local; "
            "leave it out (JPEGs are then decoded on the CPU)"
        )
    if jpeg_decoder(device) is None:
        raise BuildError(
            "--decode-jpeg gpu needs torchvision (pip install torchvision, the build "
            "matching your torch); leave it out to decode JPEGs on the CPU"
        )
    return True


def resize(img: torch.Tensor, size: int) -> torch.Tensor:
    """uint8 (3, H, W), or a stack (B, 3, H, W) of one size, -> uint8 (3, size, size) (or
    (B, 3, size, size)) on its own device, bilinear with PIL's antialiasing when shrinking;
    unchanged when already that size."""
    if tuple(img.shape[-2:]) == (size, size):
        return img
    x = img[None] if img.dim() == 3 else img
    x = F.interpolate(
        x.float(), size=(size, size), mode="bilinear", antialias=True, align_corners=False
    )
    x = x.round_().clamp_(0, 255).to(torch.uint8)
    return x[0] if img.dim() == 3 else x


def resolve(
    batch: DecodedBatch,
    plan: Sequence[PlanItem],
    size: int,
    device: torch.device,
    decoder: JpegDecoder,
) -> DecodedBatch:
    """`batch` with its deferred JPEGs decoded on `device`: every row's pixels in one tensor
    there, in batch order; an image neither the device nor PIL decodes becomes an error."""
    if not batch.deferred:
        return batch
    n = len(batch.rows) + len(batch.deferred)
    out = torch.empty((n, 3, size, size), dtype=torch.uint8, device=device)
    if batch.pixels is not None:
        out[batch.rows] = batch.pixels.to(device, non_blocking=True)
    data = [
        torch.frombuffer(bytearray(d.jpeg or b""), dtype=torch.uint8) for _, d in batch.deferred
    ]
    try:
        images: list[torch.Tensor | None] = list(decoder(data))
    except (RuntimeError, ValueError, OSError):  # one bad file fails the call: PIL tries each
        images = [None] * len(data)
    items = list(batch.items)
    at = {d.pos: i for i, d in enumerate(items)}
    keep = [True] * n
    same_size: dict[tuple[int, ...], list[tuple[int, torch.Tensor]]] = {}
    for (row, d), img in zip(batch.deferred, images, strict=True):
        if img is not None:
            turned = upright(img, d.orientation)
            same_size.setdefault(tuple(turned.shape), []).append((row, turned))
            continue
        got = decode_at(plan[d.pos], d.jpeg or b"", d.sha256, size)
        if got.error:
            items[at[d.pos]] = Decoded(d.pos, None, d.sha256, got.error, d.seconds)
            keep[row] = False
        else:
            out[row] = got.pixels.to(device)
    for group in same_size.values():  # one resize per picture size, not per picture
        _, h, w = group[0][1].shape
        step = max(1, RESIZE_PIXELS // (h * w))  # 256 phone photos at once: ~47 GB as floats
        for lo in range(0, len(group), step):
            part = group[lo : lo + step]
            rows = torch.tensor([row for row, _ in part], device=device)
            out[rows] = resize(torch.stack([img for _, img in part]), size)
    if not all(keep):
        out = out[torch.tensor(keep, device=device)]
    return DecodedBatch(items, out, list(range(len(out))), [])
