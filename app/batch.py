"""The worker side of a search: one batch of queries through encode -> FAISS top-M ->
re-rank -> fuse -> top-k -> item look-ups, on an inference-engine worker (`app.engine`).

Queries of a batch are encoded together and searched with one FAISS call per (index
version, modality); a batched re-ranker (the cross-encoder) scores several queries' pairs
per call, in chunks of up to `rerank_max_batch`; the others score one query at a time. When
a query's deadline cannot fit all its candidates, it re-ranks as many as fit (best by dot
product first) and says so (`degraded`). Each query is answered as soon as its own scores
are in; one query's failure fails that query alone.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from app.costs import BatchCost, Throughput
from app.engine import Ticket
from app.errors import DuetError
from app.heavy import concat, heavy_reranker, make_resident, measure_pair_budget, states_of
from app.metrics import Metrics
from app.stepping import DeviceStepping
from app.threads import SOLO_TEXTS, solo_threads
from app.work import (
    Answer,
    Candidates,
    Meta,
    Query,
    RerankPlan,
    Work,
    candidate_texts,
    clock,
    items_of,
    ms,
    warn_now_and_then,
)
from models.device_step import DeviceStep
from models.fusion import fused_top_k
from models.protocols import JointEncoder
from models.rerankers import REGISTRY, Pairs, Scorer
from store import ann
from store.indexio import IndexVersion

log = logging.getLogger("duet.pipeline")

__all__ = ["Answer", "BatchWorker", "Query", "RerankPlan", "pair_kind"]


class BatchWorker(DeviceStepping):
    """What the engine's workers run: the model, the re-rankers' scorers, the cost model
    they keep measuring, and each worker thread's niceness and torch threads."""

    def __init__(
        self,
        model: JointEncoder,
        scorers: dict[str, Scorer],
        metrics: Metrics,
        *,
        search_knobs: ann.SearchKnobs,
        rerank_max_batch: int,
        cores: int,
        torch_threads: int | None,
        worker_nice: int,
        step: DeviceStep | None = None,
    ) -> None:
        self.model = model
        self._scorers = scorers
        self.metrics = metrics
        self.search_knobs = search_knobs
        self.rerank_max_batch = rerank_max_batch
        self.cores = cores
        self.torch_threads = torch_threads
        self.worker_nice = worker_nice
        # seconds per query (encode + search) and per re-ranked pair; measured from the start
        self.throughput = Throughput({"query": 0.002, "pair": 0.001})
        # the GPU layout: text queries as one device step each batch (`models.device_step`),
        # priced per batch, per query and per pair
        self.step = step
        self.batch_cost = BatchCost(0.002, 0.0002, 0.00002)
        # with a heavy (Hugging Face) cross-encoder on the host path: the request deadline,
        # when its pair budget is to be measured at start (`app.heavy`); None keeps
        # `rerank_max_batch`
        self.heavy_deadline_s: float | None = None

    def init_thread(self) -> None:
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

    def set_threads(self, busy: int) -> None:
        """Before each batch, in its worker thread: torch's OpenMP thread count is kept
        per calling thread, so each worker sets its own."""
        n = self.threads_for(busy)
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)

    def warm_up(self, index: IndexVersion) -> None:
        """Time one query and a few pairs on `index`: the cost model's first estimates, and
        warm kernels for the first request."""
        self.set_threads(1)
        try:
            for _ in range(2):  # the first call of each kernel is slower than the rest
                t0 = time.perf_counter()
                vec = self.model.encode_texts(["a warm up query"])
                self.top(vec, index.image_index, 10)
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
        reranker = heavy_reranker(self.model)
        if reranker is not None and self.heavy_deadline_s is not None and n:
            self.rerank_max_batch, per_pair = measure_pair_budget(
                reranker,
                index,
                candidates=50,
                deadline_s=self.heavy_deadline_s,
                cap=self.rerank_max_batch,
            )
            self.throughput = Throughput({"query": t1 - t0, "pair": per_pair})

    def cost_of(self, q: Query) -> float:
        """A query's estimated seconds of worker time, which admission adds up."""
        if self.steppable(q):  # a share of a device batch (its fixed part apart)
            return self.batch_cost.ticket_s(q.pairs)
        pairs = self.throughput.seconds(pair_kind(q.plan), q.m) if q.plan.reranks else 0.0
        return self.throughput.seconds("query") + pairs

    def prepare(self, index: IndexVersion) -> None:
        """Make `index` ready to serve: the device step's resident tables (GPU layout), or
        a heavy re-ranker's image states on its GPU (`app.heavy`)."""
        if self.step is None:
            make_resident(self.model, index)
        else:
            super().prepare(index)

    def top(self, vec: np.ndarray, index: Any, m: int) -> Candidates:
        # nprobe / efSearch go with this call only: the index is shared by every request
        dots, rows = ann.search(index, vec, m, self.search_knobs)
        return Candidates.of(dots[0], rows[0])

    def run_batch(self, tickets: Sequence[Ticket[Query, Answer]]) -> None:
        """Run the batch: its text queries the device step can serve as one step per chunk
        (GPU layout), the rest on the host path (`run_host`)."""
        # when the batch was taken, and whether it is one query: the host path's queries
        # wait for the device steps as batch-mates, not in the queue
        start, alone = time.monotonic(), len(tickets) == 1
        if self.step is not None:
            stepped = [t for t in tickets if self.steppable(t.payload)]
            if stepped:
                self._run_steps(stepped, start, alone)
                tickets = [t for t in tickets if not self.steppable(t.payload)]
        if tickets:
            self.run_host(tickets, start, alone)

    def run_host(
        self,
        tickets: Sequence[Ticket[Query, Answer]],
        start: float | None = None,
        alone: bool | None = None,
    ) -> None:
        """Encode and search every query of the batch together, then re-rank and answer
        each; one query's failure fails that query alone. `start`, `alone`: when the batch
        was taken and whether it is one query (default: now, and these tickets alone)."""
        work = Work.taken_as_batch(tickets, start, alone)
        t0 = time.monotonic()  # this path's own encode and search, for the cost model
        try:
            with clock(work, "encode"):
                vecs = self._encode(work)
            with clock(work, "search"):
                self._search_all(work, vecs)
        except Exception:
            if len(tickets) == 1:
                raise
            # one bad query must not fail its batch-mates: answer each on its own
            log.warning("a batch of %d queries failed; running each alone", len(tickets))
            for t in tickets:
                try:
                    self.run_host([t])
                except Exception as exc:
                    log.exception("a query failed")
                    t.fail(exc)
            return
        self.throughput.observe("query", len(work), time.monotonic() - t0)
        # a batched re-ranker (the cross-encoder) scores several queries' pairs per call, in
        # chunks of up to rerank_max_batch pairs of one re-ranker and one query kind
        chunk: list[Work] = []
        for w in work:
            plan = w.query.plan
            if plan.reranks and REGISTRY[plan.reranker].batched and len(w.cand.rows):
                head = chunk[0].query if chunk else None
                same = head is not None and (head.plan.reranker, head.kind) == (
                    plan.reranker,
                    w.query.kind,
                )
                full = sum(c.query.m for c in chunk) + w.query.m > self.rerank_max_batch
                if chunk and (full or not same):
                    self._answer(chunk, self._score_batched)
                    chunk = []
                chunk.append(w)
                continue
            self._answer([w], lambda ws: [self._rerank_one(ws[0])])
        if chunk:
            self._answer(chunk, self._score_batched)

    def _encode(self, work: list[Work]) -> dict[int, np.ndarray]:
        """Query vectors by position in `work`: the sentences in one call, the images in one."""
        vecs: dict[int, np.ndarray] = {}
        texts = [i for i, w in enumerate(work) if w.query.kind == "text"]
        images = [i for i, w in enumerate(work) if w.query.kind == "image"]
        if texts:
            with solo_threads(len(texts) <= SOLO_TEXTS):
                v = self.model.encode_texts([str(work[i].query.text) for i in texts])
            vecs.update(zip(texts, v, strict=True))
        if images:
            v, toks = self.model.encode_images([work[i].query.image for i in images])  # type: ignore[misc]
            vecs.update(zip(images, v, strict=True))
            for i, tk in zip(images, toks, strict=True):
                work[i].image_tokens = tk[None]
        return vecs

    def _search_all(self, work: list[Work], vecs: dict[int, np.ndarray]) -> None:
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
                work[i].cand = Candidates.of(dots[j][:m_i], rows[j][:m_i])

    def _affordable(self, chunk: list[Work]) -> float:
        """The share (0..1) of the chunk's candidates that can be re-ranked before the
        earliest deadline in it, at the measured seconds per pair of its re-ranker."""
        pairs = sum(len(w.cand.rows) for w in chunk)
        per_pair = self.throughput.seconds(pair_kind(chunk[0].query.plan))
        if pairs == 0 or per_pair <= 0:
            return 1.0
        now = time.monotonic()
        budget = min(w.ticket.remaining(now) for w in chunk) - self.throughput.seconds("query")
        return max(0.0, min(1.0, budget / (per_pair * pairs)))

    def _score_batched(self, chunk: list[Work]) -> list[np.ndarray]:
        """One call of a batched re-ranker for the pairs of every query in `chunk` (as many
        of each query's candidates as fit the earliest deadline among them)."""
        share = self._affordable(chunk)
        texts: list[str] = []
        tokens: list[Any] = []  # host arrays, or device rows of a resident version (`concat`)
        dots: list[np.ndarray] = []
        sizes = []
        for w in chunk:
            n = math.floor(len(w.cand.rows) * share)
            sizes.append(n)
            q_texts, q_tokens = self._pairs(w, n, on_device=True)
            texts += q_texts
            tokens.append(q_tokens)
            dots.append(w.cand.dots[:n])
        scores = np.zeros(0, np.float32)
        if texts:
            q = chunk[0].query
            scores = self._scorers[q.plan.reranker](
                Pairs(
                    texts,
                    concat(tokens),
                    np.concatenate(dots),
                    q.kind == "text",
                    q.plan.theta,
                )
            )
            self.metrics.rerank_batch_size.observe(len(texts))
        bounds = np.cumsum([0, *sizes])
        return [scores[a:b] for a, b in itertools.pairwise(bounds)]

    def _pairs(self, w: Work, n: int, on_device: bool = False) -> tuple[list[str], Any]:
        """The first `n` candidates as (texts, image states) pairs for a pair re-ranker;
        `on_device`: a text query's states as a tensor on the model's device when the
        version keeps them resident there (the cross-encoder reads them so)."""
        if w.query.kind == "text":
            index, rows = w.query.index, w.cand.rows[:n]
            states = states_of(index, rows) if on_device else index.token_rows(rows)
            return [str(w.query.text)] * n, states
        assert w.image_tokens is not None and w.texts is not None
        return [r.text for r in w.texts[:n]], np.repeat(w.image_tokens, n, axis=0)

    def _rerank_one(self, w: Work) -> np.ndarray | None:
        """An unbatched re-ranker's scores for the candidates that fit the deadline; None
        for plan none."""
        plan = w.query.plan
        if not plan.reranks or not len(w.cand.rows):
            return None
        n = math.floor(len(w.cand.rows) * self._affordable([w]))
        if n == 0:
            return np.zeros(0, np.float32)
        texts, tokens = self._pairs(w, n)
        pairs = Pairs(texts, tokens, w.cand.dots[:n], w.query.kind == "text", plan.theta)
        return self._scorers[plan.reranker](pairs)

    def _answer(
        self, chunk: list[Work], score: Callable[[list[Work]], Sequence[np.ndarray | None]]
    ) -> None:
        """Look up what re-ranking needs, score the chunk (`score(chunk)` -> one array or
        None per query), order, look up the hits and answer each query."""
        try:
            with clock(chunk, "lookup"):
                for w in chunk:
                    if w.query.kind == "image":  # the re-ranker reads the candidates' captions
                        w.texts = candidate_texts(w.query.index.store, w.cand.rows)
            t0 = time.monotonic()
            scores = score(chunk)
            dt = time.monotonic() - t0
            pairs = sum(len(s) for s in scores if s is not None)
            self.throughput.observe(pair_kind(chunk[0].query.plan), pairs, dt)
            for w, s in zip(chunk, scores, strict=True):
                if s is not None:
                    w.timings["rerank"] = ms(dt)
        except Exception as exc:
            if isinstance(exc, DuetError):  # the askers' answers say it (index_unreadable)
                warn_now_and_then(exc.code, "queries failed (once in 10 s): %s", exc.message)
            else:
                log.exception("re-ranking %d queries failed", len(chunk))
            for w in chunk:
                w.ticket.fail(exc)
            return
        for w, s in zip(chunk, scores, strict=True):
            try:
                w.ticket.resolve(self._ranked(w, s))
            except DuetError as exc:
                warn_now_and_then(exc.code, "queries failed (once in 10 s): %s", exc.message)
                w.ticket.fail(exc)
            except Exception as exc:
                log.exception("answering a query failed")
                w.ticket.fail(exc)

    def _ranked(self, w: Work, scores: np.ndarray | None) -> Answer:
        q = w.query
        plan = q.plan
        ranked = fused_top_k(w.cand.rows, w.cand.dots, scores, plan.fusion, plan.lam, q.top_k)
        meta: list[Meta] = []
        captions: dict[str, list[str]] = {}
        if q.look_up:
            with clock([w], "lookup"):
                rows = [r for r, _, _, _ in ranked]
                texts = None
                if q.kind == "image":
                    assert w.texts is not None
                    by_row = dict(zip(w.cand.rows.tolist(), w.texts, strict=True))
                    texts = [by_row[r] for r in rows]
                meta, captions = items_of(q.index.store, q.kind, rows, texts)
        used = None if scores is None else len(scores)
        w.waited_for_others()
        return Answer(
            ranked,
            meta,
            w.timings,
            used,
            degraded=used is not None and used < len(w.cand.rows),
            captions=captions,
        )


def pair_kind(plan: RerankPlan) -> str:
    """The cost-model kind of one re-ranked candidate: each re-ranker has its own price."""
    return REGISTRY[plan.reranker].cost_kind if plan.reranks else "pair/none"
