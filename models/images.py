"""The one way an image file becomes the RGB picture a model reads: the builder's corpus
images (`index_builder.decode`) and the service's uploads (`app.imaging`) both go through
`open_rgb`, so a photo searched with is decoded exactly as the same photo was indexed.

* Only the formats in `FORMATS` are opened (Pillow would otherwise try every plugin it has:
  EPS runs the host's Ghostscript on the file).
* A JPEG is decoded at the smallest DCT scale (1/1, 1/2, 1/4 or 1/8) that keeps both sides at
  least `side` pixels: the builtin model reads 64 x 64 and asks for 128 (`side_for`), so a
  512 x 384 photo is decoded at 256 x 192 in two thirds of the time of
  a full decode, and a resize to 64 x 64 follows either way.
* The picture is turned upright by its EXIF orientation (phones store most portraits
  sideways with orientation 6), then made RGB, then box-reduced by an integer factor to about
  `KEEP_SIDE` pixels on a side at most.
"""

from __future__ import annotations

import io
from collections.abc import Callable

import numpy as np
import torch
from PIL import Image, ImageOps

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "TIFF", "BMP")

# Decoded images are kept at most about this many pixels on a side: every model duet serves
# resizes to 384 pixels or fewer, and a 25 MP RGB image would otherwise hold 75 MB.
KEEP_SIDE = 1024

ORIENTATION = 0x0112  # the EXIF tag

# which decode built an index version (its manifest's `build.decode`): 1 = `open_rgb`, photos
# upright by EXIF; 0 (or absent) = before it, when the builder stored them as shot
DECODE = 1


def side_for(input_side: int) -> int:
    """The side a picture keeps when decoded for a model that reads `input_side` pixels a side:
    twice that, so a JPEG decoded at a DCT scale leaves the resize two real pixels a side to
    average. At 1/4 of a 512 x 384 photo (128 x 96) the JPEG demo corpus lost 0.4 points of
    dot-product R@1 against a full decode; at 1/2 (256 x 192) nothing, in 2/3 of the time."""
    return 2 * input_side


def side_of(model: object) -> int:
    """The side pictures keep for the service's models (`models.loading.Models`, or a bare
    `BuiltinModel`), by the builder's rule for them: the builtin model's (`side_for` its
    input) when it reads every image, as encoder and token source; else KEEP_SIDE, since a
    Hugging Face processor resizes from the whole picture."""
    joint = getattr(model, "joint", None) or model
    side = getattr(joint, "decode_side", KEEP_SIDE)
    return side if isinstance(side, int) else KEEP_SIDE


# grey levels wider than 8 bits (a 16-bit PNG or TIFF, a float TIFF), which Pillow's
# convert("RGB") clips rather than scales: a 16-bit grey picture came out all white
WIDE_MODES = frozenset({"I", "I;16", "I;16L", "I;16B", "I;16N", "F"})


def eight_bit(img: Image.Image) -> Image.Image:
    """A wide grey picture as 8-bit grey: integers read as 16-bit levels (65535 is white),
    floats as 0..1 when none is above 1, else as 0..255."""
    levels = np.asarray(img, dtype=np.float32)
    if img.mode == "F":
        scale = 255.0 if levels.size and float(np.nanmax(levels)) <= 1.0 else 1.0
    else:
        scale = 255.0 / 65535.0
    grey = np.nan_to_num(levels * scale, nan=0.0).clip(0, 255).round().astype(np.uint8)
    return Image.fromarray(grey, "L")


def open_rgb(
    data: bytes, side: int = KEEP_SIDE, check: Callable[[int, int], None] | None = None
) -> Image.Image:
    """An image file's bytes -> its RGB picture, upright, JPEGs decoded at the DCT scale that
    `side` allows (see the module). `check(width, height)` sees the stored size before any
    pixel is decoded (to refuse one too large). Raises what Pillow raises for a file it cannot
    read (UnidentifiedImageError for a format outside FORMATS)."""
    img: Image.Image = Image.open(io.BytesIO(data), formats=FORMATS)
    if check is not None:
        check(*img.size)
    if img.format in ("JPEG", "MPO"):  # MPO: a phone's JPEG with more pictures after it
        img.draft("RGB", (min(side, KEEP_SIDE),) * 2)
    img.load()
    ImageOps.exif_transpose(img, in_place=True)  # a copy of every upright picture otherwise
    if img.mode in WIDE_MODES:
        img = eight_bit(img)
    rgb = img if img.mode == "RGB" else img.convert("RGB")  # convert copies an RGB one too
    del img
    factor = max(rgb.size) // KEEP_SIDE
    return rgb.reduce(factor) if factor >= 2 else rgb


def claimed_formats(data: bytes) -> list[str]:
    """The formats of `FORMATS` whose signature (Pillow's `accept` of the first bytes) `data`
    starts with: what the file says it is, before any of it is decoded."""
    Image.init()
    claimed = []
    for fmt in FORMATS:
        if fmt not in Image.OPEN:
            continue
        accept = Image.OPEN[fmt][1]
        known = accept is None or accept(data[:16])
        if known and not isinstance(known, str):  # a str: Pillow's warning, not a match
            claimed.append(fmt)
    return claimed


def why_unread(data: bytes) -> str:
    """Why `open_rgb` found no format for `data` (its UnidentifiedImageError), in words: a
    file that starts as one of `FORMATS` is that format broken, whose own complaint Pillow's
    open drops; anything else is in no format duet reads."""
    for fmt in claimed_formats(data):
        try:
            Image.OPEN[fmt][0](io.BytesIO(data), "").close()
        except Exception as exc:
            return f"a corrupt {fmt} file ({exc})"
    return "not a PNG, JPEG, WebP, GIF, TIFF or BMP file"


def orientation(data: bytes) -> int:
    """A JPEG's EXIF orientation (1 = upright, 2-8 = flipped and/or turned), read from its
    headers without decoding a pixel; 1 when it has none or cannot be read."""
    try:
        with Image.open(io.BytesIO(data), formats=("JPEG",)) as img:
            value = img.getexif().get(ORIENTATION, 1)
    except Exception:  # an unreadable file is the decoder's to report
        return 1
    return value if isinstance(value, int) and 1 <= value <= 8 else 1


def upright(pixels: torch.Tensor, value: int) -> torch.Tensor:
    """(..., H, W) pixels as stored -> as `ImageOps.exif_transpose` turns a picture of EXIF
    orientation `value`: for a picture decoded on a device (`index_builder.device_decode`)."""
    h, w = pixels.dim() - 2, pixels.dim() - 1
    if value == 2:  # mirrored
        return pixels.flip(w)
    if value == 3:  # upside down
        return pixels.flip(h, w)
    if value == 4:
        return pixels.flip(h)
    if value == 5:  # Image.Transpose.TRANSPOSE
        return pixels.transpose(h, w)
    if value == 6:  # turned a quarter anticlockwise when stored: a quarter clockwise back
        return torch.rot90(pixels, -1, (h, w))
    if value == 7:  # Image.Transpose.TRANSVERSE
        return pixels.transpose(h, w).flip(h, w)
    if value == 8:
        return torch.rot90(pixels, 1, (h, w))
    return pixels
