"""Image queries for the load generator (`serve_load.py --route image`): uploads of rendered
scenes from a held-out world seed, every request's file its own bytes.

Both servers would answer a repeated upload from a cache keyed by the file's bytes (duet's
is), so each request's PNG carries a text chunk with a running number: the same picture,
different bytes, no cache answers, as the text route's different captions give. The scenes
are rendered and encoded once, before the load starts; a request costs a chunk spliced in
and base64 (a few microseconds), not a render.
"""

from __future__ import annotations

import base64
import json
import random
import struct
import zlib
from itertools import count

from benchmarks.load_client import Queries
from models import world
from models.world.corpus import png_bytes

IEND = b"\x00\x00\x00\x00IEND\xaeB`\x82"  # a PNG's last chunk, always these 12 bytes


def with_text(png: bytes, text: bytes) -> bytes:
    """`png` with a tEXt chunk (keyword "n", value `text`) before its IEND: the same image,
    other bytes."""
    if not png.endswith(IEND):
        raise ValueError("not a PNG ending in its IEND chunk")
    data = b"n\x00" + text
    chunk = struct.pack(">I", len(data)) + b"tEXt" + data
    chunk += struct.pack(">I", zlib.crc32(b"tEXt" + data) & 0xFFFFFFFF)
    return png[: -len(IEND)] + chunk + IEND


class ImageQueries(Queries):
    """`scenes` rendered scenes, cycled; each request's upload made unique by `with_text`."""

    path = "/search/image"

    def __init__(self, seed: int, scenes: int = 512) -> None:  # no captions drawn
        rng = random.Random(seed)
        self._pngs = [png_bytes(world.render(rng, world.sample_scene(rng))) for _ in range(scenes)]
        self._seed = seed
        self._n = count()

    def next(self) -> str:
        """The next upload, base64-encoded (what `image_b64` takes)."""
        k = next(self._n)
        png = with_text(self._pngs[k % len(self._pngs)], f"{self._seed}-{k}".encode())
        return base64.b64encode(png).decode()

    def body(self, rerank: bool, candidates: int) -> bytes:
        """The next request's JSON body, for `path`."""
        return json.dumps(
            {"image_b64": self.next(), "top_k": 10, "candidates": candidates, "rerank": rerank}
        ).encode()
