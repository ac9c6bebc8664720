"""What a search is while the engine works on it: its plan, query, candidates and answer
(shared by the host path, `app.batch`, and the device step's, `app.stepping`)."""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from PIL import Image

from app.engine import Ticket
from app.errors import IndexUnreadable
from models.fusion import Ranked
from store.indexio import IndexVersion, ItemStore, TextRow

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
    # False: the answer leaves the hits' items to the asker (a front of the process layout,
    # `app.fronts`, looks them up itself: the process that owns the model does less per search)
    look_up: bool = True

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
    # a text query's hits: each image's captions (the page shows the one nearest the query)
    captions: dict[str, list[str]] = field(default_factory=dict)


_TOLD: dict[str, float] = {}  # what `warn_now_and_then` told last, and when


def warn_now_and_then(what: str, message: str, *args: object, every_s: float = 10.0) -> None:
    """A warning at most once every `every_s` per `what`: one per request of a damaged item
    store's filled the log (a line per search, with fronts two)."""
    now = time.monotonic()
    if now - _TOLD.get(what, -every_s) >= every_s:
        _TOLD[what] = now
        log.warning(message, *args)


class CaptionsUnread(dict[str, list[str]]):
    """No captions, because the item store could not read them (a file damaged in place):
    the answer goes out without them, but is not cached (it was, for the cache's TTL)."""


def _unreadable(exc: sqlite3.DatabaseError) -> IndexUnreadable:
    return IndexUnreadable(
        f"the served index version's item store cannot be read ({exc}): its files changed "
        "after the build that checked them; restore them or build the version again"
    )


def candidate_texts(store: ItemStore, rows: Any) -> list[TextRow]:
    """An image query's candidates' caption rows, which its re-ranker reads."""
    try:
        return store.texts([int(r) for r in rows])
    except sqlite3.DatabaseError as exc:
        raise _unreadable(exc) from exc


def items_of(
    store: ItemStore,
    kind: Literal["text", "image"],
    rows: Sequence[int],
    texts: Sequence[TextRow] | None = None,
) -> tuple[list[Meta], dict[str, list[str]]]:
    """What a response shows of its hits besides the ranking: each hit's id and meta (an
    image's with its path, a caption's with its text and image id) and, for image hits, each
    image's captions. `texts`: an image query's caption rows already read, in `rows` order."""
    if kind == "image":
        found = candidate_texts(store, rows) if texts is None else texts
        meta = [(t.id, {**t.meta, "text": t.text, "image_id": t.image_id}) for t in found]
        return meta, {}
    try:
        images = store.images(rows)
    except sqlite3.DatabaseError as exc:
        raise _unreadable(exc) from exc
    try:  # a courtesy: an unreadable caption leaves the hit without one
        captions = store.captions([r.id for r in images])
    except sqlite3.Error as exc:
        warn_now_and_then(
            "captions",
            "the hits' captions are unreadable (%s); answered without them, not "
            "cached (this warning: once in 10 s)",
            exc,
        )
        captions = CaptionsUnread()
    return [(r.id, {**r.meta, "image": r.path}) for r in images], captions


@dataclass
class Work:
    """A query between the batched stages and its own re-rank / look-up."""

    ticket: Ticket[Query, Answer]
    timings: dict[str, float]
    cand: Candidates = field(
        default_factory=lambda: Candidates(np.zeros(0, np.int64), np.zeros(0, np.float32))
    )
    image_tokens: np.ndarray | None = None  # an image query's own states
    texts: list[Any] | None = None  # an image query's candidate caption rows
    taken: float = field(default_factory=time.monotonic)  # when a worker took its batch
    alone: bool = True  # the only query of its batch

    def waited_for_others(self) -> None:
        """Time this query spent in the worker while its batch's other queries were served
        (their re-rank calls, their device steps, their look-ups) as the `batch` stage: the
        worker's time since it took the batch less this query's own stages, when it had
        batch-mates and it is more than a tenth of a millisecond. Without it, `timings_ms`
        under load left most of `total` to no stage (eight clients, 200 candidates each, on
        a CPU: a median 216 ms)."""
        if self.alone:
            return
        own = sum(v for k, v in self.timings.items() if k != "queue")
        waited = (time.monotonic() - self.taken) * 1000 - own
        if waited >= 0.1:
            self.timings["batch"] = round(waited, 3)

    @classmethod
    def taken_as_batch(
        cls,
        tickets: Sequence[Ticket[Query, Answer]],
        start: float | None = None,
        alone: bool | None = None,
    ) -> list[Work]:
        """Each ticket as a worker takes it: queued until `start` (default: now), in a batch of
        one when `alone` (default: when the tickets are one). A batch split between the device
        step and the host path passes its own `start` and `alone` to both halves."""
        start = time.monotonic() if start is None else start
        alone = len(tickets) == 1 if alone is None else alone
        return [
            cls(t, {"queue": ms(start - t.enqueued)}, taken=start, alone=alone) for t in tickets
        ]

    @property
    def query(self) -> Query:
        return self.ticket.payload


def ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


@contextmanager
def clock(work: list[Work], stage: str) -> Iterator[None]:
    """Add the block's wall time to `stage` of every query in `work` (they shared it)."""
    t0 = time.monotonic()
    try:
        yield
    finally:
        dt = ms(time.monotonic() - t0)
        for w in work:
            w.timings[stage] = round(w.timings.get(stage, 0.0) + dt, 3)
