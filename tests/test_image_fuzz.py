"""A byte-mutation fuzz of upload decoding (issue 36, rows 1 and 2): a small image in every
format this Pillow can write, each mutated a fixed number of times from a seed of its own
(derandomised: the same bytes on every run), and every result decoded as an upload is.

Each one must decode to an RGB image or be refused with a 4xx `DuetError`; no decoder
exception may escape (a 500), and no subprocess may start (Pillow's EPS plugin runs
Ghostscript). The whole run is bounded in time: it stops at `BUDGET_S` and says how far it got.
"""

from __future__ import annotations

import io
import random
import subprocess
import time
from collections import Counter
from typing import Any

import pytest
from PIL import EpsImagePlugin, Image

from app.errors import DuetError
from app.imaging import decode_image
from models.images import FORMATS

MUTATIONS = 1000  # per seed image
BUDGET_S = 50.0  # the bound is 60 s in CI; a 2-core machine takes about 3
MAX_PIXELS = 1_000_000
SIZE = (40, 28)


def _picture(mode: str) -> Image.Image:
    """A small image with some structure (compressors then have something to encode)."""
    img = Image.new("RGB", SIZE, (20, 120, 200))
    for x in range(SIZE[0]):
        img.putpixel((x, x % SIZE[1]), (250, 30, 10))
    return img.convert(mode)


def _seeds() -> dict[str, bytes]:
    """One saved image per format Pillow can write here (the first mode it accepts), and a
    few more variants of the formats duet reads."""
    Image.init()
    out: dict[str, bytes] = {}
    for fmt in sorted(set(Image.SAVE)):
        for mode in ("RGB", "L", "1", "P", "RGBA"):
            buf = io.BytesIO()
            try:
                _picture(mode).save(buf, format=fmt)
            except Exception:  # no writer for this format or mode here
                continue
            out[fmt] = buf.getvalue()
            break
    variants: list[tuple[str, str, dict[str, Any]]] = [
        ("PNG", "RGBA", {}),
        ("PNG", "P", {}),
        ("PNG", "L", {"optimize": True}),
        ("JPEG", "RGB", {"progressive": True}),
        ("JPEG", "L", {}),
        ("WEBP", "RGBA", {"lossless": True}),
        ("GIF", "P", {"save_all": True, "append_images": [_picture("P")], "duration": 50}),
        ("TIFF", "RGB", {"compression": "tiff_deflate"}),
        ("TIFF", "RGB", {"compression": "jpeg"}),
        ("TIFF", "L", {"compression": "packbits"}),
        ("BMP", "P", {}),
    ]
    for fmt, mode, opts in variants:
        buf = io.BytesIO()
        _picture(mode).save(buf, format=fmt, **opts)
        out[f"{fmt}-{mode}-{'-'.join(opts) or 'plain'}"] = buf.getvalue()
    return out


def mutate(data: bytes, rng: random.Random) -> bytes:
    """One of: bits flipped, a header byte set, cut short, bytes inserted, a span dropped or
    repeated."""
    b = bytearray(data)
    kind = rng.randrange(6)
    if kind == 0:
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
    elif kind == 1:
        b[rng.randrange(min(len(b), 64))] = rng.randrange(256)
    elif kind == 2:
        del b[rng.randrange(len(b)) :]
    elif kind == 3:
        i = rng.randrange(len(b))
        b[i:i] = rng.randbytes(rng.randint(1, 16))
    else:
        i = rng.randrange(len(b))
        span = b[i : i + rng.randint(1, 64)]
        b[i : i + len(span)] = span * 2 if kind == 4 else b""
    return bytes(b)


@pytest.fixture
def no_subprocess(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Every subprocess start is recorded and refused; Pillow is made to believe Ghostscript
    is installed, so an EPS that reached its decoder would try to run it."""
    started: list[object] = []

    def refuse(args: object, *_: object, **__: object) -> None:
        started.append(args)
        raise OSError("no subprocess may start while decoding an upload")

    monkeypatch.setattr(subprocess, "Popen", refuse)
    monkeypatch.setattr(EpsImagePlugin, "gs_binary", "gs")
    return started


EPS_LOOP = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 64 64\n{ } loop\n"


def test_eps_never_reaches_ghostscript(no_subprocess: list[object]) -> None:
    """Row 1: an EPS is refused as a format duet does not read, before any decoder runs."""
    with pytest.raises(DuetError) as exc:
        decode_image(EPS_LOOP, max_bytes=100_000, max_pixels=MAX_PIXELS)
    assert exc.value.status == 400 and exc.value.code == "invalid_image"
    assert "PNG, JPEG, WebP, GIF, TIFF or BMP" in exc.value.message
    assert no_subprocess == []


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_allowed_format_decodes(fmt: str) -> None:
    buf = io.BytesIO()
    _picture("RGB").save(buf, format=fmt)
    img = decode_image(buf.getvalue(), max_bytes=100_000, max_pixels=MAX_PIXELS)
    assert img.mode == "RGB" and img.size == SIZE


def test_mutated_images_are_decoded_or_refused_with_4xx(no_subprocess: list[object]) -> None:
    """Row 2: every mutation of every seed decodes or is a 4xx, within the time bound."""
    seeds = _seeds()
    assert {"AVIF", "EPS", "PNG", "JPEG", "WEBP", "GIF", "TIFF", "BMP"} <= set(seeds)
    outcomes: Counter[str] = Counter()
    escaped: dict[str, str] = {}
    t0 = time.monotonic()
    slowest = 0.0
    for name, data in seeds.items():
        rng = random.Random(f"issue36-{name}")
        for _ in range(MUTATIONS):
            if time.monotonic() - t0 > BUDGET_S:
                break
            sample = mutate(data, rng)
            t = time.monotonic()
            try:
                decode_image(sample, max_bytes=1_000_000, max_pixels=MAX_PIXELS)
                outcomes["decoded"] += 1
            except DuetError as exc:
                assert 400 <= exc.status < 500, exc.message
                outcomes[exc.code] += 1
            except Exception as exc:
                escaped.setdefault(f"{name}: {type(exc).__name__}", str(exc)[:120])
                outcomes["escaped"] += 1
            slowest = max(slowest, time.monotonic() - t)
    took = time.monotonic() - t0
    tried = sum(outcomes.values())
    print(f"\n{tried} mutated images of {len(seeds)} seeds in {took:.1f} s: {dict(outcomes)}")
    assert not escaped, escaped
    assert no_subprocess == []
    assert tried >= len(seeds) * MUTATIONS // 2, "the time budget cut the fuzz short"
    assert slowest < 5, f"one image took {slowest:.1f} s to decode or refuse"
