"""The search pipeline, event-loop side: plan -> cache -> admission -> (worker) -> response.

The event loop resolves a request's options into a plan, checks the cache and admission;
everything after that (encoding, FAISS, re-ranking, item look-ups) runs in one hop on the
inference engine's workers (`app.engine`, running `app.batch.BatchWorker.run_batch`),
batched across the requests that are waiting. The re-ranker is chosen per request
(`SearchOptions.reranker`, from the registry in `models.rerankers`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
import unicodedata
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal, NamedTuple

from PIL import Image
from pydantic import ConfigDict, TypeAdapter

from app.answers import hits_of, served_match
from app.batch import Answer, BatchWorker, Query, RerankPlan
from app.cache import ResilientCache, cache_key
from app.engine import Engine
from app.errors import RerankerUnavailable, ValidationFailed
from app.metrics import Metrics
from app.schemas import SearchOptions, SearchResponse
from app.versions import ServedIndex
from app.work import CaptionsUnread
from models import rerankers
from models.device_step import DeviceStep, text_ids_of
from models.late import DEFAULT_THETA
from models.protocols import JointEncoder
from models.rerankers import REGISTRY
from models.step_graphs import graph_counts
from store import ann
from store.indexio import IndexVersion

log = logging.getLogger("duet.pipeline")


class Served(NamedTuple):
    """The JSON a search's answer is served as (and cached as, when complete)."""

    json: str


def _cached_response(raw: str) -> SearchResponse:
    """A cache entry as the answer it was (its timings, the look-up's time, filled in by
    the reader); raises ValueError, KeyError or TypeError for an entry that is not one."""
    body = json.loads(raw)
    return SearchResponse(
        hits=body["hits"],
        timings_ms={},
        index_version=body["index_version"],
        cached=True,
        degraded=False,
        reranked=body.get("reranked"),
        unknown_words=body.get("unknown_words", []),
    )


# JSON as pydantic writes a model's: a NaN or infinity (in an item's meta, say) as null, which
# every JSON parser reads, not as NaN, which browsers' JSON.parse refuses
_JSON = TypeAdapter(dict[str, Any], config=ConfigDict(ser_json_inf_nan="null"))


def render(**fields: Any) -> str:
    """A `SearchResponse` as JSON from its fields as plain values (`hits_of`'s dicts): what
    pydantic's `model_dump_json` of the model writes, by pydantic's own serialiser, without
    making and checking the models first (tests/test_answers.py holds the two equal)."""
    return _JSON.dump_json({name: fields[name] for name in SearchResponse.model_fields}).decode()


