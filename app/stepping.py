"""The device step's side of the engine's workers (the GPU layout, `models.device_step`):
each index version's resident tables, the warm-up and pair budget, and batches of queries
run as one device step each. `app.batch.BatchWorker` is a `DeviceStepping`."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np

from app.costs import BatchCost
from app.engine import Ticket
from app.errors import DuetError
from app.metrics import Metrics
from app.work import Answer, Candidates, Query, Work, candidate_texts, clock, ms, warn_now_and_then
from models.builtin import pixel_bytes
from models.device_step import DeviceStep, text_ids_of
from models.fusion import sigmoid
from models.protocols import JointEncoder
from models.step_graphs import StepGraphs, capture_shapes, graph_counts
from models.step_tables import CaptionTables, ResidentTables, id_table
from store import ann
from store.indexio import IMAGE_VECTORS, TEXT_VECTORS, IndexVersion

log = logging.getLogger("duet.pipeline")

BUDGET_QUERY = (2, 3, 4, 5, 6, 7)  # the token ids of each query the pair budget is timed on


def exact_vectors(index: IndexVersion, text: bool) -> np.ndarray | None:
    """The vectors the step searches exactly: a Flat index's own; for an approximate one
    (IVF, HNSW: the builder's choice for large corpora, a CPU's), the float32 vectors the
    version keeps beside it for --append/--delete, row for row; None without them."""
    faiss_index = index.text_index if text else index.image_index
    vectors = ann.flat_vectors(faiss_index)
    if vectors is not None:
        return vectors
    kept = index.path / (TEXT_VECTORS if text else IMAGE_VECTORS)
    if not kept.is_file():
        return None
    try:
        table = np.load(kept, mmap_mode="r")
    except (OSError, ValueError):
        return None
    if table.ndim != 2 or table.shape != (faiss_index.ntotal, faiss_index.d):
        return None
    return np.array(table, dtype=np.float32)  # read once, into memory the step may own


class DeviceStepping:
    """The device-step methods of the engine's workers; what they read of the worker is
    declared here."""

    step: DeviceStep | None
    step_shapes: Sequence[tuple[int, int, int, bool]] = ()  # the shapes warm_step built
    model: JointEncoder
    metrics: Metrics
    batch_cost: BatchCost
    rerank_max_batch: int

    def _ranked(self, w: Work, scores: np.ndarray | None) -> Answer:
        raise NotImplementedError

    def run_host(
        self,
        tickets: Sequence[Ticket[Query, Answer]],
        start: float | None = None,
        alone: bool | None = None,
    ) -> None:
        raise NotImplementedError

    def prepare(self, index: IndexVersion) -> None:
        """Copy `index`'s search vectors and image states to the step's device (its resident
        tables, released with the version), when there is a step and the index is Flat and
        fits; otherwise its queries take the host path."""
        if self.step is None or index.resident is not None:
            return
        vectors = exact_vectors(index, text=False)
        if vectors is None:
            log.info(
                "index %s is not Flat and kept no vectors: text queries take the host path",
                index.version,
            )
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
        if self.step_shapes and index.resident.graphs is not None:  # a version swapped in
            n = capture_shapes(self.step, index.resident, self.step_shapes, 60.0)
            log.info("index %s: %d shapes captured as CUDA graphs", index.version, n)

    def _captions(self, index: IndexVersion) -> CaptionTables | None:
        """The version's captions as the step's image queries read them (a Flat text index and
        a word tokenizer needed), or None: image queries then take the host path."""
        assert self.step is not None
        ids_of = text_ids_of(self.model)
        vectors = exact_vectors(index, text=True)
        if vectors is None or ids_of is None or not self.step.reranks:
            return None
        texts = list(index.store.all_texts())
        if len(texts) != vectors.shape[0]:
            raise ValueError(f"{vectors.shape[0]} caption vectors but {len(texts)} captions")
        free = self.step.free_bytes()  # what is left beside the image tables just copied

        def fits(width: int) -> bool:  # float32 vectors and int32 ids, with room to spare
            need = len(texts) * (vectors.shape[1] + width) * 4
            if free is None or need <= 0.8 * free:
                return True
            log.warning(
                "index %s's caption tables need %.1f GB of the device's %.1f GB free: image "
                "queries take the host path",
                index.version,
                need / 1e9,
                free / 1e9,
            )
            return False

        if not fits(0):  # the vectors alone: known before any caption is tokenised
            return None
        # each distinct caption tokenised once (corpora repeat captions: the 1M benchmark
        # corpus lists each 50 times)
        distinct: dict[str, int] = {}
        which = np.fromiter(
            (distinct.setdefault(t, len(distinct)) for t in texts), np.int64, len(texts)
        )
        rows = [r for r in (ids_of(text) for text in distinct) if r is not None]
        if len(rows) != len(distinct):
            return None
        table = id_table(rows)
        if not fits(table.shape[1]):
            return None
        return CaptionTables(vectors, table[which], self.step.device)

    def warm_step(self, index: IndexVersion, measure: bool, max_batch: int, seconds: float) -> None:
        """With a step and `index` resident: measure the pair budget when `measure` (else
        keep `rerank_max_batch`), then build every shape a batch within it can run at."""
        tables = index.resident
        if self.step is None or not isinstance(tables, ResidentTables) or not tables.rows:
            return
        if measure and self.step.reranks:
            # timed as it will serve: with graphs, each batch size is captured first
            budget = self.budget_shapes()
            capture_shapes(self.step, tables, budget, seconds, check_syncs=True, images=False)
            self.rerank_max_batch = self.measure_budget(tables)
        shapes = self.step.shapes_within(self.rerank_max_batch, max_batch)
        t0 = time.monotonic()
        self.step_shapes = shapes  # what a version swapped in later is captured at
        # captured first: each capture's check runs its shape eagerly, so warm-up then builds
        # only the shapes left without a graph (and the image queries')
        capture_shapes(self.step, tables, shapes, seconds, check_syncs=True)
        built = self.step.warm_up(tables, shapes, seconds)
        self._seed_cost(tables, max_batch)
        log.info(
            "device step: %d of %d shapes built in %.1fs, %s; pair budget %d",
            built,
            len(shapes),
            time.monotonic() - t0,
            _graphed(tables.graphs),
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
                self.step(tables, [list(BUDGET_QUERY)] * b, m, rerank)
                self.batch_cost.observe(b, b * m if rerank else 0, time.perf_counter() - t0)

    def budget_shapes(
        self, candidates: int = 50, cap: int = 16384
    ) -> list[tuple[int, int, int, bool]]:
        """The shapes `measure_budget` times: its batches of 1, 2, 4, ... six-token queries."""
        assert self.step is not None
        longest = len(BUDGET_QUERY)
        shapes = [self.step.padded(b, longest, candidates) for b in self.step.shapes.queries]
        return [(b, n, m, True) for b, n, m in shapes if b * candidates <= cap]

    def measure_budget(self, tables: ResidentTables, candidates: int = 50, cap: int = 16384) -> int:
        """The pairs per batch past which the device gains under 10 % more pairs/s: batches
        of 1, 2, 4, ... queries of `candidates` each, timed (the batch cost model's first
        observations too). A bigger batch would only add waiting."""
        assert self.step is not None
        rates: dict[int, float] = {}
        for b, _, _, _ in self.budget_shapes(candidates, cap):
            ids = [list(BUDGET_QUERY)] * b
            self.step(tables, ids, candidates, True)  # untimed: builds the shape, or replays it
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

    def step_chunks(
        self,
        tickets: Sequence[Ticket[Query, Answer]],
        start: float | None = None,
        alone: bool | None = None,
    ) -> list[list[Work]]:
        """The tickets grouped by (index version, re-ranked or not), each group cut into
        chunks whose padded pairs fit `rerank_max_batch` (a lone query always fits); `start`
        and `alone` as `run_host` takes them."""
        assert self.step is not None
        groups: dict[tuple[int, bool, str], list[Work]] = {}
        for w in Work.taken_as_batch(tickets, start, alone):
            q = w.query
            groups.setdefault((id(q.index), q.plan.reranks, q.kind), []).append(w)
        chunks: list[list[Work]] = []
        for (_, reranks, _), members in groups.items():
            chunk: list[Work] = []
            for w in members:
                grown = [*chunk, w]
                b, _, m = self.step.padded(len(grown), 1, max(x.query.m for x in grown))
                if chunk and reranks and b * m > self.rerank_max_batch:
                    chunks.append(chunk)
                    grown = [w]
                chunk = grown
            chunks.append(chunk)
        return chunks

    def _run_steps(
        self, tickets: Sequence[Ticket[Query, Answer]], start: float, alone: bool
    ) -> None:
        for chunk in self.step_chunks(tickets, start, alone):
            try:
                self._step_chunk(chunk)
            except Exception:
                # the host path computes the same answers: a failed step costs time only
                log.exception("the device step failed for %d queries; host path", len(chunk))
                self.run_host([w.ticket for w in chunk if w.ticket.alive])

    def _step_chunk(self, chunk: list[Work]) -> None:
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
            w.timings["device"] = ms(dt)
            w.cand = Candidates.of(out.dots[i, :n], out.rows[i, :n])
            # what the `ce` scorer answers: the logit's sigmoid (`models.rerankers._ce`)
            scores = (
                None
                if out.logits is None
                else np.asarray(sigmoid(out.logits[i, : len(w.cand.rows)]), np.float32)
            )
            try:
                # an image query's hits' captions, as the host path reads them (unless the
                # asker looks its hits up itself): an unreadable store fails this query alone
                if w.query.kind == "image" and w.query.look_up:
                    with clock([w], "lookup"):
                        w.texts = candidate_texts(w.query.index.store, w.cand.rows)
                w.ticket.resolve(self._ranked(w, scores))
            except DuetError as exc:  # the asker's answer says it (a 503 index_unreadable)
                warn_now_and_then(exc.code, "queries failed (once in 10 s): %s", exc.message)
                w.ticket.fail(exc)
            except Exception as exc:
                log.exception("answering a query failed")
                w.ticket.fail(exc)


def _graphed(graphs: StepGraphs | None) -> str:
    """How many CUDA graphs a version holds, for the start-up log."""
    if graphs is None:
        return "no CUDA graphs"
    return f"{len(graphs)} CUDA graphs ({graph_counts(graphs)['image']} of them image queries')"
