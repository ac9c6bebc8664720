"""The inference engine: batches form under load, admission refuses with Retry-After, stale and
abandoned work is dropped before compute, failures reach every caller, nothing hangs; and the
pipeline on top of it degrades re-ranking to fit a deadline instead of failing."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
import pytest

from app.batch import BatchWorker
from app.config import Settings
from app.costs import Throughput
from app.engine import Engine, Ticket, available_cores
from app.errors import DeadlineExceeded, Overloaded, ShuttingDown
from app.main import create_app
from app.pipeline import SearchPipeline
from tests.conftest import start_service, stop_service

Tickets = Sequence[Ticket[int, int]]


def _engine(fn: object, **kw: object) -> Engine[int, int]:
    opts: dict[str, object] = {
        "workers": 1,
        "max_batch": 64,
        "max_queue": 100,
        "timeout_s": 10.0,
        **kw,
    }
    return Engine(fn, **opts)  # type: ignore[arg-type]


async def test_waiting_requests_share_a_batch_and_get_their_own_answers() -> None:
    gate = threading.Event()
    batches: list[list[int]] = []

    def fn(tickets: Tickets) -> None:
        gate.wait(5)  # hold the first batch so the rest queue behind it
        batches.append([t.payload for t in tickets])
        for t in tickets:
            t.resolve(t.payload * 10)

    eng = _engine(fn)
    eng.start()
    first = asyncio.ensure_future(eng.submit(0, 0.001))
    await asyncio.sleep(0.05)
    rest = [asyncio.ensure_future(eng.submit(i, 0.001)) for i in range(1, 9)]
    await asyncio.sleep(0.05)
    gate.set()
    assert await asyncio.wait_for(asyncio.gather(first, *rest), 5) == [i * 10 for i in range(9)]
    assert batches == [[0], list(range(1, 9))]  # no timer: the lone first ran at once
    eng.stop()


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="names are read from /proc")
async def test_the_workers_are_named_where_the_os_shows_threads() -> None:
    """`top -H` and the benchmark's per-thread cores (serve_load) tell the engine's worker
    from the event loop by the name the OS keeps for it, not Python's alone."""
    seen: list[str] = []

    def fn(tickets: Tickets) -> None:
        tid = threading.get_native_id()
        seen.append(Path(f"/proc/self/task/{tid}/comm").read_text().strip())
        for t in tickets:
            t.resolve(t.payload)

    eng = _engine(fn, workers=2)
    eng.start()
    assert await asyncio.wait_for(eng.submit(1, 0.001), 5) == 1
    eng.stop()
    assert seen and seen[0] in ("duet-engine-0", "duet-engine-1"), seen


async def test_a_failing_batch_fails_every_caller_and_unanswered_ones_too() -> None:
    def boom(tickets: Tickets) -> None:
        raise MemoryError("simulated")

    def forgets(tickets: Tickets) -> None:
        tickets[0].resolve(1)  # the other is left unanswered

    for fn, errors in ((boom, (MemoryError, MemoryError)), (forgets, (None, RuntimeError))):
        eng = _engine(fn)
        eng.start()
        got = await asyncio.wait_for(
            asyncio.gather(eng.submit(1, 0.0), eng.submit(2, 0.0), return_exceptions=True), 5
        )
        for g, err in zip(got, errors, strict=True):
            assert (g == 1) if err is None else isinstance(g, err), got
        eng.stop()


async def test_admission_refuses_work_that_cannot_meet_its_deadline_with_retry_after() -> None:
    gate = threading.Event()
    shed: list[str] = []

    def fn(tickets: Tickets) -> None:
        gate.wait(5)
        for t in tickets:
            t.resolve(0)

    eng = _engine(fn, timeout_s=1.0, max_queue=3, on_shed=shed.append)
    eng.start()
    busy = [asyncio.ensure_future(eng.submit(i, 0.4)) for i in range(2)]
    await asyncio.sleep(0.05)
    # 0.8 s queued or running + 0.4 s of its own > the 1 s deadline
    with pytest.raises(Overloaded) as refused:
        await eng.submit(9, 0.4)
    assert refused.value.retry_after == 1 and refused.value.status == 429
    assert refused.value.response_headers() == {"Retry-After": "1"}
    cheap = [asyncio.ensure_future(eng.submit(i, 0.0)) for i in range(3)]
    await asyncio.sleep(0.05)
    with pytest.raises(Overloaded):  # the count cap holds even for free work
        await eng.submit(99, 0.0)
    gate.set()
    await asyncio.wait_for(asyncio.gather(*busy, *cheap), 5)
    assert shed == ["queue_wait", "queue_full"]
    eng.stop()


