"""The process layout (`DUET_FRONTENDS=N`): N front processes serve HTTP, one owns the model.

One Python process tops out at a few hundred to a couple of thousand requests a second of
HTTP parsing, validation, JSON and cache look-ups, while a GPU running the device step
(`models.device_step`) can answer thousands. So with `DUET_FRONTENDS=N`, `duet serve` starts:

* the **owner** (the `duet serve` process itself): loads the model and the index and runs the
  inference engine, exactly as a single-process service does, on a loopback port of its own,
  plus a Unix socket (`app.owner.EngineServer`) over which fronts hand it their searches'
  model work;
* **N fronts** (`duet serve-front`) on the public port, each on a listening socket of its
  own (SO_REUSEPORT: the kernel spreads new connections evenly among them; one shared
  socket where the platform has none, `duet.commands.front_processes.public_sockets`). A front
  validates each search, decodes and checks an uploaded image (the owner gets the decoded
  picture, at the side its models read, not the upload), tokenises, reads and writes
  the cache, looks the hits' items up in the index version's item store and writes the
  JSON; only the model work (`SearchPipeline.run`: query in, ranked rows with scores out)
  crosses to the owner, as one length-prefixed pickle each way on one connection per front.
  Every other path (`/readyz`, `/metrics`, `/admin/*`, `/images/*`, the page) is passed
  through to the owner, so there is one readiness, one set of metrics and one reload for the
  service.

A front's own request metrics (`duet_request_seconds`, `duet_cache_requests`,
`duet_cache_write_errors`, `duet_stage_seconds`, `duet_degraded_requests`,
`duet_shed_requests`) are sent to the owner a few times a second and counted there. The
owner tells every front the new index version as it swaps one in, and each answer carries
the version it ran on, so cache keys follow swaps within one message.
The peers are the service's own processes on one host (the socket lives in a private
directory), which is why pickle is an acceptable wire format here.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Literal, cast

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response
from PIL import Image
from starlette.routing import Route

from app.batch import Answer, RerankPlan
from app.errors import NotReady
from app.heap import freeze_startup_heap, thaw_heap
from app.metrics import Metrics
from app.owner import FORWARDED, raise_error
from app.pipeline import SearchPipeline
from app.remote import RemoteEngine, owner_pid
from app.stores import Stores
from app.work import items_of, ms
from models.tokenizer import WordTokenizer
from store.indexio import IndexVersion

log = logging.getLogger("duet.fronts")

SOCKET_ENV = "DUET_FRONT_SOCKET"  # the owner's Unix socket, for a front
OWNER_ENV = "DUET_FRONT_OWNER"  # the owner's loopback URL, for a front
FD_ENV = "DUET_FRONT_FD"  # the front's listening socket on the public port, inherited


# -- the front's side -----------------------------------------------------------------------
class _PassedThrough:
    path = "passed-through"  # no /search/ route: a front's metrics leave it to the owner


_PASSED_THROUGH = _PassedThrough()


class _Forward:
    """Stands in for a front's metric family: what is observed goes to the owner."""

    def __init__(self, name: str, sink: list[Any], labels: tuple[tuple[str, str], ...] = ()):
        self._name, self._sink, self._labels = name, sink, labels

    def labels(self, **kw: str) -> _Forward:
        return _Forward(self._name, self._sink, tuple(sorted(kw.items())))

    def observe(self, value: float) -> None:
        # a passed-through request is counted once, by the owner that answers it
        if self._name == "request_seconds" and not dict(self._labels).get(
            "endpoint", ""
        ).startswith("/search/"):
            return
        self._sink.append((self._name, self._labels, "observe", value))

    def inc(self, value: float = 1.0) -> None:
        self._sink.append((self._name, self._labels, "inc", value))


