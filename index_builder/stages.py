"""Where a build's time goes: wall seconds per stage, recorded by the builder itself (in
manifest.json's `build.stages`, and on the BuildReport) so a benchmark only reads them.

The stages, in build order:

- `read`: the corpus file (and the base of an append / delete), the shard plan and its key
  (a stat of every image);
- `setup`: a GPU build's encoder made: its copy of the model on the device (CUDA's own start
  comes before, when `duet build` loads the model on `--device`);
- `decode`: the time the encoder waited for decoded batches (read, sha256, decode, resize);
  with decode workers most of it overlaps encoding, so `decode_busy` adds up the seconds
  each image's decoding took, in whichever process or thread did it, and `device_decode`
  the seconds the thread that has the GPU decode JPEGs (`--decode-jpeg`) spent on them, and
  `device_wait` the encoder's waits for that thread's turn on the device (part of
  `encode_images` and `encode_texts`: the two take turns, `device_decode.DeviceTurns`);
- `encode_images`, `encode_texts`: the forward passes (copies to the device included);
- `shards`: writing the encoded shards (and checking them for unreadable images); on a GPU
  build a thread does it while the next shard encodes, so it overlaps the encode stages;
- `assemble`: the rows, the vectors out of the shards, the content hash;
- `faiss`: training and filling both indexes; `recall`: their recall@10 against exact search;
- `write`: the index files, arrays and item store, fsynced;
- `hash`: the sha256 of every data file, for the manifest.

Whatever is not a stage (starting Python, loading the model) is the command's wall time less
their sum (less the encode step's wall time instead of its stages, where they overlap).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

STAGES = (
    "read",
    "setup",
    "decode",
    "encode_images",
    "encode_texts",
    "shards",
    "assemble",
    "faiss",
    "recall",
    "write",
    "hash",
)
# seconds that overlap the stages above (decoding in workers), reported beside them
EXTRA = ("decode_busy", "device_decode", "device_wait")


class Stages:
    """Wall seconds per stage, summed over every time a stage ran."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = dict.fromkeys((*STAGES, *EXTRA), 0.0)

    def add(self, name: str, seconds: float) -> None:
        if name not in self.seconds:
            raise KeyError(f"unknown build stage {name!r}")
        self.seconds[name] += seconds

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        """Time the block as (part of) stage `name`."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)

    def as_json(self) -> dict[str, float]:
        """{stage: seconds}, rounded to the millisecond, in build order."""
        return {k: round(v, 3) for k, v in self.seconds.items()}

    def total(self) -> float:
        """The stages' sum (`EXTRA` left out: those overlap them)."""
        return sum(self.seconds[k] for k in STAGES)
