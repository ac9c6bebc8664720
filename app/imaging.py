"""Decoding uploaded images safely: an allow-list of formats, byte and pixel limits,
truncation, decompression bombs, EXIF orientation, and a bound on the memory that decoding
takes across requests."""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import warnings
from concurrent.futures import ThreadPoolExecutor

from PIL import Image, UnidentifiedImageError

from app.errors import DuetError, ImageTooLarge, InvalidImage
from app.threadname import name_os_thread
from models.images import KEEP_SIDE, claimed_formats, open_rgb, why_unread


def b64_image(text: str) -> bytes:
    """The bytes of a JSON body's `image_b64`: the file base64-encoded, or a browser's data
    URL of it (`data:image/png;base64,...`, what FileReader.readAsDataURL gives), whose
    prefix is left out; else a 400 saying what to send."""
    if text[:5].lower() == "data:":  # ":" is no base64 character: nothing else starts so
        comma = text.find(",", 0, 256)
        if comma < 0 or not text[:comma].lower().endswith(";base64"):
            raise InvalidImage(
                "image_b64 is a data URL without base64 data (data:<type>;base64,<data>); send "
                "the image file base64-encoded, with or without that prefix"
            )
        text = text[comma + 1 :]
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        # what `base64 FILE` prints (a line break every 76 characters) and the URL-safe
        # alphabet (- and _ for + and /) are base64 too; anything else is refused
        plain = "".join(text.split())
        urlsafe = ("-" in plain or "_" in plain) and not ("+" in plain or "/" in plain)
        if urlsafe:  # base64url is mostly sent without its padding
            plain += "=" * (-len(plain) % 4)
        try:
            return base64.b64decode(plain, altchars=b"-_" if urlsafe else None, validate=True)
        except (binascii.Error, ValueError) as again:
            why = again if plain != text else exc  # what is wrong once the forms are read
        raise InvalidImage(
            f"image_b64 is not valid base64 ({why}); send the image file's bytes "
            "base64-encoded (base64 FILE, or base64 -w0 FILE), with or without a "
            "data:image/...;base64, prefix"
        ) from exc


def stored_size(data: bytes) -> tuple[int, int] | None:
    """The width and height an image file's header states (formats `FORMATS`), read as
    Pillow's `Image.open` reads it but without its decompression-bomb check, which refuses
    a file before its size can be seen; None when no format reads the header."""
    for fmt in claimed_formats(data):
        try:
            with Image.OPEN[fmt][0](io.BytesIO(data), "") as img:
                return img.size
        except Exception:  # not this format after all: Pillow would try the next one too
            continue
    return None


def decode_image(
    data: bytes, max_bytes: int, max_pixels: int, side: int = KEEP_SIDE
) -> Image.Image:
    """Bytes -> RGB image, upright per its EXIF orientation, at most about KEEP_SIDE pixels
    on a side, a JPEG decoded at the DCT scale `side` allows, exactly as the builder decodes
    the same file (`models.images.open_rgb`); or a 4xx DuetError saying what is wrong and what
    is allowed."""
    if not data:
        raise InvalidImage("the image is empty")
    if len(data) > max_bytes:  # an upload is read up to the limit and a byte: not its size
        raise ImageTooLarge(
            f"image is larger than the limit of {max_bytes} bytes (DUET_MAX_IMAGE_BYTES)"
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
        # Pillow refuses past its own limit before `check` sees the size: duet's limit is
        # the one a caller can change, so a picture over it is told as `check` tells it
        size = stored_size(data)
        if size is not None:
            check(*size)
        pixels = f"{size[0]}x{size[1]} = {size[0] * size[1]} pixels " if size else ""
        raise ImageTooLarge(
            f"image {pixels}rejected as a decompression bomb: Pillow opens at most "
            f"{Image.MAX_IMAGE_PIXELS} pixels (DUET_MAX_IMAGE_PIXELS is {max_pixels})"
        ) from exc
    except UnidentifiedImageError as exc:
        raise InvalidImage(
            f"the upload is {why_unread(data)}: send a whole PNG, JPEG, WebP, GIF, TIFF or BMP file"
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
