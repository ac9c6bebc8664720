"""torch's thread count around the engine's model calls."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

# A few short sentences encode faster on one torch thread than on several: measured on the
# 2-core CPU, one query took 0.95 ms on 1 thread and 3.4 ms on 2 (OpenMP's hand-off costs more
# than the work); the cross-encoder's pairs still get every thread the worker has.
SOLO_TEXTS = 16


@contextmanager
def solo_threads(solo: bool) -> Iterator[None]:
    """Run the block on one torch thread when `solo`, then restore the worker's count."""
    n = torch.get_num_threads()
    if not solo or n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)
