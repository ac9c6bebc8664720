"""On a GPU host, JPEGs decoded on the GPU: `torchvision.io.decode_jpeg(device="cuda")`
(nvJPEG), then resized there like `models.builtin.pixel_bytes` resizes on the CPU (bilinear,
antialiased). Only when the build runs on CUDA and torchvision is installed; torchvision is
not a dependency of duet, so without it every image is decoded by PIL in the loader workers.

`duet build --decode-jpeg gpu` leaves every JPEG to the GPU, a fraction (`0.4`) that share
of them, spread evenly by position (`decode.left_to_device`): the workers decode the rest
at the same time, so both decoders work. The loader workers still read and hash every file
(`decode(..., defer_jpeg=True)`); other formats are decoded there. A thread of its own
(`DecodeAhead`) has the GPU decode a batch or two ahead of the encoder.

A JPEG the device cannot decode (CMYK, progressive on some nvJPEG versions, a broken file)
is decoded by PIL here instead, which names the file if it cannot either. The device turns
each picture upright by the EXIF orientation the worker read from the file's headers, as
PIL does on the CPU. nvJPEG decodes at full size (it has no DCT scaling) and its IDCT and
the GPU resize differ from libjpeg's scaled decode and PIL's resize by a level or so per
pixel: vectors differ in the last digits, as autocast makes them
(benchmarks/build_devices.py reports the agreement)."""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F

from index_builder.decode import Decoded, DecodedBatch, PlanItem, decode_at
from index_builder.errors import BuildError
from index_builder.stages import Stages
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


def gpu_share_of(asked: str, device: torch.device, fast_path: bool) -> float:
    """The share of a build's JPEGs the GPU decodes (`duet build --decode-jpeg`): 0 for
    "cpu", 1 for "gpu", or a fraction ("0.4": the workers decode the rest at the same time),
    on a CUDA device, for the builtin model's local engine (`fast_path`), with torchvision
    there; a clear BuildError otherwise, and a warning (and 0) where the build runs on the
    CPU anyway."""
    share = {"cpu": 0.0, "gpu": 1.0}.get(asked)
    if share is None:
        try:
            per_mille = round(float(asked) * 1000)  # what `decode.left_to_device` counts in
        except (ValueError, OverflowError):
            per_mille = -1
        if not 0 < per_mille < 1000:
            raise BuildError(
                f"unknown --decode-jpeg {asked!r}: use cpu, gpu, or the share of JPEGs the "
                "GPU decodes, between 0.001 and 0.999 (e.g. 0.4)"
            )
        share = per_mille / 1000
    if share == 0.0:
        return 0.0
    if device.type != "cuda":
        log.warning(
            "--decode-jpeg %s: the build runs on %s, so JPEGs are decoded on the CPU",
            asked,
            device,
        )
        return 0.0
    if not fast_path:
        raise BuildError(
            f"--decode-jpeg {asked} is for duet's builtin model with --engine local; "
            "leave it out (JPEGs are then decoded on the CPU)"
        )
    if jpeg_decoder(device) is None:
        raise BuildError(
            f"--decode-jpeg {asked} needs torchvision (pip install torchvision, the build "
            "matching your torch); leave it out to decode JPEGs on the CPU"
        )
    return share


def jpeg_key(share: float) -> str:
    """Where a GPU build decoded its JPEGs, for its shard key: cpu, gpu, or the GPU's share."""
    return "cpu" if share <= 0.0 else "gpu" if share >= 1.0 else f"gpu {share:g}"


class DeviceTurns:
    """One thread's work on the device at a time, the encoder's or the JPEG decoding
    thread's, each turn synchronised before the next begins. nvJPEG writes its pictures from
    a CUDA stream of its own into tensors allocated on the caller's stream, whose memory the
    caching allocator may just have taken back from kernels still queued there (torchvision
    waits for nothing on the caller's stream first); with every turn ending on an idle
    device, what the allocator hands out is never still in use. Their CPU sides overlap.
    A turn's seconds inside go to the stage it names; the wait for it to the stage named so."""

    def __init__(self, device: torch.device, stages: Stages) -> None:
        self.device, self.stages = device, stages
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def turn(self, waited: str = "", inside: str = "") -> Iterator[None]:
        asked = time.perf_counter()
        with self._lock:
            began = time.perf_counter()
            if waited:
                self.stages.add(waited, began - asked)
            try:
                yield
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
            finally:
                if inside:
                    self.stages.add(inside, time.perf_counter() - began)

    def held(self) -> bool:
        """Whether some thread has its turn now (for tests)."""
        return self._lock.locked()


