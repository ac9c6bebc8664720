"""Answers from the engine's workers reach the event loop together (`app.settle.Settler`):
a real engine, its worker thread and the loop's own wake-ups counted."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any

from app.engine import Engine, Ticket

Tickets = Sequence[Ticket[int, int]]


def _engine(fn: object) -> Engine[int, int]:
    return Engine(fn, workers=1, max_batch=64, max_queue=100, timeout_s=10.0)  # type: ignore[arg-type]


async def test_a_batch_of_answers_wakes_the_event_loop_once() -> None:
    loop = asyncio.get_running_loop()
    wakes: list[object] = []
    real = loop.call_soon_threadsafe

    def counted(cb: Any, *args: Any, **kw: Any) -> Any:
        wakes.append(cb)
        return real(cb, *args, **kw)

    loop.call_soon_threadsafe = counted  # type: ignore[method-assign,assignment]
    try:

        def fn(tickets: Tickets) -> None:
            for t in tickets:
                t.resolve(t.payload * 10) if t.payload % 2 else t.fail(ValueError(t.payload))

        gate = threading.Event()

        def held(tickets: Tickets) -> None:
            gate.wait(5)
            fn(tickets)

        eng = _engine(held)
        eng.start()
        futs = [asyncio.ensure_future(eng.submit(i, 0.001)) for i in range(1, 41)]
        await asyncio.sleep(0.05)
        wakes.clear()  # the submissions' own notifications
        gate.set()
        got = await asyncio.wait_for(asyncio.gather(*futs, return_exceptions=True), 5)
        eng.stop()
    finally:
        del loop.call_soon_threadsafe
    for i, r in zip(range(1, 41), got, strict=True):  # each caller its own answer or error
        assert r == i * 10 if i % 2 else (isinstance(r, ValueError) and r.args == (i,))
    # 40 answers from at most two batches (the first may have run alone): at most one wake-up
    # each, where each answer used to make its own
    assert 1 <= len(wakes) <= 2, wakes
