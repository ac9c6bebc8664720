"""A front's connection to the owner (the process layout, `app.fronts`): its searches out, their
answers back, matched by id, over one Unix socket in the owner's wire format
(`app.owner.frame`: a 4-byte length, then a pickle).

The owner's messages are read by an asyncio protocol (`_Link`): each chunk that arrives is cut
into its messages at once, and an answer settles its search's future in the same turn of the
front's event loop. A reader task awaiting each message's length and then its body took a
turn of the loop more per answer, and with its two awaits ~5 % of a front's busy samples
(py-spy, lone dot-only requests, GPU layout on the CPU)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import pickle
import time
from collections.abc import Callable
from typing import Any

from app.errors import NotReady, ShuttingDown
from app.owner import frame

log = logging.getLogger("duet.fronts")

FLUSH_S = 0.25  # how often a front sends its metric observations to the owner
# how long a search waits for the owner's answer at most: a few times the owner's request
# deadline and at least this, so only an answer lost (never a slow one) ends it, with a 503
ANSWER_FLOOR_S = 30.0
PARENT_ENV = "DUET_FRONT_PARENT"  # the owner's pid: a front stops once it is not its parent


def owner_pid() -> int:
    """The pid of the owner that started this front (told, since it may be gone before the
    front reads its own parent)."""
    return int(os.environ.get(PARENT_ENV, os.getppid()))


def grouped(observed: list[Any]) -> list[tuple[str, tuple[tuple[str, str], ...], str, list[float]]]:
    """A front's observations since its last flush, one item per (family, labels, method)
    with every value in it: the owner applies each group at once (`app.owner.apply`)."""
    groups: dict[tuple[str, tuple[tuple[str, str], ...], str], list[float]] = {}
    for family, labels, method, value in observed:
        groups.setdefault((family, labels, method), []).append(value)
    return [(*key, values) for key, values in groups.items()]


def post(writer: asyncio.WriteTransport, msg: object, alone: bool = False) -> None:
    """Write `msg` at the end of this turn of the event loop: the messages posted in one turn
    (each search's request) leave in one write. `alone`: the only message in flight, so
    written at once unless others wait for this turn's write. The peer is the owner,
    reading all the time, and the messages in flight are bounded by the requests admitted,
    so no backpressure is awaited."""
    data = frame(msg)
    out = _outboxes.get(writer)
    if out is None and alone:
        writer.write(data)
        return
    if out is None:
        out = _outboxes[writer] = []
        asyncio.get_running_loop().call_soon(_write_out, writer)
    out.append(data)


_outboxes: dict[asyncio.WriteTransport, list[bytes]] = {}


def _write_out(writer: asyncio.WriteTransport) -> None:
    parts = _outboxes.pop(writer, [])
    if parts and not writer.is_closing():
        writer.write(b"".join(parts))


class _Link(asyncio.Protocol):
    """The owner's messages, cut out of what arrives and handed on as they complete."""

    def __init__(self, on_message: Callable[[Any], None], on_lost: Callable[[], None]) -> None:
        self._buf = bytearray()
        self._on_message = on_message
        self._on_lost = on_lost

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        at, end = 0, len(buf)
        msgs = []
        with memoryview(buf) as view:  # released before the buffer is cut
            while end - at >= 4:
                size = int.from_bytes(view[at : at + 4], "little")
                if end - at - 4 < size:
                    break
                msgs.append(pickle.loads(view[at + 4 : at + 4 + size]))
                at += 4 + size
        del buf[:at]
        for msg in msgs:
            self._on_message(msg)

    def connection_lost(self, exc: Exception | None) -> None:
        self._on_lost()


class RemoteEngine:
    """A front's connection to the owner: searches out, answers back, matched by id."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.info: dict[str, Any] = {}
        self.observed: list[Any] = []
        self._ids = itertools.count()
        # each search waiting for its answer: its future, and when it was sent (loop time)
        self._pending: dict[int, tuple[asyncio.Future[dict[str, Any]], float]] = {}
        self.answer_s = ANSWER_FLOOR_S
        self._hello: asyncio.Future[dict[str, Any]] | None = None
        self._io: asyncio.Transport | None = None
        self._closing = False
        self._tasks: list[asyncio.Task[None]] = []
        self.on_version: Callable[[str, str, bool], None] = lambda _version, _path, _cache: None

    async def connect(self, wait_s: float = 600.0) -> None:
        """Connect and say hello, waiting while the owner loads (it opens the socket once
        ready), but not for an owner that is gone: one killed while it loaded never stops
        its fronts, which would otherwise hold the public port for `wait_s`."""
        deadline = time.monotonic() + wait_s
        parent = owner_pid()
        loop = asyncio.get_running_loop()
        while True:
            try:
                transport, _ = await loop.create_unix_connection(
                    lambda: _Link(self._message, self._lost), self.path
                )
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if os.getppid() != parent:
                    raise ShuttingDown("the owner process is gone; this front stops") from None
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)
        self._io = transport
        self._hello = loop.create_future()
        post(transport, {"op": "hello"})
        await self._hello  # `_message` keeps `info`, announcements read with it included
        self.answer_s = max(ANSWER_FLOOR_S, 4 * float(self.info.get("timeout_s", 0.0)))
        self._tasks = [asyncio.create_task(self._flush(), name="front-metrics")]

    async def close(self) -> None:
        self._closing = True
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        if self._io is not None:
            self._io.close()
            self._lost()

    def _message(self, msg: dict[str, Any]) -> None:
        op = msg["op"]
        if op == "answer":
            waiting = self._pending.pop(msg["id"], None)
            if waiting is not None and not waiting[0].done():
                waiting[0].set_result(msg)
        elif op == "version":
            # an announcement read with the hello, before anyone listens, still counts
            self.info.update(version=msg["version"], path=msg["path"], cache=msg.get("cache", True))
            self.on_version(msg["version"], msg["path"], msg.get("cache", True))
        elif op == "hello" and self._hello is not None and not self._hello.done():
            self.info = msg["info"]
            self._hello.set_result(msg)

    def _lost(self) -> None:
        """The connection is gone: every search still waiting, and a hello, fail with 503."""
        if self._io is None:
            return
        if not self._closing:
            log.warning("the owner process closed its socket; this front stops answering")
        self._io = None
        gone = ShuttingDown()
        waiting = [fut for fut, _ in self._pending.values()]
        waiting += [self._hello] if self._hello else []
        self._pending.clear()
        for fut in waiting:
            if not fut.done():
                fut.set_exception(gone)

    async def _flush(self) -> None:
        """A few times a second: the metric observations to the owner, and a 503 for any
        search whose answer is overdue (`answer_s`: one the owner lost, never a slow one)."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(FLUSH_S)
            if self.observed and self._io is not None:
                items = grouped(self.observed)
                self.observed.clear()  # the list itself stays: the metrics append to it
                post(self._io, {"op": "observe", "items": items})
            due = loop.time() - self.answer_s
            for rid in [rid for rid, (_, asked) in self._pending.items() if asked < due]:
                fut, _ = self._pending.pop(rid)
                if not fut.done():
                    log.error("the owner did not answer search %d in %gs", rid, self.answer_s)
                    fut.set_exception(
                        NotReady(
                            f"the process that owns the model did not answer within "
                            f"{self.answer_s:g}s; retry in a moment"
                        )
                    )

    async def search(self, **msg: object) -> dict[str, Any]:
        if self._io is None:
            raise ShuttingDown()
        rid = next(self._ids)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[dict[str, Any]] = loop.create_future()
        self._pending[rid] = (fut, loop.time())
        try:
            post(self._io, {"op": "search", "id": rid, **msg}, alone=len(self._pending) == 1)
            return await fut
        finally:
            self._pending.pop(rid, None)