class DecodeAhead:
    """`fix(batch)` for each batch in order, run by a thread of its own up to `depth` batches
    ahead of the caller (started at once, so it works while the encoder is made), so the
    Python around the GPU's JPEG decoding (whose calls let go of the GIL) overlaps the
    encoder's on the caller's thread (`DeviceTurns` still lets one thread at a time have work
    on the device). An error in the thread is raised by `next`, at the batch it reached;
    `close` (or the `with` block's end) stops the thread, which a caller that stops early
    must do."""

    def __init__(
        self,
        batches: Iterator[DecodedBatch],
        fix: Callable[[DecodedBatch], DecodedBatch],
        depth: int = 2,
    ) -> None:
        self._batches, self._fix = batches, fix
        self._out: queue.Queue[tuple[DecodedBatch | None, BaseException | None]]
        self._out = queue.Queue(depth)
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(target=self._run, name="duet-device-decode", daemon=True)
        self._thread.start()

    def _put(self, item: tuple[DecodedBatch | None, BaseException | None]) -> bool:
        while not self._stop.is_set():
            try:
                self._out.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            for batch in self._batches:
                if not self._put((self._fix(batch), None)):
                    return
        except BaseException as exc:  # handed to the caller, raised there
            self._put((None, exc))
            return
        self._put((None, None))

    def __iter__(self) -> DecodeAhead:
        return self

    def __next__(self) -> DecodedBatch:
        if self._done:
            raise StopIteration
        batch, exc = self._out.get()
        if batch is None:
            self.close()
            if exc is not None:
                raise exc
            raise StopIteration
        return batch

    def close(self, wait_s: float = 30.0) -> None:
        self._done = True
        self._stop.set()
        self._thread.join(wait_s)  # past a batch in hand: a worker stuck reading a file
        if self._thread.is_alive():  # must not keep the caller's own error from being told
            log.warning("the JPEG decoding thread did not stop within %.0f s; left behind", wait_s)

    def __enter__(self) -> DecodeAhead:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
    turns: DeviceTurns | None = None,
) -> DecodedBatch:
    """`batch` with its deferred JPEGs decoded on `device`: every row's pixels in one tensor
    there, in batch order; an image neither the device nor PIL decodes becomes an error.
    With `turns`, the device work happens in turns (`DeviceTurns`, timed as `device_decode`),
    nvJPEG's call first in its turn (before anything of the turn is freed), and what PIL
    decodes instead (a file nvJPEG refused) is decoded between turns."""
    if not batch.deferred:
        return batch

    def turn() -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext() if turns is None else turns.turn(inside="device_decode")

    n = len(batch.rows) + len(batch.deferred)
    data = [
        torch.frombuffer(bytearray(d.jpeg or b""), dtype=torch.uint8) for _, d in batch.deferred
    ]
    with turn():
        try:
            images: list[torch.Tensor | None] = list(decoder(data))
        except (RuntimeError, ValueError, OSError):  # one bad file fails the call: PIL tries each
            images = [None] * len(data)
        out = torch.empty((n, 3, size, size), dtype=torch.uint8, device=device)
        if batch.pixels is not None:
            out[batch.rows] = batch.pixels.to(device, non_blocking=True)
        same_size: dict[tuple[int, ...], list[tuple[int, torch.Tensor]]] = {}
        refused: list[tuple[int, Decoded]] = []  # for PIL, after this turn
        for (row, d), img in zip(batch.deferred, images, strict=True):
            if img is None:
                refused.append((row, d))
                continue
            turned = upright(img, d.orientation)
            same_size.setdefault(tuple(turned.shape), []).append((row, turned))
        for group in same_size.values():  # one resize per picture size, not per picture
            _, h, w = group[0][1].shape
            step = max(1, RESIZE_PIXELS // (h * w))  # 256 phone photos at once: ~47 GB as floats
            for lo in range(0, len(group), step):
                part = group[lo : lo + step]
                rows = torch.tensor([row for row, _ in part], device=device)
                out[rows] = resize(torch.stack([img for _, img in part]), size)
        del images, same_size
    items = list(batch.items)
    at = {d.pos: i for i, d in enumerate(items)}
    keep = [True] * n
    fallback: list[tuple[int, torch.Tensor]] = []
    t0 = time.perf_counter()
    for row, d in refused:  # on the CPU, between turns
        got = decode_at(plan[d.pos], d.jpeg or b"", d.sha256, size)
        if got.error:
            items[at[d.pos]] = Decoded(d.pos, None, d.sha256, got.error, d.seconds)
            keep[row] = False
        else:
            fallback.append((row, got.pixels))
    if turns is not None and refused:
        turns.stages.add("device_decode", time.perf_counter() - t0)
    if fallback or not all(keep):
        with turn():
            for row, pixels in fallback:
                out[row] = pixels.to(device)
            if not all(keep):
                out = out[torch.tensor(keep, device=device)]
    return DecodedBatch(items, out, list(range(len(out))), [], batch.captions)
