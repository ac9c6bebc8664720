"""HTTP limits against a real `duet serve` over real sockets: bodies refused while they stream
(chunked or not), slow and oversized clients closed, a cap on requests in flight that
health checks pass, and decoding memory bounded under a pixel-bomb burst (issue 15)."""

from __future__ import annotations

import contextlib
import io
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from PIL import Image

from tests.conftest import Service, start_service, stop_service
from tests.test_e2e import _metric

INFLIGHT = 24


@pytest.fixture(scope="module")
def service(index_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    svc = start_service(
        index_dir,
        tmp_path_factory.mktemp("limits") / "serve.log",
        DUET_HTTP_HEADER_TIMEOUT_S="1",
        DUET_HTTP_BODY_TIMEOUT_S="2",
        DUET_HTTP_MAX_INFLIGHT=str(INFLIGHT),
        DUET_HTTP_QUEUE_TARGET_MS="0",  # the fixed cap alone (the paced one: test_pace.py)
        DUET_MAX_IMAGE_BYTES="1000000",
    )
    yield svc
    stop_service(svc)


def _connect(svc: Service) -> socket.socket:
    host, port = svc.url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=10)
    return s


def _read_all(s: socket.socket) -> bytes:
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    return out


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


class _PeakRSS:
    """Samples a process's resident memory every 10 ms while the block runs."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop = pid, 0, threading.Event()
        self.base = _rss_kib(pid)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_kib(self.pid))
            time.sleep(0.01)

    def __enter__(self) -> _PeakRSS:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def growth_mb(self) -> float:
        return (self.peak - self.base) / 1024


def _chunked_flood(svc: Service, path: str, ctype: str, total_mb: int) -> tuple[bytes, int]:
    """Send a chunked body of `total_mb` MB until the server answers or closes; returns the
    response and the bytes it accepted."""
    s = _connect(svc)
    s.sendall(
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {ctype}\r\n"
        "Transfer-Encoding: chunked\r\n\r\n".encode()
    )
    piece = b"A" * 65536
    frame = b"%x\r\n" % len(piece) + piece + b"\r\n"
    sent = 0
    if ctype.startswith("multipart"):  # a well-formed start: a file part that never ends
        head = (
            b'--xyz\r\nContent-Disposition: form-data; name="image"; filename="a.png"\r\n'
            b"Content-Type: image/png\r\n\r\n"
        )
        s.sendall(b"%x\r\n" % len(head) + head + b"\r\n")
    elif path == "/search/image":
        head = b'{"image_b64": "'
        s.sendall(b"%x\r\n" % len(head) + head + b"\r\n")
    try:
        while sent < total_mb * 2**20:
            s.sendall(frame)
            sent += len(piece)
        s.sendall(b"0\r\n\r\n")
    except (BrokenPipeError, ConnectionResetError):
        pass
    s.settimeout(5)
    reply = _read_all(s)
    s.close()
    return reply, sent


@pytest.mark.parametrize(
    ("path", "ctype"),
    [
        ("/search/text", "application/json"),
        ("/search/image", "application/json"),
        ("/search/image", "multipart/form-data; boundary=xyz"),
    ],
)
def test_chunked_body_refused_while_streaming(service: Service, path: str, ctype: str) -> None:
    with _PeakRSS(service.proc.pid) as rss:
        reply, sent = _chunked_flood(service, path, ctype, total_mb=200)
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert b'"payload_too_large"' in reply
    assert sent < 200 * 2**20  # the server stopped reading long before the end
    print(f"{path} {ctype}: {rss.growth_mb:.0f} MB, {sent >> 20} MB accepted")
    assert rss.growth_mb < 150, f"{rss.growth_mb:.0f} MB for a refused body"


def test_declared_length_refused_unread(service: Service) -> None:
    s = _connect(service)
    s.sendall(
        b"POST /search/text HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 999999999\r\n\r\n{}"
    )
    reply = _read_all(s)
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert b"payload_too_large" in reply and b"DUET_MAX_BODY_BYTES" in reply


def test_image_within_limit_still_served(service: Service) -> None:
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 30, 30)).save(buf, format="PNG")
    with service.client() as c:
        r = c.post("/search/image", files={"image": ("x.png", buf.getvalue(), "image/png")})
    assert r.status_code == 200, r.text


def _shed(service: Service, reason: str) -> float:
    from tests.test_e2e import _metric

    with service.client() as c:
        return _metric(c.get("/metrics").text, "duet_shed_requests_total", reason=reason)


def test_slow_headers_get_408_and_close(service: Service) -> None:
    before = _shed(service, "header_timeout")
    s = _connect(service)
    t0 = time.monotonic()
    s.sendall(b"POST /search/text HTTP/1.1\r\nHost: x\r\n")
    reply = _read_all(s)  # returns when the server closes
    assert time.monotonic() - t0 < 5
    assert reply.startswith(b"HTTP/1.1 408") and b"DUET_HTTP_HEADER_TIMEOUT_S" in reply
    # counted: no route saw it, and 6,000 of them (a slowloris) moved no metric
    assert _shed(service, "header_timeout") == before + 1


def test_silent_connection_closed(service: Service) -> None:
    before = _shed(service, "idle_timeout")
    s = _connect(service)
    t0 = time.monotonic()
    _read_all(s)
    assert time.monotonic() - t0 < 5
    assert _shed(service, "idle_timeout") == before + 1  # apart from a slowloris's


def test_slow_body_closed(service: Service) -> None:
    s = _connect(service)
    t0 = time.monotonic()
    s.sendall(
        b"POST /search/text HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 100\r\n\r\n{"query": '
    )
    _read_all(s)
    assert time.monotonic() - t0 < 6
    with service.client() as c:  # and the server is none the worse for it
        assert c.get("/healthz").status_code == 200


def test_huge_header_gets_431(service: Service) -> None:
    before = _shed(service, "headers_too_large")
    s = _connect(service)
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 1_000_000 + b"\r\n\r\n")
    reply = _read_all(s)
    assert reply.startswith(b"HTTP/1.1 431"), reply[:100]
    # its JSON written as the app's JSONResponse writes every other error body: compact
    body = reply.split(b"\r\n\r\n", 1)[1]
    assert body.startswith(b'{"error":{"code":"') and b'", "' not in body, body
    assert _shed(service, "headers_too_large") == before + 1


def test_inflight_cap_answers_429_and_health_passes(service: Service) -> None:
    """... and each such 429 is counted on /metrics (issue 36 row 11: none were)."""
    with service.client() as c:
        before = _metric(c.get("/metrics").text, "duet_shed_requests_total", reason="inflight")
    held = []
    for _ in range(INFLIGHT):  # requests whose bodies never finish keep a task each in flight
        s = _connect(service)
        s.sendall(
            b"POST /search/text HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n{"
        )
        held.append(s)
    time.sleep(0.3)
    try:
        with service.client() as c:
            r = c.post("/search/text", json={"query": "a red circle"})
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "overloaded"
            # a small request's connection stays open for the retry (a fresh one is what a
            # saturated server accepts late); a large one's is closed, its body unread
            assert r.headers.get("connection") != "close"
            assert c.post("/search/text", json={"query": "a blue square"}).status_code == 429
            big = c.post("/search/image", files={"image": ("x.png", b"\0" * 200_000)})
            assert big.status_code == 429 and big.headers["connection"] == "close"
            assert c.get("/healthz").status_code == 200
            metrics = c.get("/metrics")
            assert metrics.status_code == 200
            shed = _metric(metrics.text, "duet_shed_requests_total", reason="inflight")
            assert shed == before + 3
    finally:
        for s in held:
            s.close()
    time.sleep(0.3)
    with service.client() as c:
        assert c.post("/search/text", json={"query": "a red circle"}).status_code == 200


def test_pixel_bombs_keep_memory_bounded(service: Service) -> None:
    """16 concurrent 4999x4999 paletted PNGs (a few KB each, under the 25 MP limit) are
    decoded a few at a time and kept reduced while they wait: < 800 MB above idle."""
    buf = io.BytesIO()
    Image.new("P", (4999, 4999)).save(buf, format="PNG", optimize=True)
    bomb = buf.getvalue()
    assert len(bomb) < 100_000

    def post(_: int) -> int:
        with httpx.Client(base_url=service.url, timeout=120) as c:
            return c.post(
                "/search/image", files={"image": ("b.png", bomb, "image/png")}
            ).status_code

    with _PeakRSS(service.proc.pid) as rss, ThreadPoolExecutor(16) as pool:
        codes = list(pool.map(post, range(16)))
    assert codes == [200] * 16
    print(f"pixel bombs: {rss.growth_mb:.0f} MB above idle")
    assert rss.growth_mb < 800, f"{rss.growth_mb:.0f} MB above idle"
