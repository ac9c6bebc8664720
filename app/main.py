"""create_app(settings): the FastAPI application; nothing is built at import time."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.cache import CacheBackend, LRUCache, RedisCache, ResilientCache
from app.config import Settings
from app.engine import available_cores
from app.errors import install_handlers
from app.heap import freeze_startup_heap, thaw_heap
from app.imaging import ImageDecoder
from app.limits import BodyLimit
from app.liveness import Heartbeat
from app.metrics import Metrics, watch_caption_states
from app.pipeline import SearchPipeline
from app.reload import IndexReloader, load_checked
from app.routes import admin, health, search, ui
from app.schemas import MAX_QUERY_CHARS
from models.device_step import step_for
from models.images import side_of
from models.loading import load_models
from models.protocols import JointEncoder
from store.indexio import IndexVersion, resolve_current

log = logging.getLogger("duet.app")


@dataclass
class Resources:
    """What the service needs loaded before it can answer searches."""

    model: JointEncoder
    index: IndexVersion


def load_resources(settings: Settings) -> Resources:
    """Load the models (DUET_ENCODER, DUET_RERANKER), then the current index; refuse an index
    built by other models."""
    model = load_models(
        settings.encoder,
        settings.reranker,
        settings.model_dir,
        settings.device,
        precision=settings.precision,
    )
    index = load_checked(resolve_current(settings.index_dir), model)
    log.info(
        "loaded model %s (re-rankers %s, default %s) and index %s (%d images, %d texts)",
        model.fingerprint,
        ", ".join(model.menu.available),
        model.menu.default,
        index.version,
        index.image_index.ntotal,
        index.text_index.ntotal,
    )
    return Resources(model, index)


def _cache_backend(settings: Settings) -> CacheBackend:
    if settings.redis_url:
        return RedisCache(
            settings.redis_url, settings.cache_ttl_s, settings.redis_timeout_ms / 1000
        )
    return LRUCache(settings.cache_max_entries, settings.cache_ttl_s)


def _on_cuda(model: object) -> bool:
    return str(getattr(model, "device", "cpu")).startswith("cuda")


def _auto_gpu(settings: Settings, model: object) -> bool:
    """What an `auto` serving setting (fronts, the paced cap) keys on: the model on CUDA
    and the GPU layout not refused (DUET_LAYOUT=cpu)."""
    return _on_cuda(model) and settings.layout != "cpu"


AUTO_FRONTS_MAX = 6  # measured: six fronts on a 16-core H100 host (docs/gpu.md)


def front_count(settings: Settings, model: object, cores: int | None = None) -> int:
    """How many front processes `duet serve` starts (DUET_FRONTENDS). `auto`: none on the
    CPU, where the model wants every core and one process keeps up with it; with the model
    on CUDA (and not DUET_LAYOUT=cpu) half the cores less one, at most six, since one
    process's HTTP, validation and JSON, not the GPU, capped the service there (~550 req/s
    on an H100 host, whatever the mode). Fewer than two fronts are not worth the hop."""
    if settings.frontends != "auto":
        return settings.frontends
    if not _auto_gpu(settings, model):
        return 0
    n = min(AUTO_FRONTS_MAX, (cores or available_cores()) // 2 - 1)
    return n if n >= 2 else 0


AUTO_QUEUE_TARGET_MS = 500.0


def queue_target_ms(settings: Settings, model: object) -> float:
    """DUET_HTTP_QUEUE_TARGET_MS as served (`app.pace.Pace`): `auto` paces the in-flight
    cap with the model on CUDA only."""
    if settings.http_queue_target_ms != "auto":
        return settings.http_queue_target_ms
    return AUTO_QUEUE_TARGET_MS if _auto_gpu(settings, model) else 0.0


def _pipeline(
    settings: Settings, res: Resources, cache: ResilientCache, metrics: Metrics
) -> SearchPipeline:
    """The search pipeline over the loaded model and index, sized for where the model runs."""
    on_gpu = _on_cuda(res.model)
    gpu_layout = settings.layout == "gpu" or (settings.layout == "auto" and on_gpu)
    step = step_for(res.model, graphs=settings.cuda_graphs) if gpu_layout else None
    if gpu_layout and step is None:
        log.warning("DUET_LAYOUT=gpu needs the builtin model as encoder: host path only")
    # the GPU layout: two workers (one prepares and looks up while the other waits on the
    # device), at normal priority, no per-batch thread tuning
    chosen = settings.model_fields_set
    watch_caption_states(metrics, res.model)
    return SearchPipeline(
        res.model,
        res.index,
        cache,
        metrics,
        fusion_lambda=settings.rerank_fusion_lambda,
        theta=settings.rerank_theta,
        workers=settings.workers or (2 if step else 1 if on_gpu else available_cores()),
        torch_threads=settings.torch_threads,
        cores=available_cores(),
        worker_nice=0 if step and "worker_nice" not in chosen else settings.worker_nice,
        max_batch=settings.max_batch,
        max_queue=settings.max_queue,
        rerank_max_batch=settings.rerank_max_batch or (4096 if on_gpu else 64),
        timeout_s=settings.request_timeout_ms / 1000,
        index_nprobe=settings.index_nprobe,
        index_ef_search=settings.index_ef_search,
        step=step,
        measure_budget=settings.rerank_max_batch is None,
        thread_tuning=step is None,
    )


def _lifespan(
    settings: Settings, resources: Resources | None, metrics: Metrics
) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """Start-up (load unless given, start the pipeline and the index poller) and shut-down."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        res = (
            resources
            if resources is not None
            else await asyncio.to_thread(load_resources, settings)
        )
        cache = ResilientCache(
            _cache_backend(settings), metrics, timeout_s=settings.redis_timeout_ms / 1000
        )
        await cache.check()
        pipeline = _pipeline(settings, res, cache, metrics)
        # uploads decoded as the builder decoded the corpus for these models
        app.state.decoder.side = side_of(res.model)
        await pipeline.start()
        reloader = IndexReloader(
            pipeline,
            settings.index_dir,
            metrics,
            settings.index_poll_s,
            lambda index: ui.images_unserved(index, settings),
        )
        await reloader.remember_served()  # its files as checked: a change is checked again
        poller = (
            asyncio.create_task(reloader.poll_forever(), name="index-poller")
            if settings.index_poll_s > 0
            else None
        )
        app.state.pipeline = pipeline
        app.state.reloader = reloader
        engine_server = None
        if (path := getattr(app.state, "engine_socket", None)) is not None:
            from app.owner import EngineServer  # the process layout's owner

            engine_server = EngineServer(app, path)
            await engine_server.start()
        beats = asyncio.create_task(app.state.heartbeat.run(), name="liveness-heartbeat")
        metrics.ready.set(1)
        frozen = freeze_startup_heap(settings.gc_freeze)
        with pipeline.indexes.lease() as index:
            if why := ui.images_unserved(index, settings):
                log.warning("GET /images/{id} cannot serve this version's images: %s", why)
        log.info(
            "duet ready (cache: %s, index poll: %s)",
            cache.backend.where,
            f"every {settings.index_poll_s:g}s" if poller else "off",
        )
        try:
            yield
        finally:
            thaw_heap(frozen)
            # the fronts first: they drain their requests through the owner, still up
            stop_fronts = getattr(app.state, "stop_fronts", None)
            if stop_fronts is not None:
                await asyncio.to_thread(stop_fronts)
            if engine_server is not None:
                await engine_server.stop()
                # its private folder, here: after a SIGTERM uvicorn ends the process by the
                # signal, and `duet serve`'s own clean-up never runs
                shutil.rmtree(os.path.dirname(engine_server.path), ignore_errors=True)
            app.state.pipeline = None
            app.state.reloader = None
            metrics.ready.set(0)
            beats.cancel()
            if poller is not None:
                poller.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await poller
            await pipeline.stop()
            app.state.decoder.close()

    return lifespan


