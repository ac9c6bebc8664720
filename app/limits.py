"""Limits that hold before the application sees a request: bodies counted while they stream
in, and an HTTP protocol that closes slow or oversized clients.

uvicorn on its own waits forever for a client's headers and body and accepts headers of any
size; a 300 MB chunked body was buffered before any handler could refuse it. Here:
- `BodyLimit` (ASGI middleware) counts the body as it arrives, chunked or not, and answers
  413 the moment a route's limit is passed: nothing beyond the limit is read, buffered or
  spooled to disk. A declared Content-Length above the limit is refused unread.
- `guarded_protocol` makes uvicorn's httptools protocol close a connection whose request
  headers are not complete within `header_timeout_s` (408), whose body has not arrived within
  `body_timeout_s`, or whose request line and headers pass `max_header_bytes` (431). It
  also tells a request whose client has gone at once (`GONE`), so the search routes stop
  waiting for model work nobody will read.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from app.config import DRAIN_S
from app.errors import BODY_TIMED_OUT, SHUT_DOWN, PayloadTooLarge, error_bytes
from app.pace import Counted, Pace, busy, json_response

# answered even when the in-flight cap is reached: probes and scrapes must see a busy server
_ALWAYS = (b"/healthz", b"/readyz", b"/metrics")
# requests of one connection parsed and queued behind the one being answered (HTTP/1.1
# pipelining); beyond them the connection's bytes wait unparsed and the socket is not read
MAX_PIPELINED = 16
PARSE_SLICE = 4096  # bytes parsed at a time, so the queue overshoots by a slice at most
# in each request's scope: callbacks the connection calls once its client is gone before the
# answer was sent (`app.routes.search._unless_gone` cancels its request with one)
GONE = "duet.gone"


class _TooLarge(Exception):
    """Raised into the application's body read once the limit is passed."""


class BodyLimit:
    """413 for a body over its route's limit, counted while it streams in: `limit_for(path)`
    is the limit in bytes and the words that say where it comes from (the settings)."""

    def __init__(self, app: ASGIApp, limit_for: Callable[[str], tuple[int, str]]) -> None:
        self.app = app
        self.limit_for = limit_for

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit, why = self.limit_for(scope["path"])
        declared = dict(scope["headers"]).get(b"content-length", b"")
        message = f"request body is larger than {limit} bytes, the limit for {scope['path']}: {why}"
        if declared.isdigit() and int(declared) > limit:
            for m in json_response(PayloadTooLarge.status, PayloadTooLarge.code, message):
                await send(m)
            return
        seen = 0
        over = False
        started = False

        async def counted() -> Message:
            nonlocal seen, over
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:
                    over = True
                    raise _TooLarge
            return msg

        async def guarded_send(msg: Message) -> None:
            nonlocal started
            if over:  # whatever the app made of the interrupted read, the caller gets a 413
                return
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        try:
            await self.app(scope, counted, guarded_send)
        except _TooLarge:
            pass
        except Exception:
            if not over:
                raise
        if over and not started:
            for m in json_response(PayloadTooLarge.status, PayloadTooLarge.code, message):
                await send(m)


def _uncounted(reason: str) -> None:
    """What a request turned away before any route calls when nothing counts it."""


