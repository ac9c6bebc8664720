"""FAISS's OpenMP threads around the engine's searches: a lone query searches on one thread
(a second has nothing to do but costs the hand-off, and waits for a core on a busy CPU), a
batch of several on FAISS's own count, and the worker's count is left as it was."""

from __future__ import annotations

import asyncio
from pathlib import Path

import faiss
import pytest

from app.schemas import SearchOptions
from models.builtin import BuiltinModel
from store import ann, indexio
from tests.conftest import in_process_pipeline


async def test_a_lone_query_searches_on_one_thread_a_batch_on_faiss_own(
    index_dir: Path, model: BuiltinModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[int, int]] = []  # (queries in the call, FAISS threads during it)
    real = ann.search

    def watched(index, queries, k, knobs=None):  # type: ignore[no-untyped-def]
        seen.append((len(queries), faiss.omp_get_max_threads()))
        return real(index, queries, k, knobs)

    monkeypatch.setattr(ann, "search", watched)  # as app.batch calls it
    index = indexio.IndexVersion.open(indexio.resolve_current(index_dir))
    pipeline = in_process_pipeline(model, index, timeout_s=30.0, workers=1, max_batch=8)
    await pipeline.start()
    try:
        plan = pipeline.plan(SearchOptions(top_k=5, rerank=False))
        default = await asyncio.to_thread(faiss.omp_get_max_threads)  # a fresh thread's count
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
    assert seen[0] == (1, 1)
    batched = [threads for n, threads in seen if n > 1]
    assert batched and all(t == default for t in batched), seen
    assert all(t == 1 for n, t in seen if n == 1), seen
