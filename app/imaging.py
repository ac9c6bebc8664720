"""Decoding uploaded images safely: an allow-list of formats, byte and pixel limits,
truncation, decompression bombs, EXIF orientation, and a bound on the memory that decoding
takes across requests."""

from __future__ import annotations

import asyncio
import io
import warnings
from concurrent.futures import ThreadPoolExecutor

from PIL import Image, ImageOps, UnidentifiedImageError

from app.errors import DuetError, ImageTooLarge, InvalidImage

# Decoded images are kept at most this many pixels on a side (an integer box reduction, so a
# 5000x5000 upload waits for its model call as 1250x1250): every model duet serves resizes to
# 384 pixels or fewer, and a queued 25 MP RGB image would otherwise hold 75 MB.
KEEP_SIDE = 1024

# The only formats an upload is opened as. Pillow would otherwise try every plugin it has:
# EPS then runs the host's Ghostscript on the upload (a PostScript `{ } loop` never ends), and
# the rarer decoders (AVIF, ICNS, SPIDER, ...) raise exceptions nobody lists. A JPEG that
# carries several pictures is read by the JPEG plugin as MPO (its first picture is used).
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "TIFF", "BMP")


def decode_image(data: bytes, max_bytes: int, max_pixels: int) -> Image.Image:
    """Bytes -> RGB image, upright per its EXIF orientation, at most about KEEP_SIDE pixels
    on a side; or a 4xx DuetError saying what is wrong and what is allowed."""
    if not data:
        raise InvalidImage("the image is empty")
    if len(data) > max_bytes:
        raise ImageTooLarge(
            f"image is {len(data)} bytes; the limit is {max_bytes} (DUET_MAX_IMAGE_BYTES)"
        )
    try:
        with warnings.catch_warnings():
            # Pillow's decompression-bomb guard: its warning becomes an error here
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=FORMATS)
            w, h = img.size
            if w * h > max_pixels:
                raise ImageTooLarge(
                    f"image is {w}x{h} = {w * h} pixels; the limit is "
                    f"{max_pixels} (DUET_MAX_IMAGE_PIXELS)"
                )
            if img.format == "JPEG":  # DCT scaling: decode at 1/2, 1/4 or 1/8 when that is enough
                img.draft("RGB", (KEEP_SIDE, KEEP_SIDE))
            img.load()
            rgb = ImageOps.exif_transpose(img).convert("RGB")
            del img
            factor = max(rgb.size) // KEEP_SIDE
            return rgb.reduce(factor) if factor >= 2 else rgb
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageTooLarge(f"image rejected as a decompression bomb: {exc}") from exc
    except UnidentifiedImageError as exc:
        raise InvalidImage(
            "the upload is not an image in a format duet reads; send PNG, JPEG, WebP, GIF, "
            "TIFF or BMP"
        ) from exc
    except DuetError:
        raise
    except Exception as exc:  # whatever a decoder raises, the upload is at fault
        raise InvalidImage(
            f"the image is corrupt or truncated ({type(exc).__name__}: {exc}); send a whole "
            "PNG, JPEG, WebP, GIF, TIFF or BMP file"
        ) from exc


class ImageDecoder:
    """Decodes uploads off the event loop on a few threads of its own: at most
    `pixels_in_flight // max_pixels` images (at least one) are decoded at once, so decoding
    memory is bounded however many uploads arrive together; the rest wait as bytes."""

    def __init__(self, max_bytes: int, max_pixels: int, pixels_in_flight: int) -> None:
        self.max_bytes = max_bytes
        self.max_pixels = max_pixels
        self.threads = max(1, pixels_in_flight // max_pixels)
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="duet-decode")

    async def decode(self, data: bytes) -> Image.Image:
        return await asyncio.get_running_loop().run_in_executor(
            self._pool, decode_image, data, self.max_bytes, self.max_pixels
        )

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
