"""The owner's side of the process layout (`app.fronts`): the Unix socket over which fronts
hand the process that owns the model their searches' model work, and the wire format both
sides speak (a 4-byte length, then a pickle: the peers are the service's own processes on
one host, the socket in a private directory)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import pickle
import socket
import threading
from typing import Any, cast

import numpy as np
from fastapi import FastAPI
from PIL import Image

from app import errors
from app.batch import Answer
from app.errors import DuetError, NotReady
from app.pipeline import SearchPipeline
from app.threadname import name_os_thread
from store.indexio import IndexVersion

log = logging.getLogger("duet.fronts")

# the front's metrics the owner counts (its /metrics is the service's)
FORWARDED = (
    "request_seconds",
    "cache_requests",
    "cache_write_errors",
    "stage_seconds",
    "degraded",
    "shed",
)
ACCEPT_POLL_S = 0.25  # how soon the accepting thread notices that the socket closed


def frame(msg: object) -> bytes:
    """`msg` as it crosses the socket, either way: a 4-byte length, then its pickle."""
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    return len(data).to_bytes(4, "little") + data


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


class Peer:
    """One front's connection as the owner serves it, on threads rather than an event loop:
    a thread of its own reads the front's messages, and an answer is written by the thread
    that has it (the engine's worker), so a search's answer reaches its front without waking
    the owner's event loop (`EngineServer`).

    A write never blocks its thread on a front that is slow to read: what the socket does
    not take at once waits, in order, for a writer thread that sends it when it can."""

    def __init__(self, sock: socket.socket, name: str) -> None:
        self.sock = sock
        self.name = name
        self._in = sock.makefile("rb")
        self._cond = threading.Condition()
        self._backlog = bytearray()  # what the socket did not take at once
        self._writing = False  # the writer thread is sending some of the backlog
        self._writer: threading.Thread | None = None
        self.closed = False

    def recv(self) -> Any:
        """The front's next message; EOFError once it has closed the connection."""
        head = self._in.read(4)
        size = int.from_bytes(head, "little") if len(head) == 4 else -1
        data = self._in.read(size) if size >= 0 else b""
        if size < 0 or len(data) < size:
            raise EOFError(f"{self.name} closed its connection")
        return pickle.loads(data)

    def send(self, msg: object) -> None:
        """Write `msg` now if the socket takes it whole, else leave the rest to the writer
        thread (messages leave in the order sent). Nothing happens once the peer is closed."""
        out = memoryview(frame(msg))
        with self._cond:
            if self.closed:
                return
            if not self._backlog and not self._writing:
                try:
                    out = out[self.sock.send(out, socket.MSG_DONTWAIT) :]
                except BlockingIOError:
                    pass
                except OSError:
                    self._close()
                    return
                if not out:
                    return
            self._backlog += out
            if self._writer is None:
                writer = threading.Thread(
                    target=self._write, name=f"duet-wire-{self.name}-out", daemon=True
                )
                writer.start()
                self._writer = writer  # once started: a failed start is tried again
            self._cond.notify()

    def _write(self) -> None:
        name_os_thread()
        while True:
            with self._cond:
                while not self._backlog and not self.closed:
                    self._cond.wait()
                if self.closed:
                    return
                data, self._backlog = bytes(self._backlog), bytearray()
                self._writing = True
            try:
                self.sock.sendall(data)
            except OSError:
                with self._cond:
                    self._close()
                return
            finally:
                with self._cond:
                    self._writing = False

    def close(self) -> None:
        with self._cond:
            self._close()

    def _close(self) -> None:  # under the lock
        if self.closed:
            return
        self.closed = True
        self._cond.notify_all()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the reading thread
        self.sock.close()


class EngineServer:
    """The owner's Unix socket: fronts say hello, send searches and metric observations; the
    owner answers each search and tells every front of each index swap.

    Served by threads, not the event loop: a front's messages are read by a thread of its own
    (`Peer`), which admits each search straight onto the engine's queue (`Engine.enqueue`),
    and the worker that answers it writes the answer to the front's socket. A lone search
    crosses no event loop in the owner, where it crossed it twice (the message in, a task,
    then the worker's answer settled back on the loop and written at the end of its turn)."""

    def __init__(self, app: FastAPI, path: str) -> None:
        self.app = app
        self.path = path
        self._peers: set[Peer] = set()
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._accepting: threading.Thread | None = None
        self._count = itertools.count(1)

    @property
    def pipeline(self) -> SearchPipeline:
        p = self.app.state.pipeline
        if p is None:
            raise NotReady("the model and index are still loading; retry in a moment")
        return cast(SearchPipeline, p)

    async def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.path)
        os.chmod(self.path, 0o600)
        listener.listen(64)
        listener.settimeout(ACCEPT_POLL_S)  # so that `stop` ends the accepting thread
        self._listener = listener
        self._accepting = threading.Thread(
            target=self._accept, name="duet-wire-accept", daemon=True
        )
        self._accepting.start()
        self.pipeline.swap_listeners.append(self._announce)  # called where the swap runs
        log.info("engine socket %s open for the fronts", self.path)

    async def stop(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        if self._accepting is not None:  # no front joins after the peers are closed
            await asyncio.to_thread(self._accepting.join, 4 * ACCEPT_POLL_S)
        p = self.app.state.pipeline
        if p is not None and self._announce in p.swap_listeners:
            p.swap_listeners.remove(self._announce)
        with self._lock:
            peers = list(self._peers)
        for peer in peers:
            peer.close()
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
            "cache": p.caching,
            "decode_side": self.app.state.decoder.side,  # how an upload is decoded
            "timeout_s": p.engine.timeout_s,  # the request deadline (a lost answer's bound)
        }

    def _announce(self, version: str) -> None:
        """Every front learns the version swapped in. Under the lock a hello is made and
        sent under, so no front hears of a version before a hello that names an older one
        (sends never block, so the lock is held briefly)."""
        p = self.pipeline  # and whether its answers may be cached (not while its files are suspect)
        msg = {"op": "version", "version": version, "path": str(p.index.path), "cache": p.caching}
        with self._lock:
            for peer in self._peers:
                peer.send(msg)

    def _accept(self) -> None:
        name_os_thread()
        while (listener := self._listener) is not None:
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:  # closed by `stop`
                return
            conn.setblocking(True)
            peer = Peer(conn, f"front{next(self._count)}")
            with self._lock:
                self._peers.add(peer)
            threading.Thread(
                target=self._serve, args=(peer,), name=f"duet-wire-{peer.name}", daemon=True
            ).start()

    def _serve(self, peer: Peer) -> None:
        name_os_thread()
        try:
            while True:
                try:
                    msg = peer.recv()
                except (EOFError, OSError):
                    return
                op = msg.get("op")
                if op == "search":
                    self._search(msg, peer)
                elif op == "observe":
                    self._observe(msg["items"])
                elif op == "hello":
                    try:
                        with self._lock:  # in order with the swaps' announcements
                            peer.send({"op": "hello", "info": self.info()})
                    except NotReady:
                        return
        except Exception:
            log.exception("serving %s failed; its connection closes", peer.name)
        finally:
            with self._lock:
                self._peers.discard(peer)
            peer.close()

    def _search(self, msg: dict[str, Any], peer: Peer) -> None:
        """Admit one search onto the engine; the worker that answers it writes the answer."""
        rid = msg["id"]
        try:
            p = self.pipeline
            index = p.indexes.take()
        except Exception as exc:
            peer.send(_answer(rid, None, None, exc))
            return

        def done(answer: Answer | None, exc: BaseException | None) -> None:
            try:
                try:
                    peer.send(_answer(rid, answer, index, exc))
                except Exception as failed:  # never a front left waiting without a reply
                    log.exception("answering %s's search %s failed", peer.name, rid)
                    peer.send(_answer(rid, None, None, failed))
            finally:
                # after the answer left: the last lease of a version swapped out closes it
                p.indexes.release(index)

        try:
            image = None
            if msg["kind"] == "image":  # decoded by the front, as this process would
                size, pixels = msg["image"]
                image = Image.frombytes("RGB", size, pixels)
            query, cost = p.work_of(
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
            p.engine.enqueue(query, cost, done)
        except Exception as exc:
            done(None, exc)

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


def _answer(
    rid: int, answer: Answer | None, index: IndexVersion | None, exc: BaseException | None
) -> dict[str, object]:
    """The owner's reply to a front's search: its answer and the version it ran on, or the
    error as data."""
    if exc is not None or answer is None or index is None:
        if not isinstance(exc, DuetError):
            log.error("a front's search failed in the owner", exc_info=exc)
        return {"op": "answer", "id": rid, "error": error_of(exc or RuntimeError("no answer"))}
    return {
        "op": "answer",
        "id": rid,
        "answer": answer,
        "version": index.version,
        "path": str(index.path),
    }


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
