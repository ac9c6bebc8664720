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
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
from PIL import Image

from app.engine import BatchCost, Throughput, Ticket
from app.metrics import Metrics
from app.threads import SOLO_TEXTS, solo_threads
from models.builtin import pixel_bytes
from models.device_step import CaptionTables, DeviceStep, ResidentTables
from models.fusion import Ranked, fused_top_k, sigmoid
from models.protocols import JointEncoder
from models.rerankers import REGISTRY, Pairs, Scorer
from store import ann
from store.indexio import IndexVersion

log = logging.getLogger("duet.pipeline")

Meta = tuple[str, dict[str, Any]]  # a hit's id and meta


@dataclass(frozen=True)
class RerankPlan:
    """A request's re-ranking options with the service defaults filled in: what runs, and
    (with the query and the top_k / candidates) everything that decides the result."""

    reranker: str  # a `models.rerankers` name, or none
    fusion: str  # none | add | norm_add; none when reranker is none
    lam: float | None  # with fusion add / norm_add
    theta: float | None  # with a re-ranker that reads theta (late)

    @property
    def reranks(self) -> bool:
        return self.reranker != "none"


@dataclass
class Candidates:
    rows: np.ndarray  # FAISS rows, best first
    dots: np.ndarray  # their dot products

    @classmethod
    def of(cls, dots: np.ndarray, rows: np.ndarray) -> Candidates:
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
    ids: list[int] | None = None  # the text's token ids, for the device step (GPU layout)

    @property
    def pairs(self) -> int:
        """Pairs this query re-ranks (what the batch budget counts)."""
        return self.m if self.plan.reranks else 0


@dataclass
class Answer:
    """What a worker hands back for one query."""

    ranked: list[Ranked]  # row, dot, re-ranker score, score; best first
    meta: list[Meta]
    timings: dict[str, float]
    reranked: int | None  # candidates actually re-ranked; None when the plan does not re-rank
    degraded: bool  # fewer than asked, because the deadline could not fit them


@dataclass
class _Work:
    """A query between the batched stages and its own re-rank / look-up."""

    ticket: Ticket[Query, Answer]
    timings: dict[str, float]
    cand: Candidates = field(
        default_factory=lambda: Candidates(np.zeros(0, np.int64), np.zeros(0, np.float32))
    )
    image_tokens: np.ndarray | None = None  # an image query's own states
    texts: list[Any] | None = None  # an image query's candidate caption rows

    @property
    def query(self) -> Query:
        return self.ticket.payload


