"""A client that closes its connection while its search waits: the search is cancelled at once
(its queued model work is then skipped, `app.engine`), the request counts as a 499, and the
requests of other clients and of a kept-alive connection are not touched. Real uvicorn over a
real socket under duet's HTTP protocol, which tells the route the client has gone
(`app.limits.GONE`); the pipeline behind the route is a search that waits to be cancelled."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from typing import Any, cast

import pytest
from prometheus_client import generate_latest

from app.config import Settings
from app.main import create_app
from app.pipeline import Served
from app.routes.search import TextSearchASGI
from tests.conftest import read_response, uvicorn_thread

ANSWER = json.dumps(
    {
        "hits": [],
        "timings_ms": {},
        "index_version": "v",
        "cached": False,
        "degraded": False,
        "reranked": None,
        "unknown_words": [],
    }
)


class WaitingSearch:
    """Answers "quick" at once; any other query waits (30 s) until it is cancelled."""

    model = None  # knows no words: every query is let through

    def __init__(self) -> None:
        self.started = threading.Event()
        self.cancelled = threading.Event()

    async def search_text(self, query: str, opts: Any) -> Served:
        if query == "quick":
            return Served(ANSWER)
        self.started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return Served(ANSWER)


def _post(query: str) -> bytes:
    body = json.dumps({"query": query}).encode()
    return (
        b"POST /search/text HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n" % len(body) + body
    )


def _status(sock: socket.socket) -> int:
    return int(read_response(sock)[0].split(b" ", 2)[1])


def test_a_search_whose_client_has_gone_is_cancelled_and_counted_as_499() -> None:
    app = create_app(Settings())
    search = WaitingSearch()
    app.state.pipeline = search
    with uvicorn_thread(app, Settings(), lifespan="off") as port:
        kept = socket.create_connection(("127.0.0.1", port), timeout=10)
        kept.sendall(_post("quick"))  # a kept-alive connection beside the one that goes
        assert _status(kept) == 200

        gone = socket.create_connection(("127.0.0.1", port), timeout=10)
        gone.sendall(_post("a red circle"))
        assert search.started.wait(10), "the search never started"
        assert not search.cancelled.is_set()
        t0 = time.monotonic()
        gone.close()
        assert search.cancelled.wait(5), "the search went on after its client had gone"
        assert time.monotonic() - t0 < 2

        for _ in range(3):  # its next requests are answered, none cancelled by the other's
            kept.sendall(_post("quick"))
            assert _status(kept) == 200
        kept.close()

        deadline = time.monotonic() + 5
        counted = b""
        while b'status="499"' not in counted and time.monotonic() < deadline:
            time.sleep(0.05)
            counted = generate_latest(app.state.metrics.registry)
        line = next(
            ln for ln in counted.splitlines() if b"request_seconds_count" in ln and b"499" in ln
        )
        assert line.endswith(b" 1.0"), line


def test_a_pipelined_clients_running_search_is_the_one_cancelled() -> None:
    """A client that sent a second request behind the first (HTTP/1.1 pipelining) and then
    went: the first, the one running, is cancelled (uvicorn's own idea of the connection's
    request is the last one parsed, whose search has not started)."""
    app = create_app(Settings())
    search = WaitingSearch()
    app.state.pipeline = search
    with uvicorn_thread(app, Settings(), lifespan="off") as port:
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sock.sendall(_post("a red circle") + _post("quick"))
        assert search.started.wait(10), "the search never started"
        time.sleep(0.2)  # the second is parsed and queued behind it
        sock.close()
        assert search.cancelled.wait(5), "the running search went on after its client had gone"


_PARTS = b'--b\r\ncontent-disposition: form-data; name="image"; filename="a.png"\r\n\r\n\x89PNG'
PARTIAL = {  # a body that stops partway: each route's ways of reading one
    "text": ("/search/text", "application/json", b'{"query": "a red'),
    "image-json": ("/search/image", "application/json", b'{"image_b64": "iVBORw0KGgo'),
    "image-form": ("/search/image", "multipart/form-data; boundary=b", _PARTS),
}


def _partial(path: str, ctype: str, start: bytes) -> bytes:
    return (
        b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: %s\r\ncontent-length: 1000\r\n\r\n"
        % (path.encode(), ctype.encode())
        + start
    )


def _counted(app: Any, endpoint: str, status: str) -> list[bytes]:
    """The request_seconds_count lines for `endpoint`, once one with `status` is there (5 s)."""
    deadline = time.monotonic() + 5
    while True:
        text = generate_latest(app.state.metrics.registry)
        lines = [
            ln
            for ln in text.splitlines()
            if ln.startswith(b"duet_request_seconds_count") and f'"{endpoint}"'.encode() in ln
        ]
        if any(f'status="{status}"'.encode() in ln for ln in lines):
            return lines
        if time.monotonic() > deadline:
            return lines
        time.sleep(0.05)


@pytest.mark.parametrize(
    ("kind", "fast"),
    [("text", True), ("text", False), ("image-json", True), ("image-form", True)],
    ids=["text-fast-path", "text-router", "image-json", "image-form"],
)
def test_a_client_gone_while_its_body_arrives_is_a_499_not_a_500(
    kind: str, fast: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """A client that sends part of its body and closes: a 499 under the route, no ERROR
    line and no traceback (it was a 500 with two `ClientDisconnect` tracebacks, which fed
    the 5xx alert). POST /search/text both past the router (`TextSearchASGI`) and through
    it; /search/image with a JSON and a multipart body."""
    path, ctype, start = PARTIAL[kind]
    app = create_app(Settings())
    if not fast:
        app.user_middleware = [
            m for m in app.user_middleware if m.cls is not cast(Any, TextSearchASGI)
        ]
    app.state.pipeline = WaitingSearch()
    with caplog.at_level(logging.INFO), uvicorn_thread(app, Settings(), lifespan="off") as port:
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sock.sendall(_partial(path, ctype, start))
        time.sleep(0.3)  # the route is reading the body
        sock.close()
        lines = _counted(app, path, "499")
    assert any(b'status="499"} 1.0' in ln for ln in lines), lines
    assert not any(b'status="500"' in ln for ln in lines), lines
    errors = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not errors, [(r.name, r.getMessage()) for r in errors]


def test_a_body_that_stops_arriving_is_a_408_when_duet_closes_the_connection() -> None:
    """A body the client leaves unfinished past DUET_HTTP_BODY_TIMEOUT_S: duet closes the
    connection (`app.limits`), and counts a 408 (its doing, not the client's 499)."""
    settings = Settings(http_body_timeout_s=0.5)
    app = create_app(settings)
    app.state.pipeline = WaitingSearch()
    with uvicorn_thread(app, settings, lifespan="off") as port:
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sock.sendall(_partial(*PARTIAL["text"]))
        assert sock.recv(1) == b""  # closed by duet, within the timeout
        sock.close()
        lines = _counted(app, "/search/text", "408")
    assert any(b'status="408"} 1.0' in ln for ln in lines), lines
    assert not any(b'status="499"' in ln or b'status="500"' in ln for ln in lines), lines
