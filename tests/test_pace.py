"""The in-flight cap that follows the answer rate (`app.pace.Pace`, DUET_HTTP_QUEUE_TARGET_MS):
the arithmetic, then real uvicorn over real sockets with a process that is itself the
bottleneck, where a fixed cap lets admitted requests queue far past the target."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
from fastapi import FastAPI

from app.config import Settings
from app.pace import Pace
from tests.conftest import Placed, uvicorn_thread

LOOP = "auto"


def test_the_cap_is_the_rate_times_the_target_within_its_bounds() -> None:
    pace = Pace(0.5, floor=16, window_s=2.0)
    assert pace.cap(512, now=100.0) == 512  # nothing answered yet: the fixed cap
    for i in range(400):  # 200 answers a second for two seconds
        pace.done(100.0 + i / 200)
    assert pace.rate(102.0) == pytest.approx(200, rel=0.05)
    assert pace.cap(512, now=102.0) == pytest.approx(100, abs=5)
    assert pace.cap(64, now=102.0) == 64  # never above the fixed cap
    for i in range(20):  # then 20 a second: the rate follows within the window
        pace.done(102.0 + i / 20)
    assert pace.cap(512, now=104.0) == pytest.approx(16, abs=2)
    assert pace.cap(512, now=110.0) == 512  # nothing answered in the window: the fixed cap
    assert Pace(0.0).cap(512, now=1.0) == 512  # target 0: the fixed cap alone
    slow = Pace(0.5, floor=16)
    for i in range(10):
        slow.done(5.0 + i / 10)
    assert slow.cap(512, now=6.0) == 16  # never below the floor


def test_a_burst_after_an_idle_spell_is_read_at_its_own_rate() -> None:
    pace = Pace(1.0, floor=1, window_s=2.0)
    pace.done(10.0)  # one answer, then a second and a half of nothing
    for i in range(150):  # 300 a second for half a second
        pace.done(11.5 + i / 300)
    assert pace.rate(12.0) == pytest.approx(300, rel=0.15)
    fresh = Pace(1.0, floor=1)
    for i in range(20):  # the first answers ever, within the first slot
        fresh.done(20.0 + i / 400)
    assert fresh.rate(20.05) == pytest.approx(400, rel=0.1)


@contextmanager
def _bottleneck(target_ms: float) -> Iterator[int]:
    """A server that answers one request at a time, 10 ms each (100 a second: the process,
    not any model, is what holds requests back), under duet's HTTP protocol."""
    app = FastAPI()
    one = asyncio.Lock()

    async def work() -> dict[str, bool]:
        async with one:
            time.sleep(0.01)  # the event loop itself is busy, as a saturated process is
        return {"ok": True}

    app.add_api_route("/search/text", work, methods=["POST"])
    settings = Settings(http_queue_target_ms=target_ms, http_max_inflight=512)
    with uvicorn_thread(app, settings, loop=LOOP) as port:
        yield port


async def _load(port: int, clients: int, seconds: float) -> tuple[list[float], int]:
    """Closed-loop clients (the benchmarks' keep-alive client, which reconnects when a 429
    closes its connection); a refused one waits 0.2 s. (latencies of the 200s sent after
    the first second and a half, 429 count)"""
    from benchmarks.load_client import Conn

    lat: list[float] = []
    refused = 0
    steady = time.monotonic() + 1.5  # the first burst came before any answer: no pace yet
    end = steady - 1.5 + seconds

    async def one() -> None:
        nonlocal refused
        conn = Conn(f"http://127.0.0.1:{port}")
        while time.monotonic() < end:
            t0 = time.monotonic()
            status, headers, _ = await conn.request("POST", "/search/text", b"{}")
            if status == 429:
                assert headers["retry-after"] == "1"
                refused += 1
                await asyncio.sleep(0.2)
            else:
                assert status == 200
                if t0 > steady:
                    lat.append(time.monotonic() - t0)
        conn.close()

    await asyncio.gather(*(one() for _ in range(clients)))
    return lat, refused


@pytest.mark.slow
def test_admitted_requests_wait_about_the_target_where_a_fixed_cap_lets_them_queue() -> None:
    results = {}
    for target_ms in (0.0, 250.0):  # the fixed cap alone, then the paced one
        with _bottleneck(target_ms) as port:
            lat, refused = asyncio.run(_load(port, clients=120, seconds=4.0))
        results[target_ms] = (float(np.percentile(lat, 90)), refused, len(lat))
    fixed_p90, fixed_refused, fixed_n = results[0.0]
    paced_p90, paced_refused, paced_n = results[250.0]
    assert fixed_refused == 0 and fixed_p90 > 0.8, results  # 120 queued x 10 ms = 1.2 s
    assert paced_refused > 0 and paced_p90 < 0.6, results  # about the 250 ms target
    assert paced_n > 0.6 * fixed_n, results  # the process kept answering as fast


@pytest.mark.parametrize(
    ("setting", "device", "layout", "want"),
    [
        ("auto", "cuda:0", "auto", 500.0),
        ("auto", "cpu", "auto", 0.0),  # the engine's admission prices the CPU's bottleneck
        ("auto", "cuda:0", "cpu", 0.0),
        ("120", "cpu", "auto", 120.0),
        ("0", "cuda:0", "auto", 0.0),
    ],
)
def test_the_queue_target_is_paced_on_cuda_by_default(
    monkeypatch: pytest.MonkeyPatch, setting: str, device: str, layout: str, want: float
) -> None:
    from app.main import queue_target_ms

    monkeypatch.setenv("DUET_HTTP_QUEUE_TARGET_MS", setting)
    monkeypatch.setenv("DUET_LAYOUT", layout)
    assert queue_target_ms(Settings(), Placed(device)) == want