async def test_expired_and_abandoned_tickets_are_dropped_before_compute() -> None:
    gate = threading.Event()
    seen: list[int] = []
    shed: list[str] = []

    def fn(tickets: Tickets) -> None:
        gate.wait(5)
        seen.extend(t.payload for t in tickets)
        for t in tickets:
            t.resolve(t.payload)

    eng = _engine(fn, timeout_s=0.3, on_shed=shed.append)
    eng.start()
    blocker = asyncio.ensure_future(eng.submit(0, 0.0))
    await _taken(eng)  # the worker holds the blocker at the gate (however loaded the machine)
    expired = asyncio.ensure_future(eng.submit(1, 0.0))
    abandoned = asyncio.ensure_future(eng.submit(2, 0.0))
    await asyncio.sleep(0.01)
    abandoned.cancel()  # the client went away
    await asyncio.sleep(0.4)  # past the deadline of the ones queued behind the blocker
    gate.set()
    assert await asyncio.wait_for(blocker, 5) == 0
    with pytest.raises(DeadlineExceeded) as late:
        await asyncio.wait_for(expired, 5)
    assert late.value.status == 429 and late.value.retry_after is not None
    assert seen == [0]  # neither reached the model
    for _ in range(500):  # the worker may record the second drop after the first one's answer
        if len(shed) >= 2:
            break
        await asyncio.sleep(0.01)
    assert sorted(shed) == ["client_gone", "deadline"]
    eng.stop()


async def test_stop_fails_what_is_queued_with_503_and_refuses_new_work() -> None:
    gate = threading.Event()

    def fn(tickets: Tickets) -> None:
        gate.wait(5)
        for t in tickets:
            t.resolve(0)

    eng = _engine(fn)
    eng.start()
    running = asyncio.ensure_future(eng.submit(0, 0.0))
    await _taken(eng)
    queued = asyncio.ensure_future(eng.submit(1, 0.0))
    await asyncio.sleep(0.01)
    stopper = asyncio.ensure_future(asyncio.to_thread(eng.stop))
    await asyncio.sleep(0.05)
    gate.set()
    await stopper
    assert await running == 0  # a running batch finishes
    with pytest.raises(ShuttingDown):
        await queued
    with pytest.raises(ShuttingDown):
        await eng.submit(2, 0.0)


def test_throughput_and_cores() -> None:
    tp = Throughput({"pair": 0.01}, alpha=0.5)
    tp.observe("pair", 10, 0.2)  # 0.02 s a pair
    assert tp.seconds("pair", 2) == pytest.approx(0.03)
    assert tp.per_second("pair") == pytest.approx(1 / 0.015)
    assert tp.seconds("pair/late") == tp.seconds("pair")  # unmeasured: its family's cost
    tp.observe("pair/late", 10, 0.01)
    assert tp.seconds("pair/late") == pytest.approx(0.001) and tp.seconds("pair") > 0.01
    assert 1 <= available_cores() <= (len(__import__("os").sched_getaffinity(0)))


