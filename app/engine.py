"""One inference engine for every model call: admission, deadlines, batching, workers.

Requests become tickets on one bounded queue. Worker threads (`DUET_WORKERS`) take the
tickets waiting, an even share with the other idle workers and at most `max_batch`, and
hand them to the pipeline's batch function in one call; a worker never sleeps waiting for a
batch to fill, so a lone request starts at once and batches form by themselves while the
worker is busy. One hop from the event loop to a worker and one back per batch.

Admission is decided on the event loop before any model work, from a cost model the workers
keep measuring (`app.costs`): a ticket is refused with 429 and a `Retry-After` when the
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
from app.settle import settler
from app.threadname import name_os_thread

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


# a ticket's answer for a caller on no event loop: (result, None) or (None, the error)
Done = Callable[[R | None, BaseException | None], None]


@dataclass(eq=False)
class Ticket(Generic[P, R]):
    """One request's model work: its payload, deadline and the future its caller awaits."""

    payload: P
    cost_s: float  # estimated seconds of worker time
    deadline: float  # time.monotonic() by which the answer is useless
    # where the answer goes: a future settled on its event loop, or `done` called at once
    # on the thread that answers (a caller on no event loop, `Engine.enqueue`)
    future: asyncio.Future[R] | None
    loop: asyncio.AbstractEventLoop | None
    done: Done[R] | None = None
    enqueued: float = field(default_factory=time.monotonic)
    units: int = 0  # work units (re-ranked pairs) the batch budget counts
    answered: bool = False  # resolve() or fail() was called (the future settles on the loop)
    # called once, from the worker, when the ticket is answered (the engine stops counting
    # its cost as work ahead of new requests)
    on_answer: Callable[[Ticket[P, R]], None] | None = None

    @property
    def alive(self) -> bool:
        """The caller still waits for this ticket (not cancelled, not yet answered)."""
        return not self.answered and (self.future is None or not self.future.done())

    def remaining(self, now: float | None = None) -> float:
        return self.deadline - (time.monotonic() if now is None else now)

    def resolve(self, result: R) -> None:
        self._settle(result, None)

    def fail(self, exc: BaseException) -> None:
        self._settle(None, exc)

    def _settle(self, result: R | None, exc: BaseException | None) -> None:
        if self.answered:  # the first answer counts
            return
        self.answered = True
        if self.on_answer is not None:
            self.on_answer(self)
        if self.done is not None:
            try:
                self.done(result, exc)
            except Exception:  # the caller's own failure costs no other ticket its answer
                log.exception("a ticket's done callback failed")
        else:
            assert self.future is not None and self.loop is not None
            settler(self.loop).add(self.future, result, exc)


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
        units: Callable[[P], int] | None = None,
        max_units: int | None = None,
        batch_cost_s: Callable[[], float] | None = None,
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
        # batches are cut by work units (re-ranked pairs) as well as by count: a batch takes
        # tickets while their units fit `max_units` (a lone ticket always fits)
        self._units = units or (lambda _: 0)
        self.max_units = max_units
        # the fixed seconds each batch costs whatever its size (launches, copies, the text
        # tower's minimum): admission adds one per batch the queued units will need
        self._batch_cost_s = batch_cost_s or (lambda: 0.0)
        self._queued_units = 0
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
        """Estimated seconds before a ticket queued now would start: the work queued and
        running (each ticket's own cost) plus a fixed cost per batch the queue will take."""
        batches = 0
        if self._queue:
            per = self.max_units or 0
            batches = max(
                math.ceil(len(self._queue) / self.max_batch),
                math.ceil(self._queued_units / per) if per else 0,
            )
        fixed = batches * self._batch_cost_s()
        return (self._queued_cost + self._running_cost + fixed) / self.workers

    def retry_after(self, extra_s: float = 0.0) -> int:
        """Whole seconds until the queue ahead has drained (at least 1), for Retry-After."""
        return max(1, math.ceil(self.wait_s() + extra_s))

    async def submit(self, payload: P, cost_s: float, timeout_s: float | None = None) -> R:
        """Queue `payload` and wait for its result: 429 when it cannot be served within its
        deadline or the deadline passes in the queue, 503 when the engine stops."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[R] = loop.create_future()
        self._admit(payload, cost_s, timeout_s, future, loop, None)
        return await future

    def enqueue(
        self, payload: P, cost_s: float, done: Done[R], timeout_s: float | None = None
    ) -> None:
        """`submit` for a caller on no event loop (the process layout's owner, `app.owner`):
        raises as `submit` does when the ticket is refused; else `done(result, error)` is
        called once, on the thread that answers it (a worker's, or the one that stops the
        engine), with no event loop between the worker and the caller."""
        self._admit(payload, cost_s, timeout_s, None, None, done)

    def _admit(
        self,
        payload: P,
        cost_s: float,
        timeout_s: float | None,
        future: asyncio.Future[R] | None,
        loop: asyncio.AbstractEventLoop | None,
        done: Done[R] | None,
    ) -> None:
        budget = self.timeout_s if timeout_s is None else timeout_s
        with self._cond:  # `stop` may run on another thread: checked under its lock
            if self._closed:
                raise ShuttingDown()
            wait = self.wait_s()
            # with nothing ahead a request is always taken: if its own estimate does not
            # fit, it re-ranks what fits (degraded) rather than being turned away idle
            full = len(self._queue) >= self.max_queue
            if full or (wait > 0 and wait + cost_s > budget):
                # the count cap (DUET_MAX_QUEUE), or work ahead past this request's deadline
                self._on_shed("queue_full" if full else "queue_wait")
                raise Overloaded(
                    f"the service is at capacity (about {wait:.1f}s of work ahead: "
                    f"{len(self._queue)} requests waiting, and those being served); retry "
                    "after the Retry-After seconds",
                    retry_after=self.retry_after(),
                )
            ticket: Ticket[P, R] = Ticket(
                payload, cost_s, time.monotonic() + budget, future, loop, done
            )
            ticket.units = self._units(payload)
            self._queue.append(ticket)
            self._queued_cost += cost_s
            self._queued_units += ticket.units
            self._cond.notify()

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
            self._queued_units = 0
            self._cond.notify_all()
        for t in pending:
            t.fail(ShuttingDown())
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
            units = 0
            while self._queue and len(batch) < min(share, self.max_batch):
                nxt = self._queue[0].units
                if batch and self.max_units is not None and units + nxt > self.max_units:
                    break
                t = self._queue.popleft()
                self._queued_cost -= t.cost_s
                self._queued_units -= t.units
                units += t.units
                batch.append(t)
            if not self._queue:
                self._queued_cost = 0.0  # no float drift accumulates
                self._queued_units = 0
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
        name_os_thread()  # its cores tell apart from the event loop's (`top -H`, serve_load)
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
