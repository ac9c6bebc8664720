"""Corpora of the world: rendered samples with their captions, deterministic PNG bytes (or
photo-sized JPEGs), and a manifest plus images on disk."""

from __future__ import annotations

import io
import json
import multiprocessing as mp
import os
import random
import re
import signal
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from models.world.captioning import captions
from models.world.rendering import Layout, render_layout
from models.world.scenes import Scene, sample_scene


@dataclass
class Sample:
    """One rendered scene with its captions."""

    scene: Scene
    image: Image.Image
    captions: list[str]
    layout: Layout


def generate(n_images: int, seed: int, n_captions: int = 5) -> Iterator[Sample]:
    """Yield `n_images` samples; the same seed always yields the same samples."""
    rng = random.Random(seed)
    for _ in range(n_images):
        scene = sample_scene(rng)
        image, layout = render_layout(rng, scene)
        yield Sample(scene, image, captions(rng, scene, n_captions), layout)


def png_bytes(img: Image.Image) -> bytes:
    """Encode deterministically (no timestamps or text chunks in the PNG)."""
    buf = io.BytesIO()
    img.save(buf, format="PNG", optimize=False, compress_level=6)
    return buf.getvalue()


@dataclass(frozen=True)
class PhotoStyle:
    """How `write_corpus` stores images the size of users' photos: the rendered scene scaled
    to `size` (width, height), a fixed film grain added (so the file costs what a photo costs
    to decode, not what a flat drawing does), saved as JPEG at `quality`."""

    size: tuple[int, int] = (512, 384)
    quality: int = 90
    grain: float = 8.0  # standard deviation of the grain, in 8-bit levels
    tiles: int = 8  # grain patterns drawn once per corpus, used in turn

    def grain_tiles(self, seed: int) -> list[np.ndarray]:
        rng = np.random.default_rng(seed)
        w, h = self.size
        return [
            (rng.standard_normal((h, w, 3), dtype=np.float32) * self.grain).astype(np.int16)
            for _ in range(self.tiles)
        ]

    def encode(self, img: Image.Image, grain: np.ndarray) -> bytes:
        """The scene as a JPEG photo; the same inputs give the same bytes."""
        big = np.asarray(img.resize(self.size, Image.Resampling.BICUBIC), dtype=np.int16)
        photo = Image.fromarray(np.clip(big + grain, 0, 255).astype(np.uint8))
        buf = io.BytesIO()
        photo.save(buf, format="JPEG", quality=self.quality)
        return buf.getvalue()


def write_corpus(
    out: Path,
    n_images: int,
    seed: int,
    n_captions: int = 5,
    progress: bool = True,
    photo: PhotoStyle | None = None,
    workers: int = 1,
) -> Path:
    """Write `out/manifest.jsonl` and `out/images/*.png` (`*.jpg` in the `photo` style);
    return the manifest path. With `workers` > 1 the photos are scaled, grained and encoded
    by that many processes (most of a photo's cost; the scenes are drawn here, in order), so
    the bytes are the same whatever the number. The manifest is put in place last (an old
    one removed first), so an interrupted corpus has none, rather than one listing files
    that are missing or not yet rewritten; its lines so far are in `manifest.jsonl.partial`."""
    from models.bars import tqdm

    out.mkdir(parents=True, exist_ok=True)
    (out / "images").mkdir(exist_ok=True)
    manifest = out / "manifest.jsonl"
    partial = out / "manifest.jsonl.partial"  # in place once every file it lists is written
    before = demo_images(out) or set()  # a demo corpus's images written here before
    manifest.unlink(missing_ok=True)
    width = max(4, len(str(n_images - 1)))
    with (
        partial.open("w", encoding="utf-8") as fh,
        _Photos(out, photo, seed, workers, n_images) as photos,
    ):
        samples = generate(n_images, seed, n_captions)
        for i, sample in enumerate(
            tqdm(samples, total=n_images, desc="rendering", unit="img", disable=not progress)
        ):
            name = f"{i:0{width}d}"
            if photo is None:
                rel = f"images/{name}.png"
                (out / rel).write_bytes(png_bytes(sample.image))
            else:
                rel = f"images/{name}.jpg"
                photos.write(rel, sample.image, i)
            line = {
                "id": f"img-{name}",
                "image": rel,
                "captions": sample.captions,
                "meta": {"scene": sample.scene.to_json(), "seed": seed},
            }
            fh.write(json.dumps(line, sort_keys=True) + "\n")
            before.discard(rel)
    partial.replace(manifest)
    for rel in before:  # a larger or other-format demo corpus's images, listed no more
        (out / rel).unlink(missing_ok=True)
    return manifest


# the image files `write_corpus` names, the only ones a demo corpus written again removes
_OWN_IMAGE = re.compile(r"images/\d{4,}\.(png|jpg)")