async def test_a_deadline_too_short_for_every_candidate_re_ranks_fewer(index_dir: Path) -> None:
    """Admission lets the request in (its estimate fits), the worker finds less time left
    than the estimate assumed and re-ranks what fits: degraded, never an error."""
    app = create_app(Settings(index_dir=index_dir, request_timeout_ms=1000, index_poll_s=0))
    async with app.router.lifespan_context(app):
        pipeline: SearchPipeline = app.state.pipeline
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://duet") as client:
            # estimates that exactly fill the deadline: whatever the encode stage takes is
            # then missing from the re-rank budget
            pipeline.worker.throughput = Throughput({"query": 0.0, "pair": 0.999 / 30})
            r = await client.post(
                "/search/text",
                json={"query": "a red circle above a square", "top_k": 5, "candidates": 30},
            )
            body = r.json()
            again = await client.post(
                "/search/text",
                json={"query": "a red circle above a square", "top_k": 5, "candidates": 30},
            )
        degraded = app.state.metrics.degraded._value.get()
    assert r.status_code == 200, r.text
    assert body["degraded"] is True and 0 < body["reranked"] < 30
    assert len(body["hits"]) == 5 and [h["rank"] for h in body["hits"]] == [1, 2, 3, 4, 5]
    assert degraded >= 1
    # a degraded answer is not cached: the next request computes afresh
    assert again.json()["cached"] is False


async def test_full_answers_say_how_many_were_re_ranked(index_dir: Path) -> None:
    app = create_app(Settings(index_dir=index_dir, index_poll_s=0))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://duet") as client:
            full = (
                await client.post("/search/text", json={"query": "a blue square", "candidates": 20})
            ).json()
            dot = (
                await client.post("/search/text", json={"query": "a blue square", "rerank": False})
            ).json()
            cached = (
                await client.post("/search/text", json={"query": "a blue square", "candidates": 20})
            ).json()
            odd = [
                (await client.post("/search/text", json={"query": "a red dog on a beach"})).json()
                for _ in range(2)
            ]
    assert (full["degraded"], full["reranked"]) == (False, 20)
    assert (dot["degraded"], dot["reranked"]) == (False, None)
    assert cached["cached"] and cached["reranked"] == 20
    assert set(full["timings_ms"]) >= {"queue", "encode", "search", "rerank", "lookup", "total"}
    assert full["unknown_words"] == []
    # words the model never saw are named, the first time and from the cache alike
    assert [o["cached"] for o in odd] == [False, True]
    assert all(o["unknown_words"] == ["dog", "beach"] for o in odd), odd


@pytest.mark.slow
def test_overload_over_real_sockets_sheds_with_retry_after(index_dir: Path, tmp_path: Path) -> None:
    """Far more concurrent clients than the deadline allows: some are refused with 429 and a
    Retry-After, none gets a 5xx, the admitted ones answer within the deadline's reach, and
    /healthz answers throughout."""
    svc = start_service(
        index_dir, tmp_path / "serve.log", DUET_REQUEST_TIMEOUT_MS="300", DUET_INDEX_POLL_S="0"
    )

    async def load() -> tuple[list[httpx.Response], list[float], list[int]]:
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(base_url=svc.url, timeout=30, limits=limits) as client:
            health: list[int] = []
            stop = asyncio.Event()

            async def probe() -> None:
                while not stop.is_set():
                    health.append((await client.get("/healthz")).status_code)
                    await asyncio.sleep(0.05)

            async def one(i: int) -> tuple[httpx.Response, float]:
                t0 = time.perf_counter()
                r = await client.post(
                    "/search/text",
                    json={"query": f"a red circle left of a blue square {i}", "candidates": 200},
                )
                return r, time.perf_counter() - t0

            prober = asyncio.ensure_future(probe())
            done = await asyncio.gather(*(one(i) for i in range(150)))
            stop.set()
            await prober
            return [r for r, _ in done], [dt for r, dt in done if r.status_code == 200], health

    try:
        rs, admitted, health = asyncio.run(load())
    finally:
        stop_service(svc)
    codes = [r.status_code for r in rs]
    assert not [c for c in codes if c >= 500], codes
    refused = [r for r in rs if r.status_code == 429]
    assert refused and len(refused) < len(rs), codes
    assert all(int(r.headers["retry-after"]) >= 1 for r in refused)
    assert all(r.json()["error"]["code"] == "overloaded" for r in refused)
    assert max(admitted) < 3.0
    assert health and set(health) == {200}