class _RemoteModel:
    """What a front's pipeline reads of the model, from the owner's hello."""

    def __init__(self, info: dict[str, Any]) -> None:
        self.fingerprint = info["fingerprint"]
        self.numerics = info["numerics"]
        vocab = info.get("vocab")
        self.tokenizer = (
            None if vocab is None else WordTokenizer(list(vocab["words"]), int(vocab["max_len"]))
        )
        self.by_words = bool(info.get("by_words")) and self.tokenizer is not None

    def unknown_words(self, text: str) -> list[str]:
        return [] if self.tokenizer is None else self.tokenizer.unknown_words(text)

    def content_words(self, text: str) -> list[str] | None:
        return None if self.tokenizer is None else self.tokenizer.content_words(text)

    def too_long(self, text: str) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.too_long(text)

    def query_identity(self, text: str) -> str:
        if not self.by_words or self.tokenizer is None:
            return text
        return self.tokenizer.reading(text)


@dataclass
class _Version:
    """A front's view of the served index: its version (for cache keys and answers)."""

    version: str


class FrontPipeline(SearchPipeline):
    """`SearchPipeline` as a front runs it: planning, cache keys, the cache and the response
    are the single-process code; `run` (the model work) goes to the owner."""

    def __init__(self, remote: RemoteEngine, cache: Any, metrics: Metrics) -> None:
        # no model, index, worker or engine here: only what the shared methods read
        info = remote.info
        self.remote = remote
        self.remote_model = _RemoteModel(info)
        self.model = self.remote_model  # type: ignore[assignment]
        self.cache = cache
        self.metrics = metrics
        self.fusion_lambda = info["fusion_lambda"]
        self.theta = info["theta"]
        self.rerankers = tuple(info["rerankers"])
        self.default_reranker = info["default_reranker"]
        self._unavailable = dict(info["unavailable"])
        self._served = _Version(info["version"])
        # versions the owner swapped out: an answer that ran on one and arrives after the
        # swap's announcement (the owner's workers write answers, the swap its announcement,
        # in no set order) must not take this front back to it
        self._retired: set[str] = set()
        self.stores = Stores(info["path"])
        self.caching = bool(info.get("cache", True))
        self._running = 0  # searches in `run` now
        remote.on_version = self._swapped

    def _swapped(self, version: str, path: str, cache: bool = True) -> None:
        """The owner's announcement: a version swapped in, or the one served reopened or
        its files found changed (answers not cached meanwhile)."""
        self.caching = cache
        self._serve(version)
        self.stores.swapped(path)

    def _serve(self, version: str) -> None:
        self._retired.add(self._served.version)
        self._retired.discard(version)  # served again (a reload back to it)
        self._served = _Version(version)

    @property
    def index(self) -> IndexVersion:
        return cast(IndexVersion, self._served)

    async def search_text(self, query: str, opts: Any) -> Any:
        return await self._search(self.index, "text", query, None, self._identity(query), opts)

    async def search_image(self, data: bytes, image: Image.Image, opts: Any) -> Any:
        return await self._search(
            self.index, "image", None, image, hashlib.sha256(data).hexdigest(), opts
        )

    async def run(
        self,
        index: IndexVersion,
        kind: Literal["text", "image"],
        text: str | None,
        image: Image.Image | None,
        plan: RerankPlan,
        m: int,
        top_k: int,
    ) -> tuple[Answer, str]:
        self._running += 1  # this front's searches between asking the owner and their hits
        try:
            tok = self.remote_model.tokenizer
            reply = await self.remote.search(
                kind=kind,
                text=text,
                ids=None if text is None or tok is None else tok.ids(text),  # tokenised here
                # decoded here at the side the owner's models read: the owner does not decode it
                image=None if image is None else (image.size, image.tobytes()),
                plan=plan,
                m=m,
                top_k=top_k,
            )
            if "error" in reply:
                raise_error(reply["error"])
            if reply["version"] != self._served.version and reply["version"] not in self._retired:
                self._serve(reply["version"])  # one the announcement has not told of yet
            answer: Answer = reply["answer"]
            t0 = time.perf_counter()
            rows = [r for r, _, _, _ in answer.ranked]
            with self.stores.use(reply["path"]) as store:
                # on the loop if all is decoded or the search is alone (a thread hop costs what
                # its reads do); else off the loop, which the others need
                if self._running == 1 or store.holds(kind, rows):
                    answer.meta, answer.captions = items_of(store, kind, rows)
                else:
                    answer.meta, answer.captions = await asyncio.to_thread(
                        items_of, store, kind, rows
                    )
            looked = ms(time.perf_counter() - t0)  # and what the owner looked up for its re-ranker
            answer.timings["lookup"] = answer.timings.get("lookup", 0.0) + looked
            return answer, reply["version"]
        finally:
            self._running -= 1

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        await self.cache.close()
        self.stores.close()


