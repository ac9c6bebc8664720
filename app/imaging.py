"""Decoding uploaded images safely: byte and pixel limits, truncation, decompression bombs."""

from __future__ import annotations

import io
import warnings

from PIL import Image, UnidentifiedImageError

from app.errors import ImageTooLarge, InvalidImage


def decode_image(data: bytes, max_bytes: int, max_pixels: int) -> Image.Image:
    """Bytes -> RGB image, or a 4xx DuetError saying what is wrong and what is allowed."""
    if not data:
        raise InvalidImage("the image is empty")
    if len(data) > max_bytes:
        raise ImageTooLarge(f"image is {len(data)} bytes; the limit is {max_bytes} "
                            "(DUET_MAX_IMAGE_BYTES)")
    try:
        with warnings.catch_warnings():
            # Pillow's decompression-bomb guard: its warning becomes an error here
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
            w, h = img.size
            if w * h > max_pixels:
                raise ImageTooLarge(f"image is {w}x{h} = {w * h} pixels; the limit is "
                                    f"{max_pixels} (DUET_MAX_IMAGE_PIXELS)")
            img.load()
            return img.convert("RGB")
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageTooLarge(f"image rejected as a decompression bomb: {exc}") from exc
    except UnidentifiedImageError as exc:
        raise InvalidImage(
            "the upload is not an image Pillow can read (PNG, JPEG, WebP, ...)") from exc
    except (OSError, ValueError, SyntaxError) as exc:
        raise InvalidImage(f"the image is corrupt or truncated: {exc}") from exc
