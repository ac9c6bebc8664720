"""One index version's tables resident on the device step's device (`models.device_step`):
the image side (search vectors, image states for the cross-encoder) and, for image queries,
the caption side (search vectors, token ids). Made when a version is loaded or swapped in,
released with it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from models.step_graphs import StepGraphs


class ResidentTables:
    """One index version's image vectors (float32, for search) and image states (in the
    step's precision, for the cross-encoder) on the step's device."""

    SLICE = 65536  # image-state rows copied at a time (512 MB of float16 at 16 x 256)

    def __init__(
        self, vectors: np.ndarray, tokens: np.ndarray, device: torch.device, dtype: torch.dtype
    ) -> None:
        self.vectors = torch.from_numpy(np.ascontiguousarray(vectors, np.float32)).to(device)
        # copied in slices: a memory-mapped table larger than RAM never sits there whole
        self.tokens = torch.empty(tokens.shape, dtype=dtype, device=device)
        for a in range(0, tokens.shape[0], self.SLICE):
            part = torch.from_numpy(np.array(tokens[a : a + self.SLICE]))
            self.tokens[a : a + self.SLICE] = part.to(device=device, dtype=dtype)
        self.rows = int(self.vectors.shape[0])
        if self.tokens.shape[0] != self.rows:
            raise ValueError(
                f"index has {self.rows} vectors but {self.tokens.shape[0]} image-state rows"
            )

        self.captions: CaptionTables | None = None  # the caption side, for image queries
        self.graphs: StepGraphs | None = None  # the step's CUDA graphs over these

    @property
    def nbytes(self) -> int:
        own = sum(t.element_size() * t.nelement() for t in (self.vectors, self.tokens))
        return own + (0 if self.captions is None else self.captions.nbytes)

    def release(self) -> None:
        """Free the device memory now (a swapped-out version's tables)."""
        if self.graphs is not None:  # first: they read the tables
            self.graphs.drop()
            self.graphs = None
        self.vectors = self.vectors.new_zeros((0, self.vectors.shape[1]))
        self.tokens = self.tokens.new_zeros((0, *self.tokens.shape[1:]))
        self.rows = 0
        if self.captions is not None:
            self.captions.release()


class CaptionTables:
    """One index version's captions on the device, for image queries: their vectors (float32,
    for search) and token ids (int32, zero-padded to the longest caption)."""

    def __init__(self, vectors: np.ndarray, ids: np.ndarray, device: torch.device) -> None:
        self.vectors = torch.from_numpy(np.ascontiguousarray(vectors, np.float32)).to(device)
        self.ids = torch.from_numpy(np.ascontiguousarray(ids, np.int32)).to(device)
        self.rows = int(self.vectors.shape[0])
        self.width = int(ids.shape[1])
        if self.ids.shape[0] != self.rows:
            raise ValueError(f"{self.rows} caption vectors but {self.ids.shape[0]} id rows")

    @property
    def nbytes(self) -> int:
        return sum(t.element_size() * t.nelement() for t in (self.vectors, self.ids))

    def release(self) -> None:
        self.vectors = self.vectors.new_zeros((0, self.vectors.shape[1]))
        self.ids = self.ids.new_zeros((0, self.width))
        self.rows = 0


def id_table(rows: Sequence[Sequence[int]], width: int | None = None) -> np.ndarray:
    """Token id rows as a (len(rows), width) int32 table, zero-padded (width: the longest
    row's unless given; a longer row is cut)."""
    width = max((len(r) for r in rows), default=1) if width is None else width
    table = np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):
        table[i, : min(len(r), width)] = r[:width]
    return table