def demo_images(out: Path) -> set[str] | None:
    """The image files a demo corpus (`write_corpus`) in `out` lists: its manifest's, or an
    interrupted one's `manifest.jsonl.partial` (empty when cut before its first line), only
    those named as it names them (`images/0042.png`: never a path out of its folder); None
    when `out` holds no demo corpus (a manifest whose first line is no scene of the world)."""
    for name in ("manifest.jsonl", "manifest.jsonl.partial"):
        path = out / name
        if not path.is_file():
            continue
        try:
            with path.open(encoding="utf-8") as fh:
                first = next((json.loads(line) for line in fh if line.strip()), None)
                if first is None:
                    return set() if name.endswith(".partial") else None
                if not (isinstance(first, dict) and "scene" in (first.get("meta") or {})):
                    return None
                lines = [first, *(json.loads(line) for line in fh if line.strip())]
        except (ValueError, UnicodeDecodeError):
            return None
        listed = (line.get("image") for line in lines if isinstance(line, dict))
        return {rel for rel in listed if isinstance(rel, str) and _OWN_IMAGE.fullmatch(rel)}
    return None


def foreign_files(out: Path) -> list[str]:
    """The names of what `out` holds that no demo corpus wrote (at most five), or [] when it
    is missing, empty or a demo corpus's folder: a corpus is only written over another demo
    corpus, never over a user's files (`duet demo-corpus --force` to do it anyway)."""
    if not out.is_dir():
        return [out.name] if out.exists() else []
    names = sorted(p.name for p in out.iterdir())
    if not names or demo_images(out) is not None:
        return []
    return names[:5]


# a photo worker's style and grain, set once per process by `_photo_worker_init`
_WORKER: dict[str, Any] = {}


def _photo_worker_init(out: Path, photo: PhotoStyle, seed: int, parent: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the caller's to handle
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    _WORKER.update(out=out, photo=photo, grain=photo.grain_tiles(seed))


def _exit_with_parent(parent: int) -> None:
    """A worker whose caller died without shutting the pool down (SIGTERM to it alone,
    SIGKILL, the OOM killer) would wait on its task queue for ever: it exits instead."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def _write_photo(rel: str, image: Image.Image, i: int, state: dict[str, Any] | None = None) -> None:
    """Encode and write one photo: in a worker process (its `_WORKER`), or here (`state`)."""
    st = _WORKER if state is None else state
    grain = st["grain"]
    (st["out"] / rel).write_bytes(st["photo"].encode(image, grain[i % len(grain)]))


@contextmanager
def _signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM kept until the block ends, then delivered as they came. A pool's
    shutdown interrupted by one (a second Ctrl-C) leaves its threads half stopped, and the
    interpreter's exit then waits on its workers for ever (CPython 3.11, gh-90882: 7 runs of
    40 hung). Signals reach Python's handlers on the main thread only; elsewhere, as is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came: list[int] = []
    kept = {s: signal.signal(s, lambda signum, _: came.append(signum)) for s in _HELD}
    try:
        yield
    finally:
        for sig, handler in kept.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        for signum in dict.fromkeys(came):
            signal.raise_signal(signum)


_HELD = (signal.SIGINT, signal.SIGTERM)


class _Photos:
    """Writes a corpus's photos, here or in a pool of processes; a pool keeps at most a few
    photos a worker in flight (the drawn scenes wait in memory meanwhile), and an error in
    one is raised here."""

    def __init__(
        self, out: Path, photo: PhotoStyle | None, seed: int, workers: int, n_images: int
    ) -> None:
        workers = max(1, min(workers, n_images))  # a process per photo at most
        self._pool: ProcessPoolExecutor | None = None
        self._pending: deque[Future[None]] = deque()
        self._limit = 8 * workers
        self._here: dict[str, Any] = {}
        if photo is not None and workers > 1:
            self._pool = ProcessPoolExecutor(
                workers,
                mp_context=mp.get_context("spawn"),
                initializer=_photo_worker_init,
                initargs=(out, photo, seed, os.getpid()),
            )
        elif photo is not None:
            self._here = {"out": out, "photo": photo, "grain": photo.grain_tiles(seed)}

    def write(self, rel: str, image: Image.Image, i: int) -> None:
        if self._pool is None:
            _write_photo(rel, image, i, self._here)
            return
        self._pending.append(self._pool.submit(_write_photo, rel, image, i))
        while len(self._pending) > self._limit:
            self._pending.popleft().result()

    def __enter__(self) -> _Photos:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            while self._pending and exc[0] is None:
                self._pending.popleft().result()
        finally:
            if self._pool is not None:
                with _signals_held():
                    self._pool.shutdown(wait=True, cancel_futures=True)
