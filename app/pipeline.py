"""The search pipeline: cache -> encode query -> FAISS top-M -> re-rank -> fuse -> top-k.

The event loop checks the cache and admission; everything after that (encoding, FAISS,
re-ranking, item look-ups) runs in one hop on the inference engine's workers (`app.engine`),
batched across the requests that are waiting: queries are encoded and searched together,
cross-encoder pairs go in chunks of up to `rerank_max_batch`. The re-ranker is chosen per
request (`SearchOptions.reranker`). When a request's deadline cannot fit all its candidates,
it re-ranks as many as fit (best by dot product first) and says so (`degraded`).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import logging
import math
import os
import threading
import time
import unicodedata
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
from PIL import Image

from app.cache import ResilientCache, cache_key
from app.engine import Engine, Throughput, Ticket
from app.errors import RerankerUnavailable, ValidationFailed
from app.metrics import Metrics
from app.schemas import RERANKERS, Hit, SearchOptions, SearchResponse, image_url
from app.versions import ServedIndex
from models.fusion import add_scores, norm_add_scores, sigmoid
from models.han import HANReranker
from models.late import DEFAULT_THETA, text_image_late_scores
from models.loading import reranker_menu
from models.protocols import JointEncoder, TokenEncoder
from store import ann
from store.indexio import IndexVersion

log = logging.getLogger("duet.pipeline")

Ranked = tuple[int, float, float | None, float]  # row, dot, re-ranker score, score
Meta = tuple[str, dict[str, Any]]  # a hit's id and meta


@dataclass(frozen=True)
class RerankPlan:
    """A request's re-ranking options with the service defaults filled in: what runs, and
    (with the query and the top_k / candidates) everything that decides the result."""

    reranker: str  # ce | late | han | none
    fusion: str  # none | add | norm_add; none when reranker is none
    lam: float | None  # with fusion add / norm_add
    theta: float | None  # with reranker late

    @property
    def reranks(self) -> bool:
        return self.reranker != "none"


@dataclass
class _Candidates:
    rows: np.ndarray  # FAISS rows, best first
    dots: np.ndarray  # their dot products

    @classmethod
    def of(cls, dots: np.ndarray, rows: np.ndarray) -> _Candidates:
        """One query's FAISS result row, without the -1 padding past the index's end."""
        keep = rows >= 0
        return cls(rows[keep], dots[keep])


@dataclass
class Query:
    """One request's model work, as the engine's workers see it."""

    kind: Literal["text", "image"]  # a sentence finds images, an image finds captions
    text: str | None
    image: Image.Image | None
    index: IndexVersion
    plan: RerankPlan
    m: int  # candidates to retrieve (top_k when not re-ranking)
    top_k: int


@dataclass
class Answer:
    """What a worker hands back for one query."""

    ranked: list[Ranked]
    meta: list[Meta]
    timings: dict[str, float]
    reranked: int | None  # candidates actually re-ranked; None when the plan does not re-rank
    degraded: bool  # fewer than asked, because the deadline could not fit them


@dataclass
class _Work:
    """A query between the batched stages and its own re-rank / look-up."""

    ticket: Ticket[Query, Answer]
    timings: dict[str, float]
    cand: _Candidates = field(
        default_factory=lambda: _Candidates(np.zeros(0, np.int64), np.zeros(0, np.float32))
    )
    image_tokens: np.ndarray | None = None  # an image query's own states
    texts: list[Any] | None = None  # an image query's candidate caption rows

    @property
    def query(self) -> Query:
        return self.ticket.payload


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
    ) -> None:
        self.model = model
        self.indexes = ServedIndex(index)
        self.search_knobs = ann.SearchKnobs(nprobe=index_nprobe, ef_search=index_ef_search)
        self.cache = cache
        self.metrics = metrics
        self.fusion_lambda = fusion_lambda
        self.theta = theta
        # what DUET_RERANKER configured (late also needs token-level text features)
        menu = reranker_menu(model)
        self.rerankers = menu.available
        self.default_reranker = menu.default  # a request that names no re-ranker gets this one
        self._unavailable = menu.why
        self._han_head: HANReranker | None = getattr(model, "han", None)
        self.torch_threads = torch_threads
        self.cores = cores
        self.worker_nice = worker_nice
        self.rerank_max_batch = rerank_max_batch
        # seconds per query (encode + search) and per re-ranked pair; measured from the start
        self.throughput = Throughput({"query": 0.002, "pair": 0.001})
        self.engine: Engine[Query, Answer] = Engine(
            self._run_batch,
            workers=workers,
            max_batch=max_batch,
            max_queue=max_queue,
            timeout_s=timeout_s,
            on_shed=lambda why: metrics.shed.labels(reason=why).inc(),
            on_batch=metrics.engine_batch_size.observe,
            init_worker=self._init_worker,
            before_batch=self._set_threads,
        )
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
        self.metrics.index_info.labels(version=index.version).set(1)

    def swap_index(self, new: IndexVersion) -> IndexVersion:
        """Serve `new` from the next request on; in-flight requests finish on the old one.

        The old version's `duet_index_info` series is removed, so exactly one version shows.
        """
        old = self.indexes.swap(new)
        self._publish(new)
        if old.version != new.version:
            self.metrics.index_info.remove(old.version)
        return old

    def _init_worker(self) -> None:
        """In each worker thread before its first model call: its niceness (Linux applies
        it per thread; the torch threads the worker starts inherit it)."""
        if self.worker_nice:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.worker_nice)

    def threads_for(self, busy: int) -> int:
        """torch threads for a batch run while `busy` workers (this one included) run one:
        `DUET_TORCH_THREADS` when set, else the cores shared among the busy workers, so a
        lone request uses every core and a loaded service one core per worker."""
        if self.torch_threads is not None:
            return self.torch_threads
        return max(1, self.cores // max(1, busy))

    def _set_threads(self, busy: int) -> None:
        """Before each batch, in its worker thread: torch's OpenMP thread count is kept
        per calling thread, so each worker sets its own."""
        n = self.threads_for(busy)
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)

    async def start(self) -> None:
        """Time one query and a few pairs (the first estimates of the cost model, and warm
        kernels for the first request), start the workers."""
        await asyncio.to_thread(self._warm_up)
        self.engine.start()

    async def stop(self) -> None:
        await asyncio.to_thread(self.engine.stop)
        await self.cache.close()

    def _unknown(self, text: str | None) -> list[str]:
        """The query's words outside the model's vocabulary (none for an image query)."""
        words = getattr(self.model, "unknown_words", None)
        return list(words(text)) if text is not None and callable(words) else []

    def _identity(self, text: str) -> str:
        """The cache's key for a text query: what the model reads of it (the builtin word
        tokenizer: `normalise(text)`), else the text exactly; 422 when nothing is readable."""
        identity = getattr(self.model, "query_identity", None)
        key = identity(text) if callable(identity) else text
        if not any(ch.isalnum() or unicodedata.category(ch).startswith(("S", "P")) for ch in key):
            raise ValidationFailed(
                "query: has no words the model can read (only spaces, control or invisible "
                "characters"
                + (
                    ", or characters outside a-z and 0-9 for the builtin model"
                    if key != text
                    else ""
                )
                + ")"
            )
        return key

    def _warm_up(self) -> None:
        self._set_threads(1)
        index = self.index
        try:
            for _ in range(2):  # the first call of each kernel is slower than the rest
                t0 = time.perf_counter()
                vec = self.model.encode_texts(["a warm up query"])
                self._top(vec, index.image_index, 10)
                t1 = time.perf_counter()
                n = min(16, len(index.image_tokens))
                if n:
                    self.model.score_pairs(
                        ["a warm up query"] * n, np.asarray(index.image_tokens[:n])
                    )
                t2 = time.perf_counter()
        except Exception:  # the requests will report it; the cost model keeps its defaults
            log.exception("warm-up failed; starting with default cost estimates")
            return
        self.throughput = Throughput({"query": t1 - t0, "pair": (t2 - t1) / max(n, 1)})

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
                f"(the API knows {', '.join(RERANKERS)})"
            )
        if opts.uses_default_reranker:  # options the schema could not check without it
            try:
                opts.check_for(r)
            except ValueError as exc:
                raise ValidationFailed(str(exc)) from exc
        if r == "none":
            return RerankPlan("none", "none", None, None)
        fusion = opts.fusion or ("add" if r == "ce" else "none")
        lam = (
            None
            if fusion == "none"
            else (self.fusion_lambda if opts.lambda_ is None else opts.lambda_)
        )
        theta = None if r != "late" else (self.theta if opts.theta is None else opts.theta)
        return RerankPlan(r, fusion, lam, theta)

    def _key(
        self, index: IndexVersion, endpoint: str, query: str, opts: SearchOptions, plan: RerankPlan
    ) -> str:
        """The request's identity, including the version it runs on: no entry outlives a swap.
        Options enter resolved, so `rerank: false` and `reranker: none` share an entry."""
        return cache_key(
            model=self.model.fingerprint,
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

    async def _cached(self, key: str, timings: dict[str, float]) -> SearchResponse | None:
        with self._stage("cache", timings):
            raw = await self.cache.get(key)
        if raw is None:
            return None
        try:
            body = json.loads(raw)
            return SearchResponse(
                hits=body["hits"],
                timings_ms=timings,
                index_version=body["index_version"],
                cached=True,
                degraded=False,
                reranked=body.get("reranked"),
                unknown_words=body.get("unknown_words", []),
            )
        except (ValueError, KeyError, TypeError):
            log.warning("ignoring an unreadable cache entry %s", key)
            return None

    async def _store(self, key: str, resp: SearchResponse) -> None:
        body = {
            "hits": [h.model_dump() for h in resp.hits],
            "index_version": resp.index_version,
            "reranked": resp.reranked,
            "unknown_words": resp.unknown_words,
        }
        await self.cache.set(key, json.dumps(body))

    def _top(self, vec: np.ndarray, index: Any, m: int) -> _Candidates:
        # nprobe / efSearch go with this call only: the index is shared by every request
        dots, rows = ann.search(index, vec, m, self.search_knobs)
        return _Candidates.of(dots[0], rows[0])

    @staticmethod
    def _order(
        cand: _Candidates, scores: np.ndarray | None, plan: RerankPlan, top_k: int
    ) -> list[Ranked]:
        """(row, dot, re-ranker score, score) for the top-k, best first. `scores` are the
        re-ranker's own (CE probability or S_gl) for the first len(scores) candidates;
        `score` is what the hits are ordered by. Candidates left unscored (a degraded
        request) follow the re-ranked ones in dot-product order, scored by their dot."""
        n = 0 if scores is None else len(scores)
        ranked: list[Ranked] = []
        if scores is not None and n:
            if plan.fusion == "none":
                fused = np.asarray(scores, dtype=np.float64)
            else:
                assert plan.lam is not None
                combine = add_scores if plan.fusion == "add" else norm_add_scores
                fused = combine(cand.dots[:n], scores, plan.lam)
            order = np.argsort(-fused, kind="stable")[:top_k]
            ranked = [
                (int(cand.rows[i]), float(cand.dots[i]), float(scores[i]), float(fused[i]))
                for i in order
            ]
        rest = top_k - len(ranked)
        ranked += [
            (int(r), float(d), None, float(d))
            for r, d in zip(cand.rows[n : n + rest], cand.dots[n : n + rest], strict=True)
        ]
        return ranked

    # -- endpoints (event loop) -------------------------------------------------------
    async def search_text(self, query: str, opts: SearchOptions) -> SearchResponse:
        """A sentence finds images."""
        with self.indexes.lease() as index:  # one version for the whole request
            return await self._search(index, "text", query, None, self._identity(query), opts)

    async def search_image(
        self, data: bytes, image: Image.Image, opts: SearchOptions
    ) -> SearchResponse:
        """An image finds captions."""
        with self.indexes.lease() as index:
            return await self._search(
                index, "image", None, image, hashlib.sha256(data).hexdigest(), opts
            )

    async def _search(
        self,
        index: IndexVersion,
        kind: Literal["text", "image"],
        text: str | None,
        image: Image.Image | None,
        identity: str,
        opts: SearchOptions,
    ) -> SearchResponse:
        t0 = time.perf_counter()
        timings: dict[str, float] = {}
        plan = self.plan(opts)
        key = self._key(index, kind, identity, opts, plan)
        if (hit := await self._cached(key, timings)) is not None:
            return hit
        m = opts.candidates if plan.reranks else opts.top_k
        cost = self.throughput.seconds("query") + (
            self.throughput.seconds(_pair_kind(plan), m) if plan.reranks else 0.0
        )
        answer = await self.engine.submit(
            Query(kind, text, image, index, plan, m, opts.top_k), cost
        )
        timings.update(answer.timings)
        for stage, ms in answer.timings.items():
            self.metrics.stage_seconds.labels(stage=stage).observe(ms / 1000)
        if answer.degraded:
            self.metrics.degraded.inc()
        hits = [
            Hit(
                id=item_id,
                score=score,
                retrieval_score=dot,
                rerank_score=rr,
                rank=i + 1,
                meta=meta,
                image_url=image_url(item_id if kind == "text" else meta.get("image_id")),
            )
            for i, ((_, dot, rr, score), (item_id, meta)) in enumerate(
                zip(answer.ranked, answer.meta, strict=True)
            )
        ]
        timings["total"] = round((time.perf_counter() - t0) * 1000, 3)
        resp = SearchResponse(
            hits=hits,
            timings_ms=timings,
            index_version=index.version,
            cached=False,
            degraded=answer.degraded,
            reranked=answer.reranked,
            unknown_words=self._unknown(text),
        )
        if not answer.degraded:  # a later request with time to spare gets the full answer
            await self._store(key, resp)
        return resp

    # -- the engine's batch function (worker thread) ------------------------------------
    def _run_batch(self, tickets: Sequence[Ticket[Query, Answer]]) -> None:
        """Encode and search every query of the batch together, then re-rank and answer
        each; one query's failure fails that query alone."""
        start = time.monotonic()
        work = [_Work(t, {"queue": _ms(start - t.enqueued)}) for t in tickets]
        try:
            with _clock(work, "encode"):
                vecs = self._encode(work)
            with _clock(work, "search"):
                self._search_all(work, vecs)
        except Exception:
            if len(tickets) == 1:
                raise
            # one bad query must not fail its batch-mates: answer each on its own
            log.warning("a batch of %d queries failed; running each alone", len(tickets))
            for t in tickets:
                try:
                    self._run_batch([t])
                except Exception as exc:
                    log.exception("a query failed")
                    t.fail(exc)
            return
        self.throughput.observe("query", len(work), time.monotonic() - start)
        chunk: list[_Work] = []
        for w in work:
            if w.query.plan.reranker == "ce" and len(w.cand.rows):
                if chunk and sum(c.query.m for c in chunk) + w.query.m > self.rerank_max_batch:
                    self._finish_ce(chunk)
                    chunk = []
                chunk.append(w)
                continue
            self._finish_ce(chunk)
            chunk = []
            self._answer([w], lambda ws: [self._rerank_one(ws[0])])
        self._finish_ce(chunk)

    def _encode(self, work: list[_Work]) -> dict[int, np.ndarray]:
        """Query vectors by position in `work`: the sentences in one call, the images in one."""
        vecs: dict[int, np.ndarray] = {}
        texts = [i for i, w in enumerate(work) if w.query.kind == "text"]
        images = [i for i, w in enumerate(work) if w.query.kind == "image"]
        if texts:
            v = self.model.encode_texts([str(work[i].query.text) for i in texts])
            vecs.update(zip(texts, v, strict=True))
        if images:
            v, toks = self.model.encode_images([work[i].query.image for i in images])  # type: ignore[misc]
            vecs.update(zip(images, v, strict=True))
            for i, tk in zip(images, toks, strict=True):
                work[i].image_tokens = tk[None]
        return vecs

    def _search_all(self, work: list[_Work], vecs: dict[int, np.ndarray]) -> None:
        """One FAISS call per (index version, modality) for all the batch's queries."""
        groups: dict[tuple[int, str], list[int]] = {}
        for i, w in enumerate(work):
            groups.setdefault((id(w.query.index), w.query.kind), []).append(i)
        for members in groups.values():
            q = work[members[0]].query
            index = q.index.image_index if q.kind == "text" else q.index.text_index
            m = max(work[i].query.m for i in members)
            dots, rows = ann.search(
                index, np.stack([vecs[i] for i in members]), m, self.search_knobs
            )
            for j, i in enumerate(members):
                m_i = work[i].query.m
                work[i].cand = _Candidates.of(dots[j][:m_i], rows[j][:m_i])

    def _affordable(self, chunk: list[_Work]) -> float:
        """The share (0..1) of the chunk's candidates that can be re-ranked before the
        earliest deadline in it, at the measured seconds per pair of its re-ranker."""
        pairs = sum(len(w.cand.rows) for w in chunk)
        per_pair = self.throughput.seconds(_pair_kind(chunk[0].query.plan))
        if pairs == 0 or per_pair <= 0:
            return 1.0
        now = time.monotonic()
        budget = min(w.ticket.remaining(now) for w in chunk) - self.throughput.seconds("query")
        return max(0.0, min(1.0, budget / (per_pair * pairs)))

    def _finish_ce(self, chunk: list[_Work]) -> None:
        """Cross-encoder scores for a chunk of text or image queries in one call."""
        if chunk:
            self._answer(chunk, self._score_ce)

    def _score_ce(self, chunk: list[_Work]) -> list[np.ndarray]:
        share = self._affordable(chunk)
        texts: list[str] = []
        tokens: list[np.ndarray] = []
        sizes = []
        for w in chunk:
            n = math.floor(len(w.cand.rows) * share)
            sizes.append(n)
            q_texts, q_tokens = self._pairs(w, n)
            texts += q_texts
            tokens.append(q_tokens)
        scores = np.zeros(0, np.float32)
        if texts:
            scores = sigmoid(self.model.score_pairs(texts, np.concatenate(tokens)))
            self.metrics.rerank_batch_size.observe(len(texts))
        bounds = np.cumsum([0, *sizes])
        return [scores[a:b] for a, b in itertools.pairwise(bounds)]

    def _pairs(self, w: _Work, n: int) -> tuple[list[str], np.ndarray]:
        """The first `n` candidates as (texts, image states) pairs for a pair re-ranker."""
        if w.query.kind == "text":
            return [str(w.query.text)] * n, np.asarray(w.query.index.image_tokens[w.cand.rows[:n]])
        assert w.image_tokens is not None and w.texts is not None
        return [r.text for r in w.texts[:n]], np.repeat(w.image_tokens, n, axis=0)

    def _rerank_one(self, w: _Work) -> np.ndarray | None:
        """late / han scores for the candidates that fit the deadline; None for plan none."""
        plan = w.query.plan
        if not plan.reranks or not len(w.cand.rows):
            return None
        n = math.floor(len(w.cand.rows) * self._affordable([w]))
        if n == 0:
            return np.zeros(0, np.float32)
        texts, tokens = self._pairs(w, n)
        if plan.reranker == "han":
            return self._han.score_pairs(texts, tokens)
        assert plan.reranker == "late" and plan.theta is not None
        assert isinstance(self.model, TokenEncoder)
        if w.query.kind == "text":  # one sentence against its candidate images
            q, mask = self.model.text_token_features(texts[:1])
            q, mask = q.repeat(n, axis=0), mask.repeat(n, axis=0)
        else:  # the index stores no caption tokens: the text tower computes them here
            q, mask = self.model.text_token_features(texts)
        return text_image_late_scores(
            w.query.kind == "text", w.cand.dots[:n], q, mask, tokens, plan.theta
        )

    @property
    def _han(self) -> HANReranker:
        assert self._han_head is not None, "plan() offers han only with a HAN head"
        return self._han_head

    def _answer(
        self, chunk: list[_Work], score: Callable[[list[_Work]], Sequence[np.ndarray | None]]
    ) -> None:
        """Look up what re-ranking needs, score the chunk (`score(chunk)` -> one array or
        None per query), order, look up the hits and answer each query."""
        try:
            with _clock(chunk, "lookup"):
                for w in chunk:
                    if w.query.kind == "image":  # the re-ranker reads the candidates' captions
                        w.texts = w.query.index.store.texts([int(r) for r in w.cand.rows])
            t0 = time.monotonic()
            scores = score(chunk)
            dt = time.monotonic() - t0
            pairs = sum(len(s) for s in scores if s is not None)
            self.throughput.observe(_pair_kind(chunk[0].query.plan), pairs, dt)
            for w, s in zip(chunk, scores, strict=True):
                if s is not None:
                    w.timings["rerank"] = _ms(dt)
        except Exception as exc:
            log.exception("re-ranking %d queries failed", len(chunk))
            for w in chunk:
                w.ticket.fail(exc)
            return
        for w, s in zip(chunk, scores, strict=True):
            try:
                w.ticket.resolve(self._ranked(w, s))
            except Exception as exc:
                log.exception("answering a query failed")
                w.ticket.fail(exc)

    def _ranked(self, w: _Work, scores: np.ndarray | None) -> Answer:
        q = w.query
        ranked = self._order(w.cand, scores, q.plan, q.top_k)
        with _clock([w], "lookup"):
            if q.kind == "text":
                rows = q.index.store.images([r for r, _, _, _ in ranked])
                meta = [(r.id, {**r.meta, "image": r.path}) for r in rows]
            else:
                assert w.texts is not None
                by_row = dict(zip(w.cand.rows.tolist(), w.texts, strict=True))
                meta = [
                    (
                        by_row[r].id,
                        {**by_row[r].meta, "text": by_row[r].text, "image_id": by_row[r].image_id},
                    )
                    for r, _, _, _ in ranked
                ]
        used = None if scores is None else len(scores)
        return Answer(
            ranked, meta, w.timings, used, degraded=used is not None and used < len(w.cand.rows)
        )


def _pair_kind(plan: RerankPlan) -> str:
    """The cost-model kind of one re-ranked candidate: each re-ranker has its own price."""
    return "pair" if plan.reranker == "ce" else f"pair/{plan.reranker}"


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


@contextmanager
def _clock(work: list[_Work], stage: str) -> Iterator[None]:
    """Add the block's wall time to `stage` of every query in `work` (they shared it)."""
    t0 = time.monotonic()
    try:
        yield
    finally:
        dt = _ms(time.monotonic() - t0)
        for w in work:
            w.timings[stage] = round(w.timings.get(stage, 0.0) + dt, 3)
