"""benchmarks/serve_load.py's load generator: closed-loop and overload clients over a minimal
keep-alive HTTP client, and the figures they collect."""

from __future__ import annotations

import asyncio
import json
import random
import time

from benchmarks.cell import Cell
from duet.loadgen import Conn as Conn  # duet bench's client (the tests import it here)
from duet.loadgen import finish_message as finish_message
from models import world


class Queries:
    """Different captions (a held-out world seed, scenes drawn without rendering them), made
    before the load starts so the load generator spends its CPU on requests only."""

    path = "/search/text"

    def __init__(self, seed: int, n: int = 150_000) -> None:
        rng = random.Random(seed)
        seen: dict[str, None] = {}
        while len(seen) < n:
            for c in world.captions(rng, world.sample_scene(rng), 5):
                seen.setdefault(c, None)
        self._it = iter(list(seen))

    def next(self) -> str:
        return next(self._it)

    def body(self, rerank: bool, candidates: int) -> bytes:
        """The next request's JSON body, for `path`."""
        return json.dumps(
            {"query": self.next(), "top_k": 10, "candidates": candidates, "rerank": rerank}
        ).encode()


def queries_for(route: str, seed: int, n: int = 150_000) -> Queries:
    """The load's requests for `route`: "text" (captions) or "image" (uploads of rendered
    scenes, benchmarks/image_queries.py)."""
    if route == "image":
        from benchmarks.image_queries import ImageQueries

        return ImageQueries(seed)
    return Queries(seed, n)


async def closed_loop(
    url: str,
    clients: int,
    seconds: float,
    rerank: bool,
    candidates: int,
    queries: Queries,
    cell: Cell,
    warmup: float = 1.0,
) -> None:
    """`clients` loops each sending one request at a time for `seconds` (after `warmup`)."""
    t_start = time.perf_counter() + warmup
    t_end = t_start + seconds

    async def one() -> None:
        conn = Conn(url)
        while (now := time.perf_counter()) < t_end:
            body = queries.body(rerank, candidates)
            try:
                status, headers, data = await conn.request("POST", queries.path, body)
            except (ConnectionError, asyncio.IncompleteReadError):
                if now >= t_start:
                    cell.errors += 1
                continue
            done = time.perf_counter()
            if status == 429:  # in the warm-up too: it was retried at once there
                cell.refused += now >= t_start
                # a well-behaved client waits as told (at most 1 s here) before retrying
                await asyncio.sleep(min(1.0, float(headers.get("retry-after", "1"))))
            elif now < t_start:
                continue
            elif status != 200:
                cell.errors += 1
            elif b'"degraded":true' in data:
                cell.degraded += 1
            else:
                cell.latencies.append(done - now)
        conn.close()

    await asyncio.gather(*(one() for _ in range(clients)))
    cell.seconds += seconds


async def overload(
    url: str, clients: int, seconds: float, candidates: int, queries: Queries
) -> dict[str, object]:
    """Open many clients at once; count 429s (and their Retry-After), 5xx, admitted latency,
    and how fast /healthz answers meanwhile."""
    cell = Cell()
    health: list[float] = []
    retry_after: list[int] = []
    t_end = time.perf_counter() + seconds

    async def one() -> None:
        conn = Conn(url)
        while time.perf_counter() < t_end:
            t0 = time.perf_counter()
            body = queries.body(True, candidates)
            status, headers, data = await conn.request("POST", queries.path, body)
            if status == 429:
                cell.refused += 1
                retry_after.append(int(headers.get("retry-after", "0")))
                await asyncio.sleep(min(1.0, float(headers.get("retry-after", "1"))))
            elif status >= 500:
                cell.errors += 1
            elif b'"degraded":true' in data:
                cell.degraded += 1
            else:
                cell.latencies.append(time.perf_counter() - t0)
        conn.close()

    async def probe() -> None:
        conn = Conn(url)
        while time.perf_counter() < t_end:
            t0 = time.perf_counter()
            status, _, _ = await conn.request("GET", "/healthz")
            health.append(time.perf_counter() - t0 if status == 200 else float("inf"))
            await asyncio.sleep(0.25)
        conn.close()

    await asyncio.gather(probe(), *(one() for _ in range(clients)))
    cell.seconds = seconds
    return {
        "clients": clients,
        "answered": len(cell.latencies),
        "degraded": cell.degraded,
        "refused_429": cell.refused,
        "errors_5xx": cell.errors,
        "retry_after_present": bool(retry_after) and min(retry_after) >= 1,
        "admitted_p50_ms": round(cell.q(50), 1),
        "admitted_p99_ms": round(cell.q(99), 1),
        "healthz_max_ms": round(max(health) * 1000, 1) if health else None,
        "throughput": round(cell.throughput, 1),
    }


# -- the load spread over processes (one Python process tops out near the server's rate) ----
_QUERIES: Queries | None = None


def _init_worker(seed: int, n: int, route: str = "text") -> None:
    """Each load process draws its own queries (seed + its pid: no two share a cache key)."""
    import gc
    import os

    global _QUERIES
    _QUERIES = queries_for(route, seed + os.getpid() % 10_000 * 1_000, n)
    # its start-up heap (~27,000 objects, a 9 ms full pass) frozen as duet's is (app.heap,
    # a floor above the benchmarks, so not imported): a pause here would count as duet's
    # latency in the open loop, which times from when each request was due
    gc.collect()
    gc.freeze()


