"""The owner's side of the process layout (`app.fronts`): the Unix socket over which fronts
hand the process that owns the model their searches' model work, and the wire format both
sides speak (a 4-byte length, then a pickle: the peers are the service's own processes on
one host, the socket in a private directory)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
from typing import Any, cast

import numpy as np
from fastapi import FastAPI
from PIL import Image

from app import errors
from app.errors import DuetError, NotReady
from app.pipeline import SearchPipeline

log = logging.getLogger("duet.fronts")

# the front's metrics the owner counts (its /metrics is the service's)
FORWARDED = ("request_seconds", "cache_requests", "stage_seconds", "degraded", "shed")


async def send(writer: asyncio.StreamWriter, msg: object) -> None:
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    writer.write(len(data).to_bytes(4, "little") + data)
    await writer.drain()


def post(writer: asyncio.StreamWriter, msg: object) -> None:
    """`send` without waiting, for the messages each search makes (a front's request, the
    owner's answer): those posted in one turn of the event loop leave in one write, at its
    end. The peer is the service's own process reading all the time, and the messages in
    flight are bounded by the requests admitted, so no backpressure is awaited."""
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    out = _outboxes.get(writer)
    if out is None:
        out = _outboxes[writer] = []
        asyncio.get_running_loop().call_soon(_write_out, writer)
    out += (len(data).to_bytes(4, "little"), data)


_outboxes: dict[asyncio.StreamWriter, list[bytes]] = {}


def _write_out(writer: asyncio.StreamWriter) -> None:
    parts = _outboxes.pop(writer, [])
    if parts and not writer.is_closing():
        writer.write(b"".join(parts))


async def recv(reader: asyncio.StreamReader) -> Any:
    size = int.from_bytes(await reader.readexactly(4), "little")
    return pickle.loads(await reader.readexactly(size))


def error_of(exc: BaseException) -> dict[str, object]:
    """A DuetError as data (its class by name: every one lives in `app.errors`)."""
    if isinstance(exc, DuetError):
        return {
            "type": type(exc).__name__,
            "message": exc.message,
            "retry_after": exc.retry_after,
            "extra": exc.extra,
        }
    return {"type": "RuntimeError", "message": f"{type(exc).__name__}: {exc}"}


def raise_error(err: dict[str, Any]) -> None:
    cls = getattr(errors, str(err["type"]), None)
    if isinstance(cls, type) and issubclass(cls, DuetError):
        raise cls(err["message"], retry_after=err.get("retry_after"), **err.get("extra", {}))
    raise RuntimeError(err["message"])


class EngineServer:
    """The owner's Unix socket: fronts say hello, send searches and metric observations; the
    owner answers each search and tells every front of each index swap."""

    def __init__(self, app: FastAPI, path: str) -> None:
        self.app = app
        self.path = path
        self._writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def pipeline(self) -> SearchPipeline:
        p = self.app.state.pipeline
        if p is None:
            raise NotReady("the model and index are still loading; retry in a moment")
        return cast(SearchPipeline, p)

    async def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self._server = await asyncio.start_unix_server(self._serve, self.path)
        os.chmod(self.path, 0o600)
        loop = asyncio.get_running_loop()

        def swapped(version: str) -> None:  # called where the swap runs, once it has
            path = str(self.pipeline.index.path)
            loop.call_soon_threadsafe(self._announce, version, path)

        self.pipeline.swap_listeners.append(swapped)
        log.info("engine socket %s open for the fronts", self.path)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for w in list(self._writers):
            w.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def info(self) -> dict[str, object]:
        """What a front needs to plan, key and check requests as the owner would."""
        p = self.pipeline
        model = p.model
        # the encoder's word vocabulary (unknown and content words, token ids), when it has one
        tok = getattr(getattr(model, "encoder", model), "tokenizer", None)
        return {
            "fingerprint": model.fingerprint,
            "numerics": getattr(model, "numerics", None),
            "vocab": None if tok is None else {"words": tok.itos[3:], "max_len": tok.max_len},
            # whether the cache keys a text by its words (every model reading it is builtin)
            "by_words": getattr(model, "joint", None) is not None,
            "rerankers": p.rerankers,
            "default_reranker": p.default_reranker,
            "unavailable": p._unavailable,
            "fusion_lambda": p.fusion_lambda,
            "theta": p.theta,
            "version": p.index.version,
            "path": str(p.index.path),  # where a front reads the hits' items
            "decode_side": self.app.state.decoder.side,  # how an upload is decoded
        }

    def _announce(self, version: str, path: str) -> None:
        msg = {"op": "version", "version": version, "path": path}
        for w in list(self._writers):
            task = asyncio.ensure_future(send(w, msg))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while True:
                try:
                    msg = await recv(reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                op = msg.get("op")
                if op == "search":
                    task = asyncio.ensure_future(self._search(msg, writer))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
                elif op == "observe":
                    self._observe(msg["items"])
                elif op == "hello":
                    await send(writer, {"op": "hello", "info": self.info()})
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _search(self, msg: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        reply: dict[str, object] = {"op": "answer", "id": msg["id"]}
        try:
            p = self.pipeline
            image = None
            if msg["kind"] == "image":  # decoded by the front, as this process would
                size, pixels = msg["image"]
                image = Image.frombytes("RGB", size, pixels)
            with p.indexes.lease() as index:
                answer, version = await p.run(
                    index,
                    msg["kind"],
                    msg["text"],
                    image,
                    msg["plan"],
                    msg["m"],
                    msg["top_k"],
                    ids=msg.get("ids"),
                    look_up=False,  # the front looks the hits up in the version's item store
                )
            reply["answer"] = answer
            reply["version"] = version
            reply["path"] = str(index.path)
        except Exception as exc:
            if not isinstance(exc, DuetError):
                log.exception("a front's search failed in the owner")
            reply["error"] = error_of(exc)
        post(writer, reply)

    def _observe(
        self, items: list[tuple[str, tuple[tuple[str, str], ...], str, list[float]]]
    ) -> None:
        metrics = self.app.state.metrics
        for family, labels, method, values in items:
            if family not in FORWARDED or method not in ("inc", "observe"):
                continue
            target = getattr(metrics, family)
            if labels:
                target = target.labels(**dict(labels))
            apply(target, method, values)


def apply(target: Any, method: str, values: list[float]) -> None:
    """A front's grouped observations on the owner's metric: a counter's in one increment, a
    histogram's binned at once into its buckets, as one `observe` per value would count
    them (replaying each value held the GIL a tenth of the owner's busy time under load,
    py-spy --gil). One by one where the histogram's layout is not the one known
    (prometheus_client keeps `_upper_bounds`, `_buckets`, `_sum`)."""
    if method == "inc":
        target.inc(sum(values))
        return
    bounds = getattr(target, "_upper_bounds", None)
    buckets = getattr(target, "_buckets", None)
    total = getattr(target, "_sum", None)
    if bounds is None or buckets is None or total is None or len(bounds) != len(buckets):
        for v in values:
            target.observe(v)
        return
    # observe() counts a value in the first bucket whose upper bound is >= it
    at = np.searchsorted(bounds, values, side="left")  # NaN: past the last, as observe()
    counts = np.bincount(at, minlength=len(bounds))[: len(bounds)]
    for i in np.flatnonzero(counts):
        buckets[i].inc(float(counts[i]))
    total.inc(float(sum(values)))