@dataclass(frozen=True)
class HttpLimits:
    """What `GuardedHttpToolsProtocol` enforces (the DUET_HTTP_* settings); `on_shed` is
    called for every request it answers itself, before any route, with why: "inflight" (429
    at the in-flight cap), "header_timeout" (408), "idle_timeout" (408 to a connection that
    sent nothing), "headers_too_large" (431), "bad_request" (400: not HTTP/1.1), which no
    route's metrics count, `pace` moves that cap with
    the process's answer rate."""

    header_timeout_s: float
    body_timeout_s: float
    max_header_bytes: int
    max_inflight: int
    on_shed: Callable[[str], None] = _uncounted
    pace: Pace = field(default_factory=lambda: Pace(0.0))
    admitted: list[int] = field(default_factory=lambda: [0])  # in flight now (`Counted`)
    drain_s: float = DRAIN_S  # DUET_HTTP_DRAIN_S: uvicorn's graceful stop, then it cancels


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol under `limits`, which `guarded_protocol` sets on a
    subclass (uvicorn builds the protocol itself, so settings cannot come in as arguments)."""

    limits: ClassVar[HttpLimits]
    _timer: asyncio.TimerHandle | None = None
    _header_bytes = 0
    _held = b""  # received; from `_at` on not parsed yet, while MAX_PIPELINED are queued
    _at = 0
    _refusals = 0  # this connection's 429s at the in-flight cap not yet sent out
    _running: Any = None  # the request cycle whose application runs now
    _body_due = False  # a request's headers are in, the rest of its body not yet
    _began = False  # a request's first byte came in on this connection

    def _arm(self, seconds: float, why: str) -> None:
        self._disarm()
        self._timer = self.loop.call_later(seconds, self._expire, why)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self, why: str) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        self.logger.info("closing a slow client %s (%s not received in time)", self.client, why)
        if why == "headers":  # one that never began a request (a preconnect) counted apart
            self.limits.on_shed("header_timeout" if self._began else "idle_timeout")
            self._refuse(
                408,
                "request_timeout",
                f"request headers not received within {self.limits.header_timeout_s:g} s "
                "(DUET_HTTP_HEADER_TIMEOUT_S)",
            )
        elif why == "shutdown":  # the app's receive() sees http.disconnect: counted as a 503
            self.scope[SHUT_DOWN] = True  # type: ignore[literal-required]
            if self.cycle is not None and not self.cycle.response_started:
                self._refuse(
                    503,
                    "shutting_down",
                    "the service is shutting down and the request's body had not all arrived "
                    f"within DUET_HTTP_DRAIN_S ({self.limits.drain_s:g} s); send it again",
                )
            self.transport.close()
        else:  # the app's receive() then sees http.disconnect: counted as a 408, not a 499
            self.scope[BODY_TIMED_OUT] = True  # type: ignore[literal-required]
            self.transport.close()

    def _refuse(self, status: int, code: str, message: str) -> None:
        body = error_bytes(code, message)
        reason = {
            400: b"Bad Request",
            408: b"Request Timeout",
            431: b"Request Header Fields Too Large",
            503: b"Service Unavailable",
        }[status]
        self.transport.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n" % (status, reason, len(body)) + body
        )
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to bytes that are not HTTP/1.1, as the documented JSON error."""
        self._disarm()
        self.limits.on_shed("bad_request")
        self._refuse(
            400,
            "bad_request",
            f"{msg.rstrip('.')}: the request is not valid HTTP/1.1; send a request line, "
            "headers and a body framed by Content-Length or chunked encoding",
        )

    def shutdown(self) -> None:
        """uvicorn's graceful stop. A request whose body is still arriving gets until just
        before the drain's end for the rest, then a 503 JSON answer and its connection
        closed: uvicorn cancels what runs at the drain's end, and a cancelled request was
        a plain-text 500 with a traceback in the log."""
        if self._body_due and not self.transport.is_closing():
            due = self.loop.time() + max(self.limits.drain_s - 0.5, 0.0)
            if self._timer is None or self._timer.when() > due:  # else the body timeout closes it
                self._arm(due - self.loop.time(), "shutdown")
        super().shutdown()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(self.limits.header_timeout_s, "headers")

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        for _, app in self.pipeline:  # admitted, never to run
            if isinstance(app, Counted):
                app.release()
        # the request being answered: uvicorn's `cycle` is the last one parsed, a later one
        # when the client pipelined (not started, so no hooks yet); `cycle` where this
        # uvicorn starts its tasks without `_start_asgi_task`
        running = self._running if self._running is not None else self.cycle
        if running is not None and not running.response_complete:
            hooks: list[Callable[[], None]] = running.scope.get(GONE, [])  # type: ignore[assignment]
            for gone in list(hooks):
                gone()
        super().connection_lost(exc)

    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        self._running = cycle
        super()._start_asgi_task(cycle, app)

    def data_received(self, data: bytes) -> None:
        """Parse what arrived a slice at a time, holding the rest (and reading no more) while
        `MAX_PIPELINED` requests of this connection wait for the one being answered.

        uvicorn parses every request in a read at once and queues each (a read of 256 KB
        holds thousands of `GET /healthz`), and reads again whenever an answer is done: a
        client that pipelines and never reads grew the server by a gigabyte in 30 s."""
        if self.transport.is_closing():  # refused: the rest is not parsed
            return
        self._held = self._held[self._at :] + data if self._held else data
        self._at = 0
        self._feed()

    def _feed(self) -> None:
        held = memoryview(self._held)  # slices of it are not copies
        while self._at < len(held) and len(self.pipeline) < MAX_PIPELINED:
            if self.transport.is_closing():
                break
            super().data_received(held[self._at : self._at + PARSE_SLICE])  # type: ignore[arg-type]
            self._at += PARSE_SLICE
        if self._at >= len(held) or self.transport.is_closing():
            self._held, self._at = b"", 0
        else:
            self.flow.pause_reading()

    def on_response_complete(self) -> None:
        if self._refusals:  # responses go out in the order their requests came
            self._refusals -= 1
        else:
            self.limits.pace.done(time.monotonic())
        super().on_response_complete()  # starts the next queued request, resumes reading
        if self._held and not self.transport.is_closing():
            self._feed()

    def on_message_begin(self) -> None:
        self._began = True
        super().on_message_begin()
        self.scope[GONE] = []  # type: ignore[literal-required]
        self._header_bytes = 0
        if self._timer is None:  # a keep-alive connection's next request
            self._arm(self.limits.header_timeout_s, "headers")

    def _count(self, n: int) -> None:
        self._header_bytes += n
        max_header_bytes = self.limits.max_header_bytes
        if self._header_bytes > max_header_bytes and not self.transport.is_closing():
            self._disarm()
            self.limits.on_shed("headers_too_large")
            self._refuse(
                431,
                "headers_too_large",
                f"request line and headers exceed {max_header_bytes} bytes "
                "(DUET_HTTP_MAX_HEADER_BYTES)",
            )

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if self.transport.is_closing():
            return
        self._arm(self.limits.body_timeout_s, "body")
        self._body_due = True
        if self.url.startswith(_ALWAYS) or self.parser.should_upgrade():
            super().on_headers_complete()
            return
        cap = self.limits.pace.cap(self.limits.max_inflight, time.monotonic())
        refused = self.limits.admitted[0] >= cap
        if refused:
            self.limits.on_shed("inflight")
            self._refusals += 1  # not an answer: the pace counts what the app answers
        app = self.app
        self.app = busy if refused else Counted(app, self.limits.admitted)
        try:
            super().on_headers_complete()
        finally:
            self.app = app

    def on_body(self, body: bytes) -> None:
        if not self.transport.is_closing():
            super().on_body(body)

    def on_message_complete(self) -> None:
        self._disarm()
        self._body_due = False
        if not self.transport.is_closing():
            super().on_message_complete()


