"""Upload decoding: every kind of bad image is a 4xx DuetError, never a crash."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from app.errors import DuetError, ImageTooLarge, InvalidImage
from app.imaging import decode_image


def _png(size: tuple[int, int], mode: str = "RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size).save(buf, format="PNG")
    return buf.getvalue()


def test_good_image_becomes_rgb() -> None:
    img = decode_image(_png((10, 20), "L"), max_bytes=10_000, max_pixels=1_000)
    assert img.mode == "RGB" and img.size == (10, 20)


@pytest.mark.parametrize(
    ("data", "error"),
    [
        (b"", InvalidImage),
        (b"GIF89a but not really", InvalidImage),
        (_png((32, 32))[:40], InvalidImage),
        (_png((100, 100)), ImageTooLarge),  # 10,000 pixels > 5,000
    ],
)
def test_bad_images(data: bytes, error: type[DuetError]) -> None:
    with pytest.raises(error) as exc:
        decode_image(data, max_bytes=100_000, max_pixels=5_000)
    assert 400 <= exc.value.status < 500 and exc.value.message


def test_too_many_bytes() -> None:
    """An upload is read up to the limit and one byte more: the message claims no size."""
    with pytest.raises(ImageTooLarge) as exc:
        decode_image(_png((8, 8)), max_bytes=10, max_pixels=10_000)
    assert exc.value.message == "image is larger than the limit of 10 bytes (DUET_MAX_IMAGE_BYTES)"


def test_pillow_bomb_guard_is_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Even when our own pixel limit is generous, Pillow's guard still refuses a bomb."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1_000)
    with pytest.raises(ImageTooLarge, match="decompression bomb"):
        decode_image(_png((100, 100)), max_bytes=100_000, max_pixels=10**9)


def test_exif_orientation_is_applied() -> None:
    """A phone photo stored sideways with Orientation = 6 (rotate 90° clockwise) is decoded
    upright, as every viewer shows it."""
    img = Image.new("RGB", (40, 20), (255, 0, 0))
    exif = Image.Exif()
    exif[0x0112] = 6
    buf = io.BytesIO()
    img.save(buf, format="JPEG", exif=exif)
    assert decode_image(buf.getvalue(), max_bytes=100_000, max_pixels=10_000).size == (20, 40)


def test_large_images_are_kept_reduced() -> None:
    """A 4,096 x 2,048 upload waits for the model as 1,024 x 512 (an integer box reduction)."""
    img = decode_image(_png((4096, 2048)), max_bytes=10**7, max_pixels=10**8)
    assert img.size == (1024, 512) and img.mode == "RGB"


@pytest.mark.parametrize(("fmt", "mode"), [("PNG", "I;16"), ("TIFF", "I;16"), ("TIFF", "F")])
def test_grey_wider_than_8_bits_keeps_its_levels(fmt: str, mode: str) -> None:
    """A 16-bit grey PNG or TIFF and a float TIFF (0..1) read as their grey levels: Pillow's
    convert("RGB") clipped them, so the builder indexed, and a search read, a white (or
    black) picture."""
    import numpy as np

    ramp = np.linspace(0.0, 1.0, 48 * 64, dtype=np.float64).reshape(48, 64)
    levels = ramp.astype(np.float32) if mode == "F" else (ramp * 65535).astype(np.uint16)
    buf = io.BytesIO()
    picture = Image.fromarray(levels)
    assert picture.mode == mode
    picture.save(buf, format=fmt)
    img = decode_image(buf.getvalue(), max_bytes=1_000_000, max_pixels=10_000)
    got = np.asarray(img, dtype=np.float64)
    assert img.mode == "RGB" and np.abs(got[..., 0] - ramp * 255).max() <= 1.0
    assert np.array_equal(got[..., 0], got[..., 2])
