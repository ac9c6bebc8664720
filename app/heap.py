"""The start-up heap kept out of the garbage collector's way.

A serving process holds ~240,000 objects the collector tracks once it has started (torch,
FastAPI, the models' modules, the index), nearly all of them alive for its whole life. CPython's
full (generation 2) collection walks every one: 87 ms a pass on the 2-core CPU, for a
process that answers in a few milliseconds, so a request that arrives then waits that long
(and with the fronts, each process pauses on its own schedule). `gc.freeze()` at the end of
start-up moves them to a permanent generation the collector skips: the same pass then takes
well under a millisecond. Objects made later (requests, a swapped-in index) are collected as
before. DUET_GC_FREEZE=0 leaves the collector as it is. At shutdown the heap is thawed
(`thaw_heap`): an app served in a process that goes on (the tests, an embedding program)
would otherwise keep its pipeline and index, which sit in reference cycles, for good.
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger("duet")


def freeze_startup_heap(enabled: bool = True) -> int:
    """Collect the start-up garbage, then freeze what is left; the objects frozen (0 when
    `enabled` is false)."""
    if not enabled:
        return 0
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info(
        "start-up heap frozen: %d objects out of the collector's passes (%.0f ms)",
        frozen,
        (time.perf_counter() - t0) * 1000,
    )
    return frozen


def thaw_heap(frozen: int) -> None:
    """Give what `freeze_startup_heap` froze (`frozen` objects, 0 for none) back to the
    collector."""
    if frozen:
        gc.unfreeze()