def guarded_protocol(
    header_timeout_s: float,
    body_timeout_s: float,
    max_header_bytes: int,
    max_inflight: int,
    on_shed: Callable[[str], None] = _uncounted,
    queue_target_s: float = 0.0,
    drain_s: float = DRAIN_S,
) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol with a header deadline, a body deadline, a header cap and
    a cap on requests in flight (429 before the app, each one counted by `on_shed`; health,
    readiness and metrics exempt), lowered to what this process answers in `queue_target_s`
    when that is set (`Pace`)."""

    class Guarded(GuardedHttpToolsProtocol):
        limits = HttpLimits(
            header_timeout_s,
            body_timeout_s,
            max_header_bytes,
            max_inflight,
            on_shed,
            Pace(queue_target_s),
            drain_s=drain_s,
        )

    return Guarded


def uvicorn_options(settings: Any, metrics: Any = None) -> dict[str, Any]:
    """The uvicorn.run keywords that carry duet's HTTP limits; with the app's `metrics`, the
    refusals before any route count as `duet_shed_requests_total{reason}` (inflight,
    header_timeout, idle_timeout, headers_too_large, bad_request). The queue
    target as `duet serve` resolved it (`app.main.queue_target_ms`; `auto` left: none)."""
    shed = _uncounted if metrics is None else lambda why: metrics.shed.labels(reason=why).inc()
    return {
        "http": guarded_protocol(
            settings.http_header_timeout_s,
            settings.http_body_timeout_s,
            settings.http_max_header_bytes,
            settings.http_max_inflight,
            shed,
            target / 1000 if isinstance(target := settings.http_queue_target_ms, float) else 0.0,
            settings.http_drain_s,
        ),
        "timeout_keep_alive": settings.http_keep_alive_s,
        "timeout_graceful_shutdown": settings.http_drain_s,
        "backlog": settings.http_backlog,
    }