def create_app(
    settings: Settings, resources: Resources | None = None, *, front: bool = False
) -> FastAPI:
    """Build the app; `resources` may be passed in (already loaded), else they load at start-up.
    `front`: the search routes alone, for a front of the process layout (`app.fronts`, which
    adds its lifespan and passes every other path through to the owner)."""
    metrics = Metrics()
    app = FastAPI(
        title="duet",
        version="0.1.0",
        lifespan=_lifespan(settings, resources, metrics),
        summary="Image-text retrieval: dot-product top-M, cross-encoder re-rank",
        # a front passes the documents through to the owner, whose routes they describe
        # (a front's own would list its search routes alone); /docs and /redoc are the UI
        # router's (FastAPI's pages, with a note for a browser that cannot reach their CDN)
        openapi_url=None if front else "/openapi.json",
        docs_url=None,
        redoc_url=None,
    )
    app.state.settings = settings
    app.state.decoder = ImageDecoder(
        settings.max_image_bytes, settings.max_image_pixels, settings.decode_pixels_in_flight
    )
    app.state.metrics = metrics
    app.state.heartbeat = Heartbeat()  # the loop's beat, read by the health port (app.liveness)
    app.state.pipeline = None
    app.state.reloader = None
    install_handlers(app)
    search.refresh_docs()  # the re-rankers registered by now are the ones served
    routers = [search.router] if front else [search.router, health.router, admin.router, ui.router]
    for router in routers:
        app.include_router(router)
    search.document_bodies(app)

    app.add_middleware(search.TextSearchASGI, fastapi=app)  # inside BodyLimit, see its doc
    app.add_middleware(BodyLimit, limit_for=body_limits(settings))
    # duet's routes and FastAPI's own (/openapi.json); the app's list holds
    # the included routers as wrappers, which have no path to label with
    own = [r for r in app.router.routes if isinstance(getattr(r, "path", None), str)]
    routes = [*own, *(route for router in routers for route in router.routes)]
    app.add_middleware(_ObserveRequests, metrics=metrics, routes=routes)
    return app