class BatchWorker:
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

    def top(self, vec: np.ndarray, index: Any, m: int) -> Candidates:
        # nprobe / efSearch go with this call only: the index is shared by every request
        dots, rows = ann.search(index, vec, m, self.search_knobs)
        return Candidates.of(dots[0], rows[0])

    def run_batch(self, tickets: Sequence[Ticket[Query, Answer]]) -> None:
        """Run the batch: its text queries the device step can serve as one step per chunk
        (GPU layout), the rest on the host path (`run_host`)."""
        if self.step is not None:
            stepped = [t for t in tickets if self.steppable(t.payload)]
            if stepped:
                self._run_steps(stepped)
                tickets = [t for t in tickets if not self.steppable(t.payload)]
        if tickets:
            self.run_host(tickets)

    def run_host(self, tickets: Sequence[Ticket[Query, Answer]]) -> None:
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
                    self.run_host([t])
                except Exception as exc:
                    log.exception("a query failed")
                    t.fail(exc)
            return
        self.throughput.observe("query", len(work), time.monotonic() - start)
        # a batched re-ranker (the cross-encoder) scores several queries' pairs per call, in
        # chunks of up to rerank_max_batch pairs of one re-ranker and one query kind
        chunk: list[_Work] = []
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

    # -- the device step (GPU layout) ---------------------------------------------------
    def prepare(self, index: IndexVersion) -> None:
        """Copy `index`'s search vectors and image states to the step's device (its resident
        tables, released with the version), when there is a step and the index is Flat and
        fits; otherwise its queries take the host path."""
        if self.step is None or index.resident is not None:
            return
        vectors = ann.flat_vectors(index.image_index)
        if vectors is None:
            log.info("index %s is not Flat: text queries take the host path", index.version)
            return
        need = vectors.nbytes + index.image_tokens.size * self.step.dtype.itemsize
        free = self.step.free_bytes()
        if free is not None and need > 0.8 * free:
            log.warning(
                "index %s's tables need %.1f GB of the device's %.1f GB free: host path",
                index.version,
                need / 1e9,
                free / 1e9,
            )
            return
        t0 = time.monotonic()
        try:
            index.resident = self.step.tables(vectors, index.image_tokens)
            index.resident.captions = self._captions(index)
        except (RuntimeError, ValueError) as exc:  # out of device memory, or a bad table
            log.warning("index %s stays on the host path: %s", index.version, exc)
            if index.resident is not None:
                index.resident.release()
                index.resident = None
            return
        log.info(
            "index %s resident on %s: %.1f MB in %.2fs",
            index.version,
            self.step.device,
            index.resident.nbytes / 1e6,
            time.monotonic() - t0,
        )

    def _captions(self, index: IndexVersion) -> CaptionTables | None:
        """The version's captions as the step's image queries read them (a Flat text index and
        a word tokenizer needed), or None: image queries then take the host path."""
        assert self.step is not None
        ids_of = getattr(self.model, "text_ids", None)
        vectors = ann.flat_vectors(index.text_index)
        if vectors is None or not callable(ids_of) or not self.step.reranks:
            return None
        rows = [ids_of(text) for text in index.store.all_texts()]
        if any(r is None for r in rows):
            return None
        width = max((len(r) for r in rows), default=1)
        ids = np.zeros((len(rows), width), np.int32)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = r
        return CaptionTables(vectors, ids, self.step.device)

    def warm_step(self, index: IndexVersion, measure: bool, max_batch: int, seconds: float) -> None:
        """With a step and `index` resident: measure the pair budget when `measure` (else
        keep `rerank_max_batch`), then build every shape a batch within it can run at."""
        tables = index.resident
        if self.step is None or not isinstance(tables, ResidentTables) or not tables.rows:
            return
        if measure and self.step.reranks:
            self.rerank_max_batch = self.measure_budget(tables)
        shapes = self.step.shapes_within(self.rerank_max_batch, max_batch)
        t0 = time.monotonic()
        built = self.step.warm_up(tables, shapes, seconds)
        self._seed_cost(tables, max_batch)
        log.info(
            "device step: %d of %d shapes built in %.1fs; pair budget %d",
            built,
            len(shapes),
            time.monotonic() - t0,
            self.rerank_max_batch,
        )

    def _seed_cost(self, tables: ResidentTables, max_batch: int) -> None:
        """The batch cost model's first observations, from batches as requests make them: a
        lone query re-ranked and not, and a full batch (the shapes are built by now)."""
        assert self.step is not None
        full = max(1, min(max_batch, self.rerank_max_batch // 50))
        for b, m, rerank in ((1, 50, True), (1, 10, False), (full, 50, True), (full, 10, False)):
            if rerank and not self.step.reranks:
                continue
            for _ in range(2):
                t0 = time.perf_counter()
                self.step(tables, [[2, 3, 4, 5, 6, 7]] * b, m, rerank)
                self.batch_cost.observe(b, b * m if rerank else 0, time.perf_counter() - t0)

    def measure_budget(self, tables: ResidentTables, candidates: int = 50, cap: int = 16384) -> int:
        """The pairs per batch past which the device gains under 10 % more pairs/s: batches
        of 1, 2, 4, ... queries of `candidates` each, timed (the batch cost model's first
        observations too). A bigger batch would only add waiting."""
        assert self.step is not None
        rates: dict[int, float] = {}
        for b in self.step.shapes.queries:
            if b * candidates > cap:
                break
            ids = [[2, 3, 4, 5, 6, 7]] * b
            self.step(tables, ids, candidates, True)  # builds the shape
            t0 = time.perf_counter()
            for _ in range(3):
                self.step(tables, ids, candidates, True)
            dt = (time.perf_counter() - t0) / 3
            rates[b] = b * candidates / dt
            self.batch_cost.observe(b, b * candidates, dt)
        best = max(rates.values())
        chosen = min(b for b, r in rates.items() if r >= 0.9 * best)
        log.info(
            "pair budget: %s pairs/s by queries per batch; %d pairs chosen",
            {b: round(r) for b, r in rates.items()},
            chosen * candidates,
        )
        return chosen * candidates

    def steppable(self, q: Query) -> bool:
        """Whether the device step serves `q`: a tokenised text query, or an image query, on a
        resident index (its captions resident for an image query), re-ranked by the
        cross-encoder or not at all."""
        tables = q.index.resident
        if not isinstance(tables, ResidentTables) or self.step is None:
            return False
        if q.kind == "text" and q.ids is None:
            return False
        if q.kind == "image" and (tables.captions is None or q.image is None):
            return False
        return q.plan.reranker == "none" or (q.plan.reranker == "ce" and self.step.reranks)

    def step_chunks(self, tickets: Sequence[Ticket[Query, Answer]]) -> list[list[_Work]]:
        """The tickets grouped by (index version, re-ranked or not), each group cut into
        chunks whose padded pairs fit `rerank_max_batch` (a lone query always fits)."""
        assert self.step is not None
        groups: dict[tuple[int, bool, str], list[_Work]] = {}
        start = time.monotonic()
        for t in tickets:
            q = t.payload
            groups.setdefault((id(q.index), q.plan.reranks, q.kind), []).append(
                _Work(t, {"queue": _ms(start - t.enqueued)})
            )
        chunks: list[list[_Work]] = []
        for (_, reranks, _), members in groups.items():
            chunk: list[_Work] = []
            for w in members:
                grown = [*chunk, w]
                b, _, m = self.step.padded(len(grown), 1, max(x.query.m for x in grown))
                if chunk and reranks and b * m > self.rerank_max_batch:
                    chunks.append(chunk)
                    grown = [w]
                chunk = grown
            chunks.append(chunk)
        return chunks

    def _run_steps(self, tickets: Sequence[Ticket[Query, Answer]]) -> None:
        for chunk in self.step_chunks(tickets):
            try:
                self._step_chunk(chunk)
            except Exception:
                # the host path computes the same answers: a failed step costs time only
                log.exception("the device step failed for %d queries; host path", len(chunk))
                self.run_host([w.ticket for w in chunk if w.ticket.alive])

    def _step_chunk(self, chunk: list[_Work]) -> None:
        assert self.step is not None
        q0 = chunk[0].query
        tables = q0.index.resident
        assert isinstance(tables, ResidentTables)
        m = max(w.query.m for w in chunk)
        t0 = time.monotonic()
        if q0.kind == "text":
            out = self.step(tables, [w.query.ids or [] for w in chunk], m, q0.plan.reranks)
        else:
            images = [w.query.image for w in chunk]
            pixels = pixel_bytes(images, self.step.model.cfg.image_size)  # type: ignore[arg-type]
            out = self.step.collect(
                self.step.launch_images(tables, pixels, m, q0.plan.reranks), len(chunk)
            )
        dt = time.monotonic() - t0
        pairs = sum(w.query.pairs for w in chunk)
        self.batch_cost.observe(len(chunk), pairs, dt)
        self.metrics.device_seconds.observe(dt)
        if q0.plan.reranks:
            self.metrics.rerank_batch_size.observe(pairs)
        for i, w in enumerate(chunk):
            n = w.query.m
            w.timings["device"] = _ms(dt)
            w.cand = Candidates.of(out.dots[i, :n], out.rows[i, :n])
            if w.query.kind == "image":  # the hits' captions, as the host path reads them
                with _clock([w], "lookup"):
                    w.texts = w.query.index.store.texts([int(r) for r in w.cand.rows])
            # what the `ce` scorer answers: the logit's sigmoid (`models.rerankers._ce`)
            scores = (
                None
                if out.logits is None
                else np.asarray(sigmoid(out.logits[i, : len(w.cand.rows)]), np.float32)
            )
            try:
                w.ticket.resolve(self._ranked(w, scores))
            except Exception as exc:
                log.exception("answering a query failed")
                w.ticket.fail(exc)

    def _encode(self, work: list[_Work]) -> dict[int, np.ndarray]:
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
                work[i].cand = Candidates.of(dots[j][:m_i], rows[j][:m_i])

    def _affordable(self, chunk: list[_Work]) -> float:
        """The share (0..1) of the chunk's candidates that can be re-ranked before the
        earliest deadline in it, at the measured seconds per pair of its re-ranker."""
        pairs = sum(len(w.cand.rows) for w in chunk)
        per_pair = self.throughput.seconds(pair_kind(chunk[0].query.plan))
        if pairs == 0 or per_pair <= 0:
            return 1.0
        now = time.monotonic()
        budget = min(w.ticket.remaining(now) for w in chunk) - self.throughput.seconds("query")
        return max(0.0, min(1.0, budget / (per_pair * pairs)))

    def _score_batched(self, chunk: list[_Work]) -> list[np.ndarray]:
        """One call of a batched re-ranker for the pairs of every query in `chunk` (as many
        of each query's candidates as fit the earliest deadline among them)."""
        share = self._affordable(chunk)
        texts: list[str] = []
        tokens: list[np.ndarray] = []
        dots: list[np.ndarray] = []
        sizes = []
        for w in chunk:
            n = math.floor(len(w.cand.rows) * share)
            sizes.append(n)
            q_texts, q_tokens = self._pairs(w, n)
            texts += q_texts
            tokens.append(q_tokens)
            dots.append(w.cand.dots[:n])
        scores = np.zeros(0, np.float32)
        if texts:
            q = chunk[0].query
            scores = self._scorers[q.plan.reranker](
                Pairs(
                    texts,
                    np.concatenate(tokens),
                    np.concatenate(dots),
                    q.kind == "text",
                    q.plan.theta,
                )
            )
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
            self.throughput.observe(pair_kind(chunk[0].query.plan), pairs, dt)
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
        plan = q.plan
        ranked = fused_top_k(w.cand.rows, w.cand.dots, scores, plan.fusion, plan.lam, q.top_k)
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


def pair_kind(plan: RerankPlan) -> str:
    """The cost-model kind of one re-ranked candidate: each re-ranker has its own price."""
    return REGISTRY[plan.reranker].cost_kind if plan.reranks else "pair/none"


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
