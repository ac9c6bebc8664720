"""Liveness on a port of its own, answered by a thread, not by the event loop.

In a connection storm the event loop has hundreds of sockets ready ahead of a probe's: a
`/healthz` on the service's port waits its turn (issue 36 row 12: p90 5.1 s, max 9.5 s at 700
clients), and a liveness probe with a few seconds' timeout restarts a replica that is doing
its job, shedding load. With `DUET_HEALTH_PORT` set, a small threaded HTTP server answers
`GET`/`HEAD /healthz` there at once, whatever the loop is doing. It still tells a live
process from a stuck one: the loop beats a `Heartbeat` every half second, and when no beat
came for `DUET_HEALTH_STALL_S` the answer is 503 (a loop that is busy still beats; one blocked
by a bug does not).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger("duet.liveness")

BEAT_S = 0.5


class Heartbeat:
    """When the event loop last ran a beat (monotonic seconds); None before its first."""

    def __init__(self) -> None:
        self.last: float | None = None

    def beat(self) -> None:
        self.last = time.monotonic()

    def age(self) -> float | None:
        return None if self.last is None else time.monotonic() - self.last

    async def run(self, every: float = BEAT_S) -> None:
        """Beat until cancelled (a task on the loop being watched)."""
        while True:
            self.beat()
            await asyncio.sleep(every)


def verdict(age: float | None, stall_s: float) -> tuple[int, dict[str, Any]]:
    """The status and body for a heartbeat `age` seconds old."""
    if age is None:
        return 200, {"status": "starting"}  # loading: the startup and readiness probes judge
    if age > stall_s:
        return 503, {
            "status": "stalled",
            "detail": f"the event loop has not run for {age:.1f} s (limit {stall_s:g} s)",
        }
    return 200, {"status": "ok", "loop_lag_s": round(age, 3)}


class LivenessServer:
    """`GET`/`HEAD /healthz` on (host, port) from a daemon thread; port 0 picks a free one."""

    def __init__(self, host: str, port: int, heartbeat: Heartbeat, stall_s: float) -> None:
        self.heartbeat = heartbeat
        self.stall_s = stall_s
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            timeout = 10  # an idle probe connection gives its thread back

            def _answer(self, body: bool) -> None:
                if self.path.split("?", 1)[0] != "/healthz":
                    status, doc = 404, {"error": {"code": "not_found", "message": "only /healthz"}}
                else:
                    status, doc = verdict(owner.heartbeat.age(), owner.stall_s)
                data = json.dumps(doc).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                if body:
                    self.wfile.write(data)

            def do_GET(self) -> None:
                self._answer(True)

            def do_HEAD(self) -> None:
                self._answer(False)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # a probe every few seconds is not worth a log line

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="duet-liveness", daemon=True
        )

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> LivenessServer:
        self._thread.start()
        log.info(
            "liveness on port %d (/healthz, 503 after %g s without a loop beat)",
            self.port,
            self.stall_s,
        )
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
