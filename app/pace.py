"""The in-flight cap's moving parts (`app.limits.GuardedHttpToolsProtocol` enforces it): the
cap that follows the answer rate (`Pace`), the count of admitted requests it is held against
(`Counted`), and the 429 a request past it gets (`busy`)."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import error_bytes


def json_response(status: int, code: str, message: str) -> tuple[Message, Message]:
    """A JSON error body as the two ASGI messages that send it, on a connection to close."""
    body = error_bytes(code, message)
    start: Message = {
        "type": "http.response.start",
        "status": status,
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ],
    }
    return start, {"type": "http.response.body", "body": body}


class Pace:
    """The in-flight cap that follows how fast this process answers: Little's law says
    requests in flight = answers per second x the time each spends, so capping the ones in
    flight at `rate x target_s` keeps an admitted request's wait near `target_s`, whatever
    holds the process back (the GPU, or its own event loop: on an H100 host one process
    answered ~500 req/s, and 512 clients queued 1.5 s in it while the engine's admission,
    which prices model work only, saw no queue). The rate is read over the slots of the
    last `window_s` that saw answers (so an idle spell does not make the next burst look
    slow); with none, the fixed cap holds. Never below `floor`."""

    SLOTS = 20

    def __init__(self, target_s: float, floor: int = 16, window_s: float = 2.0) -> None:
        self.target_s, self.floor = target_s, floor
        self._slot_s = window_s / self.SLOTS
        self._slots = [0] * self.SLOTS
        self._at = 0  # the newest slot number (time // slot_s); _slots[n % SLOTS] counts n

    def _roll(self, now: float) -> int:
        slot = int(now / self._slot_s)
        for n in range(max(self._at + 1, slot - self.SLOTS + 1), slot + 1):
            self._slots[n % self.SLOTS] = 0
        self._at = max(self._at, slot)
        return slot

    def done(self, now: float) -> None:
        """One answer went out at `now` (time.monotonic())."""
        self._slots[self._roll(now) % self.SLOTS] += 1

    def rate(self, now: float) -> float:
        """Answers per second in the slots of the window that had any (the newest, still
        filling, only while it is the one); 0 when none had."""
        slot = self._roll(now)
        done = [self._slots[n % self.SLOTS] for n in range(slot - self.SLOTS + 1, slot)]
        busy = [c for c in done if c]
        if busy:
            return sum(busy) / (len(busy) * self._slot_s)
        newest = self._slots[slot % self.SLOTS]
        return newest / max(now - slot * self._slot_s, self._slot_s / 10) if newest else 0.0

    def cap(self, limit: int, now: float) -> int:
        if self.target_s <= 0 or (rate := self.rate(now)) <= 0:
            return limit
        return max(self.floor, min(limit, int(rate * self.target_s)))


# a refused request's body up to this size is read past and the connection kept: closing it
# sends the client through a new connection, which a saturated uvloop accepts late (on the
# 2-core CPU, requests on fresh connections waited 2.4 s where the admitted ones took 0.25)
KEEP_ALIVE_BODY = 64 * 1024


class Counted:
    """The app for one admitted request, counted in `admitted` (a server's count of the
    requests it admitted and has not finished, health, readiness and metrics apart: what
    the in-flight cap holds against; not uvicorn's tasks, among which each 429 also sits
    until it is out, so a storm of refusals would refuse everything) from admission until
    it returns, or until its connection is lost while it still waited its turn."""

    __slots__ = ("admitted", "app", "done")

    def __init__(self, app: ASGIApp, admitted: list[int]) -> None:
        self.app, self.admitted, self.done = app, admitted, False
        admitted[0] += 1

    def release(self) -> None:
        if not self.done:
            self.done = True
            self.admitted[0] -= 1

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.app(scope, receive, send)
        finally:
            self.release()


async def busy(scope: Scope, receive: Receive, send: Send) -> None:
    """What a request past the in-flight cap gets, before any routing or body parsing: a 429
    on a connection kept open when what remains of the request is small (its body is then
    parsed past unread), closed when it is large or of unknown length."""
    start, body = json_response(
        429,
        "overloaded",
        "too many requests in flight; retry later "
        "(DUET_HTTP_MAX_INFLIGHT, DUET_HTTP_QUEUE_TARGET_MS)",
    )
    headers = dict(scope["headers"])
    declared = headers.get(b"content-length", b"")
    small = b"transfer-encoding" not in headers and (
        declared == b"" or (declared.isdigit() and int(declared) <= KEEP_ALIVE_BODY)
    )
    if small:
        start["headers"].remove((b"connection", b"close"))
    start["headers"].append((b"retry-after", b"1"))
    await send(start)
    await send(body)
