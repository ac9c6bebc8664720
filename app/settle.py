"""Answers from the engine's worker threads to the event loop that waits for them, settled
together (`Settler`): one wake-up of the loop per run of answers, not one per answer."""

from __future__ import annotations

import asyncio
import threading
import weakref
from typing import Any


class Settler:
    """Answers from worker threads to one event loop, settled together: the first answer of a
    run wakes the loop, and the ones that arrive before it has run join that wake-up. A
    batch of 64 answers costs the loop one wake-up (a write to its self-pipe and a callback),
    not 64: in the process layout's owner, the per-answer wake-ups held the GIL 9 % of its
    busy time (py-spy --gil, dot-only at 32 clients, docs/serving.md)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[asyncio.Future[Any], Any, BaseException | None]] = []

    def add(self, fut: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
        with self._lock:
            self._items.append((fut, result, exc))
            first = len(self._items) == 1
        if first:
            try:
                self.loop.call_soon_threadsafe(self._drain)
            except RuntimeError:  # the loop is closed: nobody waits for these any more
                with self._lock:
                    self._items.clear()
                raise

    def _drain(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for fut, result, exc in items:
            _settle(fut, result, exc)


_settlers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Settler] = (
    weakref.WeakKeyDictionary()
)
_settlers_lock = threading.Lock()


def settler(loop: asyncio.AbstractEventLoop) -> Settler:
    with _settlers_lock:
        if (found := _settlers.get(loop)) is None:
            found = _settlers[loop] = Settler(loop)
        return found


def _settle(fut: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if fut.done():  # cancelled by a caller that went away, or answered already
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)
