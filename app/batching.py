"""Micro-batching across concurrent requests.

Requests put work on an asyncio queue; one loop takes the first waiting item,
gathers more until `max_batch` units or `max_wait` seconds, runs one batched
call in a worker thread, and resolves every waiter with its result or with
the error — no request is ever left hanging.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from app.errors import Overloaded

log = logging.getLogger("duet.batching")

T = TypeVar("T")
R = TypeVar("R")


class BatcherClosed(RuntimeError):
    """The batcher stopped before this item was processed."""


@dataclass
class _Pending(Generic[T, R]):
    item: T
    size: int
    future: asyncio.Future[R]


class MicroBatcher(Generic[T, R]):
    """Batches items of many callers into calls of `fn(items) -> results` (same order)."""

    def __init__(self, fn: Callable[[list[T]], Sequence[R]], *, max_batch: int, max_wait_s: float,
                 size_of: Callable[[T], int] = lambda _: 1, max_queue: int = 1024,
                 on_batch: Callable[[int], None] | None = None) -> None:
        self._fn = fn
        self._size_of = size_of
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        self._max_queue = max_queue
        self._on_batch = on_batch
        self._queue: asyncio.Queue[_Pending[T, R]] | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def depth(self) -> int:
        """Items waiting to be batched (not counting the batch being run)."""
        return 0 if self._queue is None else self._queue.qsize()

    @property
    def max_queue(self) -> int:
        return self._max_queue

    async def start(self) -> None:
        self._queue = asyncio.Queue()
        self._task = asyncio.create_task(self._run(), name="micro-batcher")

    async def stop(self) -> None:
        """Stop the loop; anything still queued fails with BatcherClosed."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._queue is not None:
            while not self._queue.empty():
                p = self._queue.get_nowait()
                if not p.future.done():
                    p.future.set_exception(BatcherClosed("service is shutting down"))

    async def submit(self, item: T) -> R:
        """Queue one item and wait for its result (or its batch's error)."""
        if self._queue is None or self._task is None or self._task.done():
            raise BatcherClosed("batcher is not running")
        if self._queue.qsize() >= self._max_queue:
            raise Overloaded("re-ranker queue is full; retry shortly or lower the request rate")
        fut: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait(_Pending(item, self._size_of(item), fut))
        return await fut

    async def _gather(self) -> list[_Pending[T, R]]:
        assert self._queue is not None
        first = await self._queue.get()
        batch, total = [first], first.size
        deadline = time.monotonic() + self.max_wait_s
        while total < self.max_batch:
            remaining = deadline - time.monotonic()
            if remaining <= 0 and self._queue.empty():
                break
            try:
                nxt = self._queue.get_nowait() if remaining <= 0 else await asyncio.wait_for(
                    self._queue.get(), remaining)
            except (TimeoutError, asyncio.QueueEmpty):
                break
            batch.append(nxt)
            total += nxt.size
        return batch

    async def _run(self) -> None:
        while True:
            batch = await self._gather()
            live = [p for p in batch if not p.future.done()]  # drop callers that went away
            if not live:
                continue
            try:
                results = await asyncio.to_thread(self._fn, [p.item for p in live])
                if len(results) != len(live):
                    raise RuntimeError(f"batch function returned {len(results)} results "
                                       f"for {len(live)} items")
            except asyncio.CancelledError:
                for p in live:
                    if not p.future.done():
                        p.future.set_exception(BatcherClosed("service is shutting down"))
                raise
            except Exception as exc:  # every waiter gets the error, none hangs
                log.exception("batch of %d failed", len(live))
                for p in live:
                    if not p.future.done():
                        p.future.set_exception(exc)
                continue
            if self._on_batch is not None:
                self._on_batch(sum(p.size for p in live))
            for p, r in zip(live, results, strict=True):
                if not p.future.done():
                    p.future.set_result(r)
