"""A re-rank's rows of the image-state table, read from its memory map.

The table (`image_tokens.npy`, 16 x 128 fp16 values: 4 KB a row) is memory-mapped. While it
sits in the page cache, gathering a request's rows is a copy. Once the table is larger than
the page cache (10M images: 41 GB), plain fancy indexing faults the rows in one at a time,
and each fault reads ahead around its page: 50 random rows of a 100k table took ~10 ms on the
2-core machine's disk with the file evicted, against 0.013 ms cached. Announcing the rows'
byte ranges first (`POSIX_FADV_WILLNEED`) has the kernel read exactly those pages, all of them
at once: 0.15 ms evicted, 0.05 ms cached (`python benchmarks/token_reads.py`,
docs/scale.md).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import numpy as np


def open_hints(path: Path) -> int | None:
    """A descriptor of the table's file to announce reads on; None where the platform has no
    posix_fadvise (reads then go without the announcement)."""
    if not hasattr(os, "posix_fadvise"):
        return None
    try:
        return os.open(path, os.O_RDONLY)
    except OSError:
        return None


def close_hints(fd: int | None) -> None:
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)


def announce(table: np.ndarray, rows: np.ndarray, fd: int | None) -> None:
    """Tell the kernel which of the file's byte ranges `table[rows]` is about to read."""
    offset = getattr(table, "offset", None)  # np.memmap: where row 0 starts in the file
    if fd is None or offset is None or not len(table):
        return
    size = int(table.strides[0])
    n = len(table)
    try:
        for r in np.asarray(rows).ravel().tolist():
            if 0 <= r < n:
                os.posix_fadvise(fd, offset + r * size, size, os.POSIX_FADV_WILLNEED)
    except OSError:  # a hint, never a reason to fail the read itself
        pass


def gather(table: np.ndarray, rows: np.ndarray, fd: int | None) -> np.ndarray:
    """`table[rows]` in memory, the rows' pages announced first."""
    announce(table, rows, fd)
    return np.asarray(table[rows])
