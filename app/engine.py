"""One inference engine for every model call: admission, deadlines, batching, workers.

Requests become tickets on one bounded queue. Worker threads (`DUET_WORKERS`) take the
tickets waiting, an even share with the other idle workers and at most `max_batch`, and
hand them to the pipeline's batch function in one call; a worker never sleeps waiting for a
batch to fill, so a lone request starts at once and batches form by themselves while the
worker is busy. One hop from the event loop to a worker and one back per batch.

Admission is decided on the event loop before any model work, from a cost model the workers
keep measuring (`Throughput`): a ticket is refused with 429 and a `Retry-After` when the
work ahead of it plus its own could not finish within the deadline
(`DUET_REQUEST_TIMEOUT_MS`) or the queue holds `max_queue` tickets already; with nothing
ahead it is always taken. A ticket whose caller went away (its future cancelled) or whose
deadline passed while queued is dropped before any compute. Whatever the batch function
leaves unresolved, by returning or raising, fails with an error: no caller ever hangs.

Sized from measurements (2-core CPU, 50 candidates, `benchmarks/serve_load.py`): the
cross-encoder alone scores most pairs/s with one worker using both cores, but a served
request also runs Python (HTTP, look-ups, FAISS) that holds one core while the other idles.
At 32 clients one worker with two torch threads served 24-27 req/s with the CPU 20-24 %
idle; one worker per core served 30-41 req/s with it 7-12 % idle. So the default is a
worker per core, and a worker sets torch's threads before each batch to the cores shared
among the workers busy at that moment (`app.batch.BatchWorker.threads_for`): a lone request still
uses every core, which keeps the one-client latency of the single-worker design.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Generic, TypeVar

from app.errors import DeadlineExceeded, DuetError, Overloaded, ShuttingDown

log = logging.getLogger("duet.engine")

P = TypeVar("P")
R = TypeVar("R")


def available_cores() -> int:
    """CPU cores this process may use: its affinity mask, capped by a cgroup CPU quota."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cores = cores or 1
    try:  # cgroup v2: "max 100000" or "200000 100000"
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            cores = min(cores, max(1, math.floor(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return cores


class Throughput:
    """Exponentially weighted seconds per unit of each kind of work (a query, a pair)."""

    def __init__(self, seconds_per: dict[str, float], alpha: float = 0.2) -> None:
        self._per = dict(seconds_per)
        self._alpha = alpha
        self._lock = threading.Lock()

    def observe(self, kind: str, units: int, seconds: float) -> None:
        if units <= 0 or seconds <= 0:
            return
        with self._lock:
            old = self._per.get(kind, seconds / units)
            self._per[kind] = (1 - self._alpha) * old + self._alpha * seconds / units

    def seconds(self, kind: str, units: float = 1.0) -> float:
        """Estimated seconds for `units` of `kind`; a kind not yet seen costs what its
        family does ("pair/late" -> "pair") until it is measured."""
        return self._per.get(kind, self._per.get(kind.split("/")[0], 0.0)) * units

    def per_second(self, kind: str) -> float:
        per = self.seconds(kind)
        return math.inf if per <= 0 else 1.0 / per


@dataclass(eq=False)
class Ticket(Generic[P, R]):
    """One request's model work: its payload, deadline and the future its caller awaits."""

    payload: P
    cost_s: float  # estimated seconds of worker time
    deadline: float  # time.monotonic() by which the answer is useless
    future: asyncio.Future[R]
    loop: asyncio.AbstractEventLoop
    enqueued: float = field(default_factory=time.monotonic)
    answered: bool = False  # resolve() or fail() was called (the future settles on the loop)
    # called once, from the worker, when the ticket is answered (the engine stops counting
    # its cost as work ahead of new requests)
    on_answer: Callable[[Ticket[P, R]], None] | None = None

    @property
    def alive(self) -> bool:
        """The caller still waits for this ticket (not cancelled, not yet answered)."""
        return not self.answered and not self.future.done()

    def remaining(self, now: float | None = None) -> float:
        return self.deadline - (time.monotonic() if now is None else now)

    def resolve(self, result: R) -> None:
        self._answered()
        self.loop.call_soon_threadsafe(_settle, self.future, result, None)

    def fail(self, exc: BaseException) -> None:
        self._answered()
        self.loop.call_soon_threadsafe(_settle, self.future, None, exc)

    def _answered(self) -> None:
        if not self.answered:
            self.answered = True
            if self.on_answer is not None:
                self.on_answer(self)


def _settle(fut: asyncio.Future[R], result: R | None, exc: BaseException | None) -> None:
    if fut.done():  # cancelled by a caller that went away, or answered already
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)  # type: ignore[arg-type]


BatchFn = Callable[[Sequence[Ticket[P, R]]], None]


class Engine(Generic[P, R]):
    """A bounded queue in front of worker threads that run `fn` on batches of tickets.

    `fn` resolves each ticket (`ticket.resolve` / `ticket.fail`) as soon as its answer is
    ready; the engine fails any it leaves unresolved.
    """

    def __init__(
        self,
        fn: BatchFn[P, R],
        *,
        workers: int,
        max_batch: int,
        max_queue: int,
        timeout_s: float,
        on_shed: Callable[[str], None] | None = None,
        on_batch: Callable[[int], None] | None = None,
        init_worker: Callable[[], None] | None = None,
        before_batch: Callable[[int], None] | None = None,
    ) -> None:
        self._fn = fn
        self.workers = workers
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.timeout_s = timeout_s
        self._on_shed = on_shed or (lambda _: None)
        self._on_batch = on_batch or (lambda _: None)
        self._init_worker = init_worker
        self._before_batch = before_batch or (lambda _: None)
        self._busy = 0  # workers running a batch
        self._queue: deque[Ticket[P, R]] = deque()
        self._queued_cost = 0.0
        self._running_cost = 0.0  # estimated seconds left in the batches being run
        self._cond = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._closed = True

    # -- event-loop side -------------------------------------------------------
    @property
    def depth(self) -> int:
        """Tickets waiting for a worker."""
        return len(self._queue)

    def wait_s(self) -> float:
        """Estimated seconds before a ticket queued now would start."""
        return (self._queued_cost + self._running_cost) / self.workers

    def retry_after(self, extra_s: float = 0.0) -> int:
        """Whole seconds until the queue ahead has drained (at least 1), for Retry-After."""
        return max(1, math.ceil(self.wait_s() + extra_s))

    async def submit(self, payload: P, cost_s: float, timeout_s: float | None = None) -> R:
        """Queue `payload` and wait for its result: 429 when it cannot be served within its
        deadline or the deadline passes in the queue, 503 when the engine stops."""
        if self._closed:
            raise ShuttingDown("the service is shutting down; retry on another replica")
        budget = self.timeout_s if timeout_s is None else timeout_s
        with self._cond:
            wait = self.wait_s()
            # with nothing ahead a request is always taken: if its own estimate does not
            # fit, it re-ranks what fits (degraded) rather than being turned away idle
            if len(self._queue) >= self.max_queue or (wait > 0 and wait + cost_s > budget):
                self._on_shed("queue_full")
                raise Overloaded(
                    f"the service is at capacity (about {wait:.1f}s of work queued, "
                    f"{len(self._queue)} requests); retry after the Retry-After seconds",
                    retry_after=self.retry_after(),
                )
            loop = asyncio.get_running_loop()
            ticket: Ticket[P, R] = Ticket(
                payload, cost_s, time.monotonic() + budget, loop.create_future(), loop
            )
            self._queue.append(ticket)
            self._queued_cost += cost_s
            self._cond.notify()
        return await ticket.future

    def start(self) -> None:
        self._closed = False
        for i in range(self.workers):
            t = threading.Thread(target=self._work, name=f"duet-engine-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Refuse new tickets, fail the queued ones (503), let running batches finish."""
        with self._cond:
            self._closed = True
            pending = list(self._queue)
            self._queue.clear()
            self._queued_cost = 0.0
            self._cond.notify_all()
        for t in pending:
            t.fail(ShuttingDown("the service is shutting down; retry on another replica"))
        for th in self._threads:
            th.join(timeout_s)
        self._threads.clear()

    # -- worker side -----------------------------------------------------------------
    def _take(self) -> tuple[list[Ticket[P, R]], float, int] | None:
        """The waiting tickets (up to max_batch), their estimated cost and the number of
        workers now busy (this one included), once any wait."""
        with self._cond:
            while not self._queue and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            # an even share with the idle workers, so one worker does not take everything
            # waiting while another sits idle
            share = math.ceil(len(self._queue) / max(1, self.workers - self._busy))
            batch: list[Ticket[P, R]] = []
            while self._queue and len(batch) < min(share, self.max_batch):
                t = self._queue.popleft()
                self._queued_cost -= t.cost_s
                batch.append(t)
            if not self._queue:
                self._queued_cost = 0.0  # no float drift accumulates
            else:
                self._cond.notify()  # the rest is another idle worker's share
            cost = sum(t.cost_s for t in batch)
            self._running_cost += cost
            for t in batch:
                t.on_answer = self._release
            self._busy += 1
            return batch, cost, self._busy

    def _release(self, ticket: Ticket[P, R]) -> None:
        """An answered ticket's estimated cost is no longer work ahead of new requests (a
        batch of many requests frees its share as each is answered, not all at its end)."""
        with self._cond:
            self._running_cost = max(0.0, self._running_cost - ticket.cost_s)

    def _work(self) -> None:
        if self._init_worker is not None:
            self._init_worker()
        while (taken := self._take()) is not None:
            batch, _, busy = taken
            try:
                try:
                    self._before_batch(busy)
                except Exception:  # a tuning hook never costs a request its answer
                    log.exception("before_batch hook failed")
                self._run(batch)
            finally:
                with self._cond:
                    for t in batch:  # dropped (caller gone) tickets were never answered
                        if t.on_answer is not None and not t.answered:
                            self._running_cost -= t.cost_s
                        t.on_answer = None
                    self._busy -= 1
                    # no float drift accumulates
                    self._running_cost = max(0.0, self._running_cost) if self._busy else 0.0

    def _run(self, batch: list[Ticket[P, R]]) -> None:
        now = time.monotonic()
        live = []
        for t in batch:
            if not t.alive:
                self._on_shed("client_gone")
            elif t.remaining(now) <= 0:
                self._on_shed("deadline")
                t.fail(
                    DeadlineExceeded(
                        f"the request waited past its deadline ({self.timeout_s:g}s, "
                        "DUET_REQUEST_TIMEOUT_MS) before a worker was free; retry later",
                        retry_after=self.retry_after(),
                    )
                )
            else:
                live.append(t)
        if not live:
            return
        self._on_batch(len(live))
        try:
            self._fn(live)
            err: BaseException = RuntimeError("the batch function left this request unanswered")
        except DuetError as exc:
            err = exc
        except Exception as exc:  # every caller gets the error, none hangs
            log.exception("batch of %d requests failed", len(live))
            err = exc
        for t in live:
            if t.alive:
                t.fail(err)
