"""The collector's load (`app.heap`): the start-up heap frozen, and the fronts' per-image
caption cache made of objects the collector stops tracking. The served processes' freezing
is checked in test_fronts.py (their logs)."""

from __future__ import annotations

import gc

from app.answers import _choices, best_caption
from app.heap import freeze_startup_heap


def test_freezing_moves_the_live_heap_out_of_the_collectors_passes() -> None:
    assert freeze_startup_heap(False) == 0
    before = gc.get_freeze_count()
    try:
        frozen = freeze_startup_heap(True)
        assert frozen == gc.get_freeze_count() > before
    finally:
        gc.unfreeze()  # the test process goes on collecting as before


def test_the_caption_cache_holds_nothing_the_collector_walks() -> None:
    captions = ("a small red circle left of a blue square", "two green crosses", "a star")
    entry = _choices(captions)
    for _ in range(3):  # a tuple is untracked in the pass after its contents were: one a level
        gc.collect()
    assert not gc.is_tracked(entry)
    assert not any(gc.is_tracked(choice) for choice in entry)
    # and the choice is still the caption sharing most words with the query
    assert best_caption("red circle and a blue square", captions) == captions[0]
    assert best_caption("a star", captions) == captions[2]
