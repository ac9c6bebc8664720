"""A client that closes its connection while its search waits: the search is cancelled at once
(its queued model work is then skipped, `app.engine`), the request counts as a 499, and the
requests of other clients and of a kept-alive connection are not touched. Real uvicorn over a
real socket under duet's HTTP protocol, which tells the route the client has gone
(`app.limits.GONE`); the pipeline behind the route is a search that waits to be cancelled."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from typing import Any

from prometheus_client import generate_latest

from app.config import Settings
from app.main import create_app
from app.pipeline import Served
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