def body_limits(settings: Settings) -> Callable[[str], tuple[int, str]]:
    """A path's body limit in bytes (`app.limits.BodyLimit`) and the words that say where it
    comes from: /search/image's is DUET_MAX_IMAGE_BYTES plus what base64 and multipart
    framing add (about a third) and room for the other fields; every other route's is
    DUET_MAX_BODY_BYTES."""
    image = (
        settings.max_image_bytes * 4 // 3 + 65536,
        f"an image of at most {settings.max_image_bytes} bytes (DUET_MAX_IMAGE_BYTES), plus a "
        "third for base64 or multipart framing and 64 KiB for the other fields",
    )
    text = (
        settings.max_body_bytes,
        f"DUET_MAX_BODY_BYTES (a query itself may be at most {MAX_QUERY_CHARS} characters)",
    )
    other = (settings.max_body_bytes, "DUET_MAX_BODY_BYTES")
    by_path = {"/search/image": image, "/search/text": text}
    return lambda path: by_path.get(path, other)


class _ObserveRequests:
    """duet_request_seconds per route and status, as a plain ASGI middleware (Starlette's
    BaseHTTPMiddleware costs a task and a stream per request)."""

    def __init__(self, app: ASGIApp, metrics: Metrics, routes: list[BaseRoute]) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = routes  # duet's own, matched when a request was answered before routing

    def _endpoint(self, scope: Scope) -> str:
        """The route's path, as the router set it; for a request answered before routing (a
        413 of `BodyLimit`) the path of the route it was sent to, when one takes it; else
        "other" (a 404, say). A path parameter is named without its converter."""
        route = scope.get("route")
        if route is None:
            route = next((r for r in self.routes if r.matches(scope)[0] is not Match.NONE), None)
        # the path as documented: /images/{item_id}, not the router's {item_id:path}
        return str(getattr(route, "path_format", None) or getattr(route, "path", "other"))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = 500  # an exception escaping the handlers still counts as a 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            endpoint = self._endpoint(scope)
            if endpoint != "/metrics":
                self.metrics.request_seconds.labels(endpoint=endpoint, status=str(status)).observe(
                    time.perf_counter() - t0
                )
