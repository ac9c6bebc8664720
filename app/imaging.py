"""Decoding uploaded images safely: an allow-list of formats, byte and pixel limits,
truncation, decompression bombs, EXIF orientation, and a bound on the memory that decoding
takes across requests."""

from __future__ import annotations

import asyncio
import warnings
from concurrent.futures import ThreadPoolExecutor

from PIL import Image, UnidentifiedImageError

from app.errors import DuetError, ImageTooLarge, InvalidImage
from app.threadname import name_os_thread
from models.images import KEEP_SIDE, open_rgb


def decode_image(
    data: bytes, max_bytes: int, max_pixels: int, side: int = KEEP_SIDE
) -> Image.Image:
    """Bytes -> RGB image, upright per its EXIF orientation, at most about KEEP_SIDE pixels
    on a side, a JPEG decoded at the DCT scale `side` allows, exactly as the builder decodes
    the same file (`models.images.open_rgb`); or a 4xx DuetError saying what is wrong and what
    is allowed."""
    if not data:
        raise InvalidImage("the image is empty")
    if len(data) > max_bytes:
        raise ImageTooLarge(
            f"image is {len(data)} bytes; the limit is {max_bytes} (DUET_MAX_IMAGE_BYTES)"
        )

    def check(w: int, h: int) -> None:
        if w * h > max_pixels:
            raise ImageTooLarge(
                f"image is {w}x{h} = {w * h} pixels; the limit is "
                f"{max_pixels} (DUET_MAX_IMAGE_PIXELS)"
            )

    try:
        with warnings.catch_warnings():
            # Pillow's decompression-bomb guard: its warning becomes an error here
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            return open_rgb(data, side, check)
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
        # the side pictures keep for the models: set once they are loaded (`side_of`)
        self.side = KEEP_SIDE
        self.threads = max(1, pixels_in_flight // max_pixels)
        self._pool = ThreadPoolExecutor(
            self.threads, thread_name_prefix="duet-decode", initializer=name_os_thread
        )

    async def decode(self, data: bytes) -> Image.Image:
        return await asyncio.get_running_loop().run_in_executor(
            self._pool, decode_image, data, self.max_bytes, self.max_pixels, self.side
        )

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
