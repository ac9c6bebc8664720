"""The micro-batcher: full batches, time-out flushes, errors reach every waiter, nothing hangs."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from app.batching import BatcherClosed, MicroBatcher
from app.errors import Overloaded


class Recorder:
    """A batch function that records the batches it saw (doubles every item)."""

    def __init__(self, fail: bool = False, delay: float = 0.0) -> None:
        self.calls: list[list[int]] = []
        self.fail = fail
        self.delay = delay
        self.thread_ids: list[int] = []

    def __call__(self, items: list[int]) -> list[int]:
        self.calls.append(list(items))
        self.thread_ids.append(threading.get_ident())
        time.sleep(self.delay)
        if self.fail:
            raise ValueError("model exploded")
        return [2 * x for x in items]


async def test_full_batch_runs_without_waiting_for_the_timeout() -> None:
    fn = Recorder()
    b: MicroBatcher[int, int] = MicroBatcher(fn, max_batch=4, max_wait_s=5.0)
    await b.start()
    t0 = time.monotonic()
    results = await asyncio.gather(*(b.submit(i) for i in range(4)))
    elapsed = time.monotonic() - t0
    await b.stop()
    assert results == [0, 2, 4, 6]
    assert fn.calls == [[0, 1, 2, 3]]
    assert elapsed < 2.0  # did not sit out the 5 s wait
    assert fn.thread_ids[0] != threading.get_ident()  # ran off the event loop


async def test_partial_batch_is_flushed_after_max_wait() -> None:
    fn = Recorder()
    b: MicroBatcher[int, int] = MicroBatcher(fn, max_batch=100, max_wait_s=0.05)
    await b.start()
    t0 = time.monotonic()
    results = await asyncio.gather(b.submit(1), b.submit(2))
    elapsed = time.monotonic() - t0
    await b.stop()
    assert results == [2, 4]
    assert fn.calls == [[1, 2]]
    assert elapsed >= 0.045


async def test_sizes_count_towards_max_batch() -> None:
    sizes: list[int] = []
    fn = Recorder()
    b: MicroBatcher[int, int] = MicroBatcher(fn, max_batch=10, max_wait_s=1.0,
                                             size_of=lambda x: x, on_batch=sizes.append)
    await b.start()
    await asyncio.gather(*(b.submit(5) for _ in range(4)))
    await b.stop()
    assert fn.calls == [[5, 5], [5, 5]]
    assert sizes == [10, 10]


async def test_exception_reaches_every_waiter() -> None:
    fn = Recorder(fail=True)
    b: MicroBatcher[int, int] = MicroBatcher(fn, max_batch=3, max_wait_s=0.5)
    await b.start()
    results = await asyncio.wait_for(
        asyncio.gather(*(b.submit(i) for i in range(3)), return_exceptions=True), timeout=5)
    assert all(isinstance(r, ValueError) and "exploded" in str(r) for r in results)
    # the loop survives a failed batch
    fn.fail = False
    assert await asyncio.wait_for(b.submit(7), timeout=5) == 14
    await b.stop()


async def test_wrong_result_count_is_an_error_for_all() -> None:
    b: MicroBatcher[int, int] = MicroBatcher(lambda items: [1], max_batch=2, max_wait_s=0.5)
    await b.start()
    results = await asyncio.wait_for(
        asyncio.gather(b.submit(1), b.submit(2), return_exceptions=True), timeout=5)
    await b.stop()
    assert all(isinstance(r, RuntimeError) for r in results)


async def test_stop_fails_queued_items_instead_of_hanging() -> None:
    fn = Recorder(delay=0.3)
    b: MicroBatcher[int, int] = MicroBatcher(fn, max_batch=1, max_wait_s=0.0)
    await b.start()
    tasks = [asyncio.create_task(b.submit(i)) for i in range(3)]
    await asyncio.sleep(0.05)  # first item is running in the worker thread
    await b.stop()
    results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=5)
    assert all(isinstance(r, BatcherClosed) for r in results)
    with pytest.raises(BatcherClosed):
        await b.submit(1)


async def test_full_queue_is_overloaded() -> None:
    fn = Recorder(delay=0.3)
    b: MicroBatcher[int, int] = MicroBatcher(fn, max_batch=1, max_wait_s=0.0, max_queue=2)
    await b.start()
    running = asyncio.create_task(b.submit(0))
    await asyncio.sleep(0.05)  # taken off the queue, running in the worker thread
    queued = [asyncio.create_task(b.submit(i)) for i in (1, 2)]
    await asyncio.sleep(0)
    with pytest.raises(Overloaded):
        await b.submit(3)
    assert await asyncio.wait_for(asyncio.gather(running, *queued), timeout=5) == [0, 2, 4]
    await b.stop()
