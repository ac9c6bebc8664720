"""The search pipeline: cache -> encode query -> FAISS top-M -> re-rank -> fuse -> top-k.

The re-ranker is chosen per request (`SearchOptions.reranker`): the cross-encoder runs
micro-batched across requests, late interaction (TGDT's S_gl) in a worker thread.

Model calls and FAISS searches run in worker threads, never on the event loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from app.batching import MicroBatcher
from app.cache import ResilientCache, cache_key
from app.errors import RerankerUnavailable, ValidationFailed
from app.metrics import Metrics
from app.schemas import RERANKERS, Hit, SearchOptions, SearchResponse
from app.versions import ServedIndex
from duet import ann
from duet.indexio import IndexVersion
from models.fusion import add_scores, norm_add_scores, sigmoid
from models.han import HANReranker
from models.late import DEFAULT_THETA, text_image_late_scores
from models.loading import reranker_menu
from models.protocols import JointEncoder, TokenEncoder
from models.tokenizer import normalise

log = logging.getLogger("duet.pipeline")

RerankItem = tuple[list[str], np.ndarray]  # texts and their paired image tokens
Ranked = tuple[int, float, float | None, float]  # row, dot, re-ranker score, score


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


class SearchPipeline:
    """Owns the loaded model, index, cache and re-rank batcher for one running service.

    Each search leases the index version current when it starts (`ServedIndex.lease`) and
    uses only that one, so `swap_index` can replace the version while requests are in flight.
    """

    def __init__(self, model: JointEncoder, index: IndexVersion, cache: ResilientCache,
                 metrics: Metrics, *, rerank_max_batch: int, rerank_max_wait_s: float,
                 rerank_max_queue: int, fusion_lambda: float, theta: float = DEFAULT_THETA,
                 index_nprobe: int = ann.DEFAULT_NPROBE,
                 index_ef_search: int = ann.DEFAULT_EF_SEARCH) -> None:
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
        self.batcher: MicroBatcher[RerankItem, np.ndarray] = MicroBatcher(
            self._score_batch, max_batch=rerank_max_batch, max_wait_s=rerank_max_wait_s,
            size_of=lambda item: len(item[0]), max_queue=rerank_max_queue,
            on_batch=metrics.rerank_batch_size.observe)
        self._publish(index)
        metrics.rerank_queue_depth.set_function(lambda: self.batcher.depth)
        metrics.rerank_queue_capacity.set(self.batcher.max_queue)

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

    async def start(self) -> None:
        await self.batcher.start()

    async def stop(self) -> None:
        await self.batcher.stop()
        await self.cache.close()

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

    def _score_batch(self, items: list[RerankItem]) -> list[np.ndarray]:
        """One cross-encoder forward pass over every request's pairs."""
        texts = [t for item in items for t in item[0]]
        tokens = np.concatenate([item[1] for item in items])
        scores = self.model.score_pairs(texts, tokens)
        bounds = np.cumsum([0] + [len(item[0]) for item in items])
        return [scores[a:b] for a, b in itertools.pairwise(bounds)]

    def plan(self, opts: SearchOptions) -> RerankPlan:
        """The request's options resolved against the service's defaults; a re-ranker the
        API names but this service cannot run is refused here."""
        r = opts.reranker_or(self.default_reranker)
        if r not in self.rerankers:
            why = self._unavailable.get(r, "is not available in this deployment")
            raise RerankerUnavailable(
                f"reranker: the {r} re-ranker {why}; available: {', '.join(self.rerankers)} "
                f"(the API knows {', '.join(RERANKERS)})")
        if opts.uses_default_reranker:  # options the schema could not check without it
            try:
                opts.check_for(r)
            except ValueError as exc:
                raise ValidationFailed(str(exc)) from exc
        if r == "none":
            return RerankPlan("none", "none", None, None)
        fusion = opts.fusion or ("add" if r == "ce" else "none")
        lam = None if fusion == "none" else (
            self.fusion_lambda if opts.lambda_ is None else opts.lambda_)
        theta = None if r != "late" else (self.theta if opts.theta is None else opts.theta)
        return RerankPlan(r, fusion, lam, theta)

    def _key(self, index: IndexVersion, endpoint: str, query: str, opts: SearchOptions,
             plan: RerankPlan) -> str:
        """The request's identity, including the version it runs on: no entry outlives a swap.
        Options enter resolved, so `rerank: false` and `reranker: none` share an entry."""
        return cache_key(model=self.model.fingerprint, index=index.version,
                         endpoint=endpoint, query=query, top_k=opts.top_k,
                         candidates=opts.candidates if plan.reranks else None,
                         reranker=plan.reranker, fusion=plan.fusion, lam=plan.lam,
                         theta=plan.theta)

    async def _cached(self, key: str, timings: dict[str, float]) -> SearchResponse | None:
        with self._stage("cache", timings):
            raw = await self.cache.get(key)
        if raw is None:
            return None
        try:
            body = json.loads(raw)
            return SearchResponse(hits=body["hits"], timings_ms=timings,
                                  index_version=body["index_version"], cached=True)
        except (ValueError, KeyError, TypeError):
            log.warning("ignoring an unreadable cache entry %s", key)
            return None

    async def _store(self, key: str, resp: SearchResponse) -> None:
        body = {"hits": [h.model_dump() for h in resp.hits], "index_version": resp.index_version}
        await self.cache.set(key, json.dumps(body))

    def _top(self, vec: np.ndarray, index: Any, m: int) -> _Candidates:
        # nprobe / efSearch go with this call only: the index is shared by every request
        dots, rows = ann.search(index, vec, m, self.search_knobs)
        keep = rows[0] >= 0
        return _Candidates(rows[0][keep], dots[0][keep])

    @staticmethod
    def _order(cand: _Candidates, scores: np.ndarray | None, plan: RerankPlan,
               top_k: int) -> list[Ranked]:
        """(row, dot, re-ranker score, score) for the top-k, best first. `scores` are the
        re-ranker's own (CE probability or S_gl); `score` is what the hits are ordered by."""
        if scores is None:
            return [(int(r), float(d), None, float(d))
                    for r, d in zip(cand.rows[:top_k], cand.dots[:top_k], strict=True)]
        if plan.fusion == "none":
            fused = np.asarray(scores, dtype=np.float64)
        else:
            assert plan.lam is not None
            combine = add_scores if plan.fusion == "add" else norm_add_scores
            fused = combine(cand.dots, scores, plan.lam)
        order = np.argsort(-fused, kind="stable")[:top_k]
        return [(int(cand.rows[i]), float(cand.dots[i]), float(scores[i]), float(fused[i]))
                for i in order]

    @property
    def _han(self) -> HANReranker:
        assert self._han_head is not None, "plan() offers han only with a HAN head"
        return self._han_head

    def _late_text_query(self, query: str, cand: _Candidates, image_tokens: np.ndarray,
                         theta: float) -> np.ndarray:
        """S_gl for a sentence against its candidate images' stored patch tokens."""
        assert isinstance(self.model, TokenEncoder)
        q, mask = self.model.text_token_features([query])
        n = len(cand.rows)
        return text_image_late_scores(True, cand.dots, np.repeat(q, n, axis=0),
                                      np.repeat(mask, n, axis=0), image_tokens, theta)

    def _late_image_query(self, image_tokens: np.ndarray, cand: _Candidates, texts: list[str],
                          theta: float) -> np.ndarray:
        """S_gl for an image against its candidate captions: the index stores no caption
        tokens, so the text tower computes them here (one pass over <= `candidates` texts)."""
        assert isinstance(self.model, TokenEncoder)
        items, item_mask = self.model.text_token_features(texts)
        return text_image_late_scores(False, cand.dots, items, item_mask,
                                      np.repeat(image_tokens, len(texts), axis=0), theta)

    async def _respond(self, key: str, ranked: list[Ranked],
                       rows_meta: list[tuple[str, dict[str, Any]]], index: IndexVersion,
                       timings: dict[str, float], t0: float) -> SearchResponse:
        """Build the response from ranked rows and their (id, meta), and cache it."""
        hits = [Hit(id=item_id, score=score, retrieval_score=dot, rerank_score=rr, rank=i + 1,
                    meta=meta)
                for i, ((_, dot, rr, score), (item_id, meta)) in enumerate(zip(ranked, rows_meta,
                                                                              strict=True))]
        timings["total"] = round((time.perf_counter() - t0) * 1000, 3)
        resp = SearchResponse(hits=hits, timings_ms=timings, index_version=index.version,
                              cached=False)
        await self._store(key, resp)
        return resp

    # -- endpoints -------------------------------------------------------------
    async def search_text(self, query: str, opts: SearchOptions) -> SearchResponse:
        """A sentence finds images."""
        with self.indexes.lease() as index:  # one version for the whole request
            return await self._search_text(index, query, opts)

    async def search_image(self, data: bytes, image: Image.Image,
                           opts: SearchOptions) -> SearchResponse:
        """An image finds captions."""
        with self.indexes.lease() as index:
            return await self._search_image(index, data, image, opts)

    async def _search_text(self, index: IndexVersion, query: str,
                           opts: SearchOptions) -> SearchResponse:
        timings: dict[str, float] = {}
        t0 = time.perf_counter()
        plan = self.plan(opts)
        key = self._key(index, "text", normalise(query), opts, plan)
        if (hit := await self._cached(key, timings)) is not None:
            return hit
        with self._stage("encode", timings):
            vec = await asyncio.to_thread(self.model.encode_texts, [query])
        m = opts.candidates if plan.reranks else opts.top_k
        with self._stage("search", timings):
            cand = await asyncio.to_thread(self._top, vec, index.image_index, m)
        scores = None
        if plan.reranks and len(cand.rows):
            with self._stage("rerank", timings):
                tokens = np.asarray(index.image_tokens[cand.rows])  # copy out of the memmap
                if plan.reranker == "late":
                    assert plan.theta is not None
                    scores = await asyncio.to_thread(self._late_text_query, query, cand,
                                                     tokens, plan.theta)
                elif plan.reranker == "han":
                    scores = await asyncio.to_thread(self._han.score_pairs,
                                                     [query] * len(cand.rows), tokens)
                else:
                    scores = sigmoid(await self.batcher.submit(
                        ([query] * len(cand.rows), tokens)))
        ranked = self._order(cand, scores, plan, opts.top_k)
        with self._stage("lookup", timings):
            rows = await asyncio.to_thread(index.store.images, [r for r, _, _, _ in ranked])
        meta = [(r.id, {**r.meta, "image": r.path}) for r in rows]
        return await self._respond(key, ranked, meta, index, timings, t0)

    async def _search_image(self, index: IndexVersion, data: bytes, image: Image.Image,
                            opts: SearchOptions) -> SearchResponse:
        timings: dict[str, float] = {}
        t0 = time.perf_counter()
        plan = self.plan(opts)
        key = self._key(index, "image", hashlib.sha256(data).hexdigest(), opts, plan)
        if (hit := await self._cached(key, timings)) is not None:
            return hit
        with self._stage("encode", timings):
            vec, toks = await asyncio.to_thread(self.model.encode_images, [image])
        m = opts.candidates if plan.reranks else opts.top_k
        with self._stage("search", timings):
            cand = await asyncio.to_thread(self._top, vec, index.text_index, m)
        with self._stage("lookup", timings):  # the re-ranker reads the candidates' captions
            cand_rows = await asyncio.to_thread(index.store.texts, [int(r) for r in cand.rows])
        scores = None
        if plan.reranks and len(cand.rows):
            with self._stage("rerank", timings):
                texts = [r.text for r in cand_rows]
                if plan.reranker == "late":
                    assert plan.theta is not None
                    scores = await asyncio.to_thread(self._late_image_query, toks, cand, texts,
                                                     plan.theta)
                elif plan.reranker == "han":
                    scores = await asyncio.to_thread(self._han.score_pairs, texts,
                                                     np.repeat(toks, len(texts), axis=0))
                else:
                    scores = sigmoid(await self.batcher.submit(
                        (texts, np.repeat(toks, len(texts), axis=0))))
        ranked = self._order(cand, scores, plan, opts.top_k)
        by_row = dict(zip(cand.rows.tolist(), cand_rows, strict=True))
        meta = [(by_row[r].id, {**by_row[r].meta, "text": by_row[r].text,
                                "image_id": by_row[r].image_id}) for r, _, _, _ in ranked]
        return await self._respond(key, ranked, meta, index, timings, t0)