class SearchPipeline:
    """Owns the loaded model, index, cache and re-rank batcher for one running service.

    Each search leases the index version current when it starts (`ServedIndex.lease`) and
    uses only that one, so `swap_index` can replace the version while requests are in flight.
    """

    def __init__(
        self,
        model: JointEncoder,
        index: IndexVersion,
        cache: ResilientCache,
        metrics: Metrics,
        *,
        fusion_lambda: float,
        theta: float = DEFAULT_THETA,
        workers: int = 1,
        torch_threads: int | None = None,
        cores: int = 1,
        worker_nice: int = 10,
        max_batch: int = 64,
        rerank_max_batch: int = 64,
        max_queue: int = 1024,
        timeout_s: float = 2.0,
        index_nprobe: int = ann.DEFAULT_NPROBE,
        index_ef_search: int = ann.DEFAULT_EF_SEARCH,
        step: DeviceStep | None = None,
        measure_budget: bool = False,
        thread_tuning: bool = True,
    ) -> None:
        self.model = model
        self.indexes = ServedIndex(index)
        self.search_knobs = ann.SearchKnobs(nprobe=index_nprobe, ef_search=index_ef_search)
        self.cache, self.metrics = cache, metrics
        self.fusion_lambda, self.theta = fusion_lambda, theta
        # the registry's re-rankers this model can run (what DUET_RERANKER configured)
        menu = rerankers.menu(model)
        self.rerankers, self._unavailable = menu.available, menu.why
        self.default_reranker = menu.default  # a request that names no re-ranker gets this one
        self.worker = BatchWorker(
            model,
            menu.scorers,
            metrics,
            search_knobs=self.search_knobs,
            rerank_max_batch=rerank_max_batch,
            cores=cores,
            torch_threads=torch_threads,
            worker_nice=worker_nice,
            step=step,
        )
        self._measure_budget = measure_budget and step is not None
        # the host path measures a heavy (Hugging Face) cross-encoder's pairs per call
        self.worker.heavy_deadline_s = timeout_s if measure_budget and step is None else None
        worker = self.worker
        self.engine: Engine[Query, Answer] = Engine(
            self.worker.run_batch,
            workers=workers,
            max_batch=max_batch,
            max_queue=max_queue,
            timeout_s=timeout_s,
            on_shed=lambda why: metrics.shed.labels(reason=why).inc(),
            on_batch=metrics.engine_batch_size.observe,
            init_worker=self.worker.init_thread,
            # the CPU layout shares the cores among busy workers; on a GPU host torch's CPU
            # threads do little and re-setting them per batch costs time
            before_batch=self.worker.set_threads if thread_tuning else None,
            # the GPU layout cuts batches by pairs and prices each batch's fixed part
            units=(lambda q: q.pairs) if step is not None else None,
            max_units=rerank_max_batch if step is not None else None,
            batch_cost_s=(lambda: worker.batch_cost.fixed_s) if step is not None else None,
        )
        self.swap_listeners: list[Callable[[str], None]] = []
        self.caching = True  # off while the served version's files are suspect (app.reload)
        self._publish(index)
        metrics.queue_depth.set_function(lambda: self.engine.depth)
        metrics.queue_capacity.set(max_queue)

    @property
    def index(self) -> IndexVersion:
        """The version new requests will use."""
        return self.indexes.current

    def _publish(self, index: IndexVersion) -> None:
        self.metrics.index_items.labels(modality="image").set(index.image_index.ntotal)
        self.metrics.index_items.labels(modality="text").set(index.text_index.ntotal)
        for kind, n in graph_counts(getattr(index.resident, "graphs", None)).items():
            self.metrics.cuda_graphs.labels(queries=kind).set(n)
        self.metrics.index_info.labels(version=index.version).set(1)

    def swap_index(self, new: IndexVersion) -> IndexVersion:
        """Serve `new` from the next request on; in-flight requests finish on the old one.
        The old version's `duet_index_info` series is removed, so exactly one version shows."""
        old = self.indexes.swap(new)
        self._publish(new)
        for listener in self.swap_listeners:  # the process layout's fronts learn the version
            listener(new.version)
        if old.version != new.version:
            self.metrics.index_info.remove(old.version)
        return old

    def prepare(self, index: IndexVersion) -> None:
        """Make `index` ready to serve before it is swapped in (GPU layout: its resident
        tables on the step's device, its graphs captured). Runs in a thread."""
        self.worker.prepare(index)

    async def start(self) -> None:
        """Time one query and a few pairs (the first estimates of the cost model, and warm
        kernels for the first request), start the workers. In the GPU layout: the index's
        tables onto the device first, then the step's pair budget and every shape built."""
        await asyncio.to_thread(self.worker.prepare, self.index)
        await asyncio.to_thread(self.worker.warm_up, self.index)
        if self.worker.step is not None:
            await asyncio.to_thread(
                self.worker.warm_step,
                self.index,
                self._measure_budget,
                self.engine.max_batch,
                120.0,
            )
            self.engine.max_units = self.worker.rerank_max_batch
            self._publish(self.index)  # its graphs, captured by now
        self.engine.start()

    async def stop(self) -> None:
        await asyncio.to_thread(self.engine.stop)
        await self.cache.close()

    def _ids(self, text: str | None) -> list[int] | None:
        """A text query's token ids when the device step will read them (tokenised here, on
        the event loop, so the thread feeding the device does not)."""
        if text is None or self.worker.step is None:
            return None
        ids = text_ids_of(self.model)
        return None if ids is None else ids(text)

    def _reading(self, text: str) -> str:
        """What the model reads of a text (its words, "and" as "with"), else the text."""
        reading = getattr(self.model, "query_identity", None)
        return str(reading(text)) if callable(reading) else text

    def _unknown(self, text: str | None) -> list[str]:
        """The query's words outside the model's vocabulary (none for an image query)."""
        words = getattr(self.model, "unknown_words", None)
        return list(words(text)) if text is not None and callable(words) else []

    def _identity(self, text: str) -> str:
        """The cache's key for a text query: what the model reads of it (the builtin word
        tokenizer: its words, aliases read as their word), else the text exactly; 422 when
        nothing is readable."""
        identity = getattr(self.model, "query_identity", None)
        key = identity(text) if callable(identity) else text
        if not any(ch.isalnum() or unicodedata.category(ch).startswith(("S", "P")) for ch in key):
            builtin = ", or characters that are no letter or digit for the builtin model"
            raise ValidationFailed(
                "query: has no words the model can read (only spaces, control or invisible "
                f"characters{builtin if key != text else ''})",
                loc=("body", "query"),
            )
        return key

    # -- helpers -------------------------------------------------------------
    @contextmanager
    def _stage(self, name: str, timings: dict[str, float]) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            dt = time.perf_counter() - t0
            timings[name] = round(timings.get(name, 0.0) + dt * 1000, 3)
            self.metrics.stage_seconds.labels(stage=name).observe(dt)

    def plan(self, opts: SearchOptions) -> RerankPlan:
        """The request's options resolved against the service's defaults; a re-ranker the
        API names but this service cannot run is refused here."""
        r = opts.reranker_or(self.default_reranker)
        if r not in self.rerankers:
            why = self._unavailable.get(r, "is not available in this deployment")
            raise RerankerUnavailable(
                f"reranker: the {r} re-ranker {why}; available: {', '.join(self.rerankers)} "
                f"(the API knows {', '.join(rerankers.names())})"
            )
        if opts.uses_default_reranker:  # options the schema could not check without it
            try:
                opts.check_for(r)
            except ValueError as exc:
                raise ValidationFailed(str(exc)) from exc
        if r == rerankers.NONE:
            return RerankPlan("none", "none", None, None)
        entry = REGISTRY[r]
        fusion = opts.fusion or entry.fusion
        lam = self.fusion_lambda if opts.lambda_ is None else opts.lambda_
        theta = self.theta if opts.theta is None else opts.theta
        return RerankPlan(
            r,
            fusion,
            None if fusion == "none" else lam,
            theta if "theta" in entry.options else None,
        )

    def _key(
        self, index: IndexVersion, endpoint: str, query: str, opts: SearchOptions, plan: RerankPlan
    ) -> str:
        """The request's identity, including the version it runs on: no entry outlives a swap.
        Options enter resolved, so `rerank: false` and `reranker: none` share an entry."""
        return cache_key(
            model=self.model.fingerprint,
            # device kind and cross-encoder precision: replicas sharing one Redis may differ
            numerics=getattr(self.model, "numerics", None),
            index=index.version,
            endpoint=endpoint,
            query=query,
            top_k=opts.top_k,
            candidates=opts.candidates if plan.reranks else None,
            reranker=plan.reranker,
            fusion=plan.fusion,
            lam=plan.lam,
            theta=plan.theta,
        )

    async def _cached(self, key: str, timings: dict[str, float]) -> Served | None:
        with self._stage("cache", timings):
            resp = await self.cache.get(key, _cached_response)
        if resp is None:
            return None
        resp.timings_ms = {**timings, "total": round(sum(timings.values()), 3)}
        return Served(resp.model_dump_json())

    # -- endpoints (event loop) -------------------------------------------------------
    async def search_text(self, query: str, opts: SearchOptions) -> Served:
        """A sentence finds images."""
        with self.indexes.lease() as index:  # one version for the whole request
            return await self._search(index, "text", query, None, self._identity(query), opts)

    async def search_image(self, data: bytes, image: Image.Image, opts: SearchOptions) -> Served:
        """An image finds captions."""
        with self.indexes.lease() as index:
            return await self._search(
                index, "image", None, image, hashlib.sha256(data).hexdigest(), opts
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
        """The model work of one search on the engine (admission, batching, the worker):
        its answer and the index version it ran on."""
        query, cost = self.work_of(index, kind, text, image, plan, m, top_k)
        return await self.engine.submit(query, cost), index.version

    def work_of(
        self,
        index: IndexVersion,
        kind: Literal["text", "image"],
        text: str | None,
        image: Image.Image | None,
        plan: RerankPlan,
        m: int,
        top_k: int,
        ids: list[int] | None = None,
        look_up: bool = True,
    ) -> tuple[Query, float]:
        """One search's model work as the engine takes it, and its estimated seconds. The
        process layout's owner (`app.owner`) gets the text's token ids (`ids`) made by a
        front, which looks the hits' items up itself (`look_up` False: the answer's `meta`
        and `captions` are left empty)."""
        if ids is None or self.worker.step is None:
            ids = self._ids(text)
        query = Query(kind, text, image, index, plan, m, top_k, ids, look_up)
        return query, self.worker.cost_of(query)

    async def _search(
        self,
        index: IndexVersion,
        kind: Literal["text", "image"],
        text: str | None,
        image: Image.Image | None,
        identity: str,
        opts: SearchOptions,
    ) -> Served:
        t0 = time.perf_counter()
        timings: dict[str, float] = {}
        plan = self.plan(opts)
        key = self._key(index, kind, identity, opts, plan)
        if (hit := await self._cached(key, timings)) is not None:
            return hit
        m = opts.candidates if plan.reranks else opts.top_k
        answer, version = await self.run(index, kind, text, image, plan, m, opts.top_k)
        timings.update(answer.timings)
        for stage, ms in answer.timings.items():
            self.metrics.stage_seconds.labels(stage=stage).observe(ms / 1000)
        if answer.degraded:
            self.metrics.degraded.inc()
        judged = served_match(plan.reranker, plan.fusion, plan.lam, str(self.model.fingerprint))
        reading = None if text is None else self._reading(text)
        hits, dropped = hits_of(answer, kind, reading, judged)
        if dropped:
            log.error("left out %d hits with non-finite scores (index %s)", dropped, version)
        timings["total"] = round((time.perf_counter() - t0) * 1000, 3)
        # rendered once, for the client and the cache alike
        served = Served(
            render(
                hits=hits,
                timings_ms=timings,
                index_version=version,
                cached=False,
                degraded=answer.degraded,
                reranked=answer.reranked,
                unknown_words=self._unknown(text),
            )
        )
        # a later request with time to spare gets the full answer, one whose scores have
        # recovered every hit, one whose item store reads (again) its items and captions
        unread = isinstance(answer.captions, CaptionsUnread) or not self.caching
        if not (answer.degraded or dropped or unread):
            await self.cache.set(key, served.json)
        return served
