"""The text tower's states of the captions image queries re-rank, kept between requests.

An image query re-ranks its 50 candidate captions with the cross-encoder, which reads each
caption's text states: the text tower ran over all 50 on every request, about a third of the
re-rank (14 of 40 ms on the 2-core CPU). A caption's states depend on its words and the
model alone, and the same captions come up again and again, so the most recently used are
kept here, up to a byte budget, and only the others go through the tower (in one batch).

A caption's states are the same numbers whichever batch computed them: the tower masks the
padded positions, and what is kept is each caption's real positions (cut from its batch and
copied, so the batch is freed). Logits from kept states equal those from a fresh batch
exactly on the 2-core CPU (tests/test_caption_states.py holds them to 1e-6).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

# the states kept (fp32, 128 values a token: ~6 KB for a 12-word caption, so ~10,000
# captions, the demo index's all)
CAPTION_STATES_BYTES = 64 * 1024 * 1024

# texts -> (their states (n, L, d), True at real positions (n, L)), one batch
Tower = Callable[[list[str]], tuple[torch.Tensor, torch.Tensor]]


class CaptionStates:
    """Each caption's text states (its real positions, (length, d)), the most recently used
    kept up to `budget` bytes. Safe for concurrent callers (the engine's workers): the map
    is locked, the tower runs outside the lock (two callers may compute one caption twice)."""

    def __init__(self, tower: Tower, budget: int = CAPTION_STATES_BYTES) -> None:
        self._tower = tower
        self.budget = budget
        self._kept: OrderedDict[str, np.ndarray | torch.Tensor] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        # distinct captions of each call read from those kept, and put through the tower:
        # each only grows (a scrape between the two is never ahead of what happened)
        self.kept = 0
        self.computed = 0

    def __len__(self) -> int:
        return len(self._kept)

    @property
    def bytes(self) -> int:
        return self._bytes

    def states(self, texts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Distinct `texts` -> their states padded (n, L, d) with zeros, and True at real
        positions (n, L): what the tower gives for them as one batch, at their real positions."""
        got: dict[str, torch.Tensor] = {}
        with self._lock:
            for t in texts:
                held = self._kept.get(t)
                if held is not None:
                    self._kept.move_to_end(t)
                    got[t] = torch.from_numpy(held) if isinstance(held, np.ndarray) else held
            self.kept += len(got)
        missing = [t for t in texts if t not in got]
        if missing:
            out, keep = self._tower(missing)
            lengths = keep.sum(dim=1).tolist()
            fresh = {
                t: out[i, :n].clone() for i, (t, n) in enumerate(zip(missing, lengths, strict=True))
            }
            got.update(fresh)
            self._keep(fresh)
        rows = [got[t] for t in texts]
        padded = pad_sequence(rows, batch_first=True)
        sizes = torch.tensor([len(r) for r in rows], device=padded.device)
        real = torch.arange(padded.shape[1], device=padded.device)[None, :] < sizes[:, None]
        return padded, real

    def _keep(self, fresh: dict[str, torch.Tensor]) -> None:
        with self._lock:
            self.computed += len(fresh)
            for t, s in fresh.items():
                if s.nbytes > self.budget or t in self._kept:
                    continue
                # on the CPU as numpy arrays, which Python's collector does not track (a
                # tensor it does: 10,000 more objects for each full collection to walk)
                self._kept[t] = s.numpy() if s.device.type == "cpu" else s
                self._bytes += s.nbytes
            while self._bytes > self.budget and self._kept:
                _, old = self._kept.popitem(last=False)
                self._bytes -= old.nbytes