def _until(start_at: float) -> None:
    time.sleep(max(0.0, start_at - time.time()))


def _part(
    open_rate: float | None,
    url: str,
    clients: int,
    seconds: float,
    rerank: bool,
    candidates: int,
    start_at: float,
    phase: float = 0.0,
) -> Cell:
    """One load process's share from `start_at`: `clients` closed-loop clients, or requests
    offered at `open_rate` per second when that is given, from `phase` seconds later (the
    processes' sends interleaved, not in step)."""
    assert _QUERIES is not None
    cell = Cell()
    _until(start_at + phase)
    if open_rate is None:
        run = closed_loop(url, clients, seconds, rerank, candidates, _QUERIES, cell)
    else:
        run = open_loop(url, open_rate, seconds, rerank, candidates, _QUERIES, cell, phase=phase)
    cpu0 = time.process_time()
    asyncio.run(run)
    cell.add_cpu("load", time.process_time() - cpu0)
    return cell


class LoadPool:
    """Load-generating processes kept for a whole benchmark: `closed` and `open` split the
    clients (or the rate) among them, start them together and merge what they measured."""

    LEAD = 0.5  # seconds from a cell's call to its processes' start

    def __init__(
        self, procs: int, seed: int, queries_each: int = 60_000, route: str = "text"
    ) -> None:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        self.procs = procs
        self._pool = ProcessPoolExecutor(
            procs,
            mp_context=mp.get_context("spawn"),
            initializer=_init_worker,
            initargs=(seed, queries_each, route),
        )
        list(self._pool.map(time.sleep, [0.0] * procs))  # every process up before timing

    def closed(
        self, url: str, clients: int, seconds: float, rerank: bool, candidates: int, cell: Cell
    ) -> None:
        shares = [clients // self.procs + (i < clients % self.procs) for i in range(self.procs)]
        start = time.time() + 0.5
        futs = [
            self._pool.submit(_part, None, url, n, seconds, rerank, candidates, start)
            for n in shares
            if n
        ]
        _merge(cell, [f.result() for f in futs], seconds)

    def open(
        self, url: str, rate: float, seconds: float, rerank: bool, candidates: int, cell: Cell
    ) -> None:
        start = time.time() + self.LEAD
        share = rate / self.procs
        # process k sends k / rate after process 0: the whole stream evenly spaced, not the
        # processes' requests in bursts of `procs` at once
        futs = [
            self._pool.submit(_part, share, url, 0, seconds, rerank, candidates, start, k / rate)
            for k in range(self.procs)
        ]
        _merge(cell, [f.result() for f in futs], seconds)

    def close(self) -> None:
        self._pool.shutdown(cancel_futures=True)


def _merge(cell: Cell, parts: list[Cell], seconds: float) -> None:
    for p in parts:
        cell.latencies += p.latencies
        cell.due += p.due
        cell.degraded += p.degraded
        cell.refused += p.refused
        cell.errors += p.errors
        cell.late += p.late
        for who, sec in p.cpu.items():
            cell.add_cpu(who, sec)
    cell.seconds += seconds


async def open_loop(
    url: str,
    rate: float,
    seconds: float,
    rerank: bool,
    candidates: int,
    queries: Queries,
    cell: Cell,
    warmup: float = 1.0,
    max_conns: int = 512,
    grace: float = 2.0,
    phase: float = 0.0,
) -> None:
    """Requests at a fixed `rate` per second whatever the answers do (offered load), each on
    an idle keep-alive connection (a new one while none is idle, up to `max_conns`); latency
    counts from the moment it was due, so a client that falls behind adds to it (no
    coordinated omission). Requests due in the first `warmup` seconds are not counted; one
    that finds no connection left counts as an error; one still unanswered `grace` seconds
    after the last was sent is abandoned and counted late (a server far below the rate
    would otherwise hold the run for as long as its backlog takes). Due times are recorded
    from the start, plus `phase` (this process's offset among several)."""
    idle: list[Conn] = []
    opened = 0
    t0 = time.perf_counter()
    total = int((warmup + seconds) * rate)

    async def send(due: float, counted: bool) -> None:
        nonlocal opened
        if idle:
            conn = idle.pop()
        elif opened < max_conns:
            opened += 1
            conn = Conn(url)
        else:
            cell.errors += counted
            return
        body = queries.body(rerank, candidates)
        try:
            status, _, data = await conn.request("POST", queries.path, body)
        except (ConnectionError, asyncio.IncompleteReadError):
            conn.close()
            opened -= 1
            cell.errors += counted
            return
        except asyncio.CancelledError:  # abandoned past the grace: the reply would be late
            conn.close()
            cell.late += counted
            raise
        idle.append(conn)
        if not counted:
            return
        if status == 429:
            cell.refused += 1
        elif status != 200:
            cell.errors += 1
        elif b'"degraded":true' in data:
            cell.degraded += 1
        else:
            cell.latencies.append(time.perf_counter() - due)
            cell.due.append(due - t0 + phase)

    tasks = []
    for i in range(total):
        due = t0 + i / rate
        if (wait := due - time.perf_counter()) > 0:
            await asyncio.sleep(wait)
        tasks.append(asyncio.create_task(send(due, i >= warmup * rate)))
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=grace)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    for conn in idle:
        conn.close()
