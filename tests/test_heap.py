"""The collector's load (`app.heap`): the start-up heap frozen, and the fronts' per-image
caption cache made of objects the collector stops tracking. The served processes' freezing
is checked in test_fronts.py (their logs)."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

from app.answers import _choices, best_caption
from app.config import Settings
from app.heap import freeze_startup_heap
from app.main import create_app


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


async def test_an_app_served_in_process_is_freed_after_its_shutdown(index_dir: Path) -> None:
    """The lifespan freezes the heap while it serves and thaws it at shutdown: frozen, the
    pipeline and index (held in reference cycles) would outlive the app for good."""
    app = create_app(Settings(index_dir=index_dir, index_poll_s=0))
    async with app.router.lifespan_context(app):
        assert gc.get_freeze_count() > 0
        pipeline = weakref.ref(app.state.pipeline)
    assert gc.get_freeze_count() == 0
    del app
    gc.collect()
    assert pipeline() is None