async def _orphaned(parent: int) -> None:
    """End this front (as SIGTERM would) once the owner that started it is gone."""
    import signal

    while os.getppid() == parent:
        await asyncio.sleep(1.0)
    log.warning("the owner process is gone; this front stops")
    os.kill(os.getpid(), signal.SIGTERM)


# -- the front's app --------------------------------------------------------------------------
def create_front_app(settings: Any, socket_path: str, owner_url: str) -> FastAPI:
    """The service's app as a front serves it: the search routes run here (their model work on
    the owner), every other path is passed through to the owner."""
    from app.cache import ResilientCache
    from app.main import _cache_backend, create_app

    app = create_app(settings, front=True)
    metrics: Metrics = app.state.metrics
    remote = RemoteEngine(socket_path)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per passed-through call
    for name in FORWARDED:  # counted by the owner, whose /metrics is the service's
        setattr(metrics, name, _Forward(name, remote.observed))
    client = httpx.AsyncClient(base_url=owner_url, timeout=None)

    async def passthrough(request: Request) -> Response:
        # counted by the owner that answers it, not also here as the route it was sent to
        # (a GET /search/text, 405, was counted twice)
        request.scope["route"] = _PASSED_THROUGH
        url = httpx.URL(path=request.url.path, query=request.url.query.encode())
        headers = [(k, v) for k, v in request.headers.raw if k.lower() != b"host"]
        try:
            r = await client.request(
                request.method, url, headers=headers, content=await request.body()
            )
        except httpx.TransportError as exc:
            raise NotReady(
                "the process that owns the model is not answering; retry in a moment"
            ) from exc
        # the body's length is the body's own, set anew, but for HEAD, which has none: the
        # owner's says what a GET would send (a link checker reads it)
        drop = {"transfer-encoding", "connection"}
        drop |= set() if request.method == "HEAD" else {"content-length"}
        return Response(
            r.content,
            r.status_code,
            headers={k: v for k, v in r.headers.items() if k.lower() not in drop},
        )

    app.router.routes.append(
        Route(
            "/{path:path}",
            passthrough,
            methods=["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"],
        )
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await remote.connect()
        cache = ResilientCache(
            _cache_backend(settings), metrics, timeout_s=settings.redis_timeout_ms / 1000
        )
        front = app.state.pipeline = FrontPipeline(remote, cache, metrics)
        # the owner encodes the picture this front decodes: at the side the owner's models read
        app.state.decoder.side = int(remote.info["decode_side"])
        watchdog = asyncio.create_task(_orphaned(owner_pid()), name="front-watchdog")
        frozen = freeze_startup_heap(settings.gc_freeze)
        log.info("front %d ready (owner %s)", os.getpid(), owner_url)
        try:
            yield
        finally:
            thaw_heap(frozen)
            watchdog.cancel()
            app.state.pipeline = None
            await front.stop()  # its cache and item stores
            await remote.close()
            await client.aclose()
            app.state.decoder.close()

    app.router.lifespan_context = lifespan
    return app
