"""FAISS's OpenMP threads around the engine's searches (`store.ann.search`): a lone query
searches on one thread (a second has nothing to do but costs the hand-off, and waits for a
core on a busy CPU), a batch of several on the worker's own count, which is left as it was."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path

import faiss
import pytest

from app.schemas import SearchOptions
from models.builtin import BuiltinModel
from store import ann, indexio
from tests.conftest import in_process_pipeline


async def test_a_lone_query_searches_on_one_thread_a_batch_on_the_workers_count(
    index_dir: Path, model: BuiltinModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[int | None] = []  # what each search asked of faiss_threads
    seen: list[tuple[int, int]] = []  # (queries in the call, FAISS threads during it)
    queries: list[int] = []  # queries in each search, in order
    after: list[int] = []  # FAISS threads in the worker once the block is left
    real_threads, real_search = ann.faiss_threads, ann.search

    @contextlib.contextmanager
    def threads(n: int | None) -> Iterator[None]:
        asked.append(n)
        before = faiss.omp_get_max_threads()
        with real_threads(n):
            seen.append((queries[-1], faiss.omp_get_max_threads()))
            yield
        after.append(faiss.omp_get_max_threads() - before)  # 0: restored

    def search(index, q, k, knobs=None):  # type: ignore[no-untyped-def]
        queries.append(len(q))
        return real_search(index, q, k, knobs)

    monkeypatch.setattr(ann, "faiss_threads", threads)  # as ann.search calls it
    monkeypatch.setattr(ann, "search", search)  # as app.batch calls it
    index = indexio.IndexVersion.open(indexio.resolve_current(index_dir))
    pipeline = in_process_pipeline(model, index, timeout_s=30.0, workers=1, max_batch=8)
    await pipeline.start()
    for record in (asked, seen, after, queries):  # the warm-up's own search went before
        record.clear()
    try:
        plan = pipeline.plan(SearchOptions(top_k=5, rerank=False))
        lone, _ = await pipeline.run(index, "text", "two blue squares", None, plan, 5, 5)
        texts = ["a red circle", "a small green cross", "two big triangles", "a blue square"]
        # the worker is busy with the first while the rest queue: they come as one batch
        answers = await asyncio.gather(
            *(pipeline.run(index, "text", t, None, plan, 5, 5) for t in [texts[0], *texts])
        )
    finally:
        await pipeline.stop()
        index.close()
    assert lone.ranked and all(a.ranked for a, _ in answers)
    assert asked[0] == 1 and seen[0] == (1, 1)  # the lone query: one thread
    batched = [n for n, (q, _) in zip(asked, seen, strict=True) if q > 1]
    assert batched and all(n is None for n in batched), (asked, seen)  # a batch: as it was
    assert all(n == 1 for n, (q, _) in zip(asked, seen, strict=True) if q == 1)
    assert after and not any(after)  # the worker's count restored after every search