async def test_an_idle_engine_takes_a_request_even_when_its_estimate_exceeds_the_deadline() -> None:
    def fn(tickets: Tickets) -> None:
        for t in tickets:
            t.resolve(t.payload)

    eng = _engine(fn, timeout_s=0.1)
    eng.start()
    assert await asyncio.wait_for(eng.submit(7, 5.0), 5) == 7  # nothing ahead: taken
    eng.stop()


async def test_idle_workers_share_the_queue_and_know_how_many_are_busy() -> None:
    """Two idle workers, eight requests waiting: each takes an even share (not one worker all
    eight), and each batch is told how many workers are busy (what sizes torch's threads)."""
    both = threading.Barrier(2, timeout=5)  # each batch waits until both workers run one
    busy_seen: list[int] = []
    batches: list[int] = []

    def fn(tickets: Tickets) -> None:
        batches.append(len(tickets))
        both.wait()
        for t in tickets:
            t.resolve(t.payload)

    eng = _engine(fn, workers=2, before_batch=busy_seen.append)
    eng._closed = False  # take tickets before the workers start, so all eight wait together
    futs = [asyncio.ensure_future(eng.submit(i, 0.001)) for i in range(8)]
    await asyncio.sleep(0.05)
    assert eng.depth == 8
    eng.start()
    assert await asyncio.wait_for(asyncio.gather(*futs), 5) == list(range(8))
    eng.stop()
    assert batches == [4, 4]
    assert sorted(busy_seen) == [1, 2]


async def test_work_ahead_shrinks_as_each_request_of_a_batch_is_answered() -> None:
    """A batch frees its estimated cost request by request, so a request arriving while a
    long batch is half answered is not refused for work that is already done."""
    halfway = threading.Event()
    go_on = threading.Event()

    def fn(tickets: Tickets) -> None:
        tickets[0].resolve(tickets[0].payload)
        halfway.set()
        go_on.wait(5)
        for t in tickets[1:]:
            t.resolve(t.payload)

    eng = _engine(fn)
    eng._closed = False  # both requests wait before the worker starts: one batch of two
    pair = [asyncio.ensure_future(eng.submit(i, 1.0)) for i in range(2)]
    await asyncio.sleep(0.05)
    assert eng.wait_s() == pytest.approx(2.0)
    eng.start()
    assert await asyncio.to_thread(halfway.wait, 5)
    assert eng.wait_s() == pytest.approx(1.0)  # one of the two is answered: 1 s left, not 2
    go_on.set()
    assert await asyncio.wait_for(asyncio.gather(*pair), 5) == [0, 1]
    for _ in range(100):  # the worker clears its batch just after answering it
        if eng.wait_s() == 0.0:
            break
        await asyncio.sleep(0.01)
    assert eng.wait_s() == 0.0
    eng.stop()


def test_torch_threads_follow_the_busy_workers_per_thread() -> None:
    """A lone request uses every core; two busy workers one core each; a fixed
    DUET_TORCH_THREADS wins; the count is set in the worker's own thread only."""
    import torch

    pipe = BatchWorker.__new__(BatchWorker)
    pipe.cores, pipe.torch_threads = 4, None
    assert [pipe.threads_for(b) for b in (1, 2, 3, 4, 8)] == [4, 2, 1, 1, 1]
    pipe.torch_threads = 3
    assert pipe.threads_for(2) == 3
    pipe.cores, pipe.torch_threads = 2, None
    before = torch.get_num_threads()
    seen: list[int] = []

    def worker() -> None:
        pipe.set_threads(2)
        seen.append(torch.get_num_threads())

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == [1]
    assert torch.get_num_threads() == before


async def _taken(eng: Engine[int, int], timeout_s: float = 10.0) -> None:
    """Wait until a worker has taken everything queued (a fixed sleep flakes on a loaded
    machine)."""
    deadline = time.monotonic() + timeout_s
    await asyncio.sleep(0)
    while eng.depth and time.monotonic() < deadline:
        await asyncio.sleep(0.005)
    await asyncio.sleep(0.01)
