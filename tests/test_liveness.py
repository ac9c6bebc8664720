"""The health port (issue 36 row 12): /healthz answered by a thread of its own, at once while
the event loop works through a connection storm, and 503 when the loop stops running."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from app.liveness import Heartbeat, LivenessServer, verdict
from benchmarks.load_client import finish_message
from tests.conftest import REPO, Service, free_port, start_service, stop_service


def test_verdict_reads_the_heartbeat_age() -> None:
    assert verdict(None, 30) == (200, {"status": "starting"})
    assert verdict(0.2, 30)[0] == 200
    status, body = verdict(31.0, 30)
    assert status == 503 and body["status"] == "stalled" and "31.0 s" in body["detail"]


def test_health_port_answers_from_its_thread_and_says_when_the_loop_stalls() -> None:
    beat = Heartbeat()
    server = LivenessServer("127.0.0.1", 0, beat, stall_s=0.3).start()
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{server.port}", timeout=5) as c:
            assert c.get("/healthz").json() == {"status": "starting"}
            beat.beat()
            r = c.get("/healthz")
            assert r.status_code == 200 and r.json()["status"] == "ok"
            head = c.head("/healthz")
            assert head.status_code == 200 and head.content == b""
            time.sleep(0.5)  # no beat since: the loop would be stuck
            r = c.get("/healthz")
            assert r.status_code == 503 and r.json()["status"] == "stalled"
            r = c.get("/search/text")
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    finally:
        server.stop()


@pytest.fixture(scope="module")
def service(index_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    log = tmp_path_factory.mktemp("logs") / "serve.log"
    port = free_port()
    svc = start_service(index_dir, log, DUET_HEALTH_PORT=str(port), DUET_REDIS_URL="")
    svc.health_port = port  # type: ignore[attr-defined]
    try:
        yield svc
    finally:
        stop_service(svc)


def _get_ms(port: int, path: str = "/healthz", timeout: float = 10.0) -> tuple[int, float]:
    """One GET on a fresh connection: (status, milliseconds); status 0 on a timeout."""
    t0 = time.perf_counter()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
            head = s.recv(64)
        status = int(head.split()[1])
    except OSError:
        status = 0
    return status, (time.perf_counter() - t0) * 1000


async def _storm(port: int, clients: int, seconds: float) -> int:
    """`clients` connections, each sending dot-only text searches back to back."""
    body = json.dumps({"query": "a small red circle", "top_k": 10, "rerank": False}).encode()
    request = (
        b"POST /search/text HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    end = time.monotonic() + seconds
    sent = 0

    async def one() -> None:
        nonlocal sent
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            while time.monotonic() < end:
                writer.write(request)
                await writer.drain()
                _, headers, _ = await finish_message(reader, await reader.readuntil(b"\r\n\r\n"))
                sent += 1
                if headers.get("connection", "").lower() == "close":
                    writer.close()
                    reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
        except (OSError, asyncio.IncompleteReadError):
            pass

    await asyncio.gather(*(one() for _ in range(clients)))
    return sent


@pytest.mark.slow
def test_health_port_answers_within_a_second_during_a_700_client_storm(service: Service) -> None:
    main_port = int(service.url.rsplit(":", 1)[1])
    health_port: int = service.health_port  # type: ignore[attr-defined]
    answered: list[int] = []
    storm = threading.Thread(
        target=lambda: answered.append(asyncio.run(_storm(main_port, 700, 6.0))), daemon=True
    )
    storm.start()
    time.sleep(1.0)  # the connections are open and sending
    side: list[tuple[int, float]] = []
    main: list[tuple[int, float]] = []

    def probe(port: int, out: list[tuple[int, float]]) -> None:
        while storm.is_alive():
            out.append(_get_ms(port))
            time.sleep(0.2)

    probes = [
        threading.Thread(target=probe, args=(health_port, side), daemon=True),
        threading.Thread(target=probe, args=(main_port, main), daemon=True),
    ]
    for t in probes:
        t.start()
    storm.join(timeout=60)
    for t in probes:
        t.join(timeout=30)
    worst_side = max(ms for _, ms in side)
    worst_main = max((ms for _, ms in main), default=0.0)
    print(
        f"storm: {answered} answers; health port max {worst_side:.0f} ms over {len(side)} "
        f"probes; the service port's /healthz max {worst_main:.0f} ms over {len(main)}"
    )
    assert len(side) >= 3, "the storm ended before the probes ran"
    assert all(status == 200 for status, _ in side), side
    assert worst_side < 1000, side


def test_duet_healthcheck_probes_the_health_port(service: Service) -> None:
    env = {**os.environ, "DUET_HEALTH_PORT": str(service.health_port), "DUET_PORT": "1"}  # type: ignore[attr-defined]
    ok = subprocess.run([sys.executable, "-m", "duet.cli", "healthcheck"], env=env, cwd=REPO)
    assert ok.returncode == 0  # DUET_PORT 1 answers nothing: the health port did
