"""The device step's graphs as the engine's workers use them, on the CPU: graphs recorded
instead of captured (a capture keeps the step's run, a replay reruns it), so what is under
test is everything around CUDA's recording: which shapes are captured when (start-up, a
version swapped in, the pair budget's batches, image queries), that warm-up builds no
captured shape again, and that batches find their graphs and answer as the eager step does.
CUDA's own graphs are `tests/test_step_graphs.py`'s."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from app.batch import BatchWorker
from models.builtin import BuiltinModel
from models.device_step import DeviceStep
from models.step_graphs import (
    IMAGE,
    StepGraphs,
    batch_key,
    capture_shapes,
    image_key,
    varied_pixels,
)
from models.step_tables import CaptionTables
from store.indexio import IndexVersion, resolve_current
from tests.test_device_step import _worker
from tests.test_step_graphs import _batches


class _Recorded(StepGraphs):
    """Graphs as the plumbing around them sees them, on the CPU: a capture keeps the step's
    `run` and a static input, a replay copies the ids in and runs it again, counted by
    shape. What is under test is everything but CUDA's recording: which shapes are captured
    when, that the step's batches find them, and that their answers are the eager step's."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.lock, self._graphs, self.broken = device, threading.Lock(), {}, False
        self.replays: dict[tuple[int, int, int, bool], int] = {}

    def capture(self, key, host, run, check_syncs):  # type: ignore[no-untyped-def]
        self._graphs[key] = (key, host.clone(), run)  # type: ignore[assignment]
        return self._graphs[key]

    def replay(self, graph, host):  # type: ignore[no-untyped-def]
        key, tok, run = graph
        tok.copy_(host)
        self.replays[key] = self.replays.get(key, 0) + 1
        _, length, m, rerank = key
        return run(tok, length, m, rerank)


def _recorded(
    model: BuiltinModel,
    index_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    graphs: type[_Recorded] = _Recorded,
) -> tuple[DeviceStep, BatchWorker, IndexVersion]:
    """A GPU layout's worker whose step has graphs (recorded ones, as on CUDA), and the
    current index version prepared (resident) for it."""
    import models.device_step as device_step

    monkeypatch.setattr(device_step, "StepGraphs", graphs)
    step = DeviceStep(model.model, torch.device("cpu"), "fp32")
    step.graphs = step.image_graphs = True  # as on CUDA
    worker = _worker(model, step)
    index = IndexVersion.open(resolve_current(index_dir))
    worker.prepare(index)
    return step, worker, index


def test_the_workers_capture_at_warm_up_and_swap_and_batches_replay_them(
    index_dir: Path, model: BuiltinModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPU layout's worker with graphs (recorded ones, on the CPU): warm_step captures
    every shape within the budget; batches of 1, 3 and 4 queries replay their shape's graph
    and answer as the eager step does; the pair budget is timed on the graphs of the batches
    it times; a version prepared later is captured at the same shapes."""
    step, worker, first = _recorded(model, index_dir, monkeypatch)
    runs: dict[tuple[int, int, int, bool], int] = {}
    run = step.run

    def counted(tables, tok, length, m, rerank):  # type: ignore[no-untyped-def]
        key = (tok.shape[0], length, m, rerank)
        runs[key] = runs.get(key, 0) + 1
        return run(tables, tok, length, m, rerank)

    with monkeypatch.context() as patched:
        patched.setattr(step, "run", counted)
        patched.setattr(worker, "_seed_cost", lambda *_: None)  # its batches run the step too
        worker.warm_step(first, False, 4, 120.0)  # the budget as set (200 pairs): 4 queries
    tables = first.resident
    assert tables is not None and isinstance(tables.graphs, _Recorded)
    shapes = {(b, n, min(m, tables.rows), r) for b, n, m, r in worker.step_shapes}
    assert shapes and {k for k in tables.graphs._graphs if k[1] != IMAGE} == shapes
    # each shape run at start-up once for its capture's check and once replayed (a recorded
    # replay reruns it): warm-up runs no captured shape again
    assert runs == dict.fromkeys(shapes, 2)
    eager = DeviceStep(model.model, torch.device("cpu"), "fp32")
    plain = eager.tables(np.asarray(tables.vectors), np.asarray(first.image_tokens))
    for ids in [*_batches(model)[:2], _batches(model)[3]]:
        key = batch_key(step, tables, ids, 50, True)
        before = tables.graphs.replays.get(key, 0)
        got, want = step(tables, ids, 50, True), eager(plain, ids, 50, True)
        assert tables.graphs.replays.get(key, 0) == before + 1, key
        np.testing.assert_array_equal(got.rows, want.rows)
        assert got.logits is not None and want.logits is not None
        np.testing.assert_allclose(got.logits, want.logits, atol=1e-5)
    # the budget's batches (1 to 4 queries at a 200-pair cap here) timed on their graphs
    budget = worker.budget_shapes(cap=200)
    capture_shapes(step, tables, budget, 60.0)
    replays = dict(tables.graphs.replays)
    worker.measure_budget(tables, cap=200)
    for b, n, m, r in budget:
        assert tables.graphs.replays[(b, n, min(m, tables.rows), r)] > replays.get(
            (b, n, min(m, tables.rows), r), 0
        )
    second = IndexVersion.open(resolve_current(index_dir))
    worker.prepare(second)
    assert second.resident is not None and isinstance(second.resident.graphs, _Recorded)
    assert set(second.resident.graphs._graphs) == set(tables.graphs._graphs)
    second.close()
    first.close()


def test_image_queries_are_captured_and_replayed(
    index_dir: Path, model: BuiltinModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the captions resident, warm_step captures image queries at the text shapes'
    queries, candidates and modes, each run once for its check (and once replayed: a
    recorded replay reruns it), none again by warm-up; a batch of 3 image queries replays
    its padded shape's graph and answers as the eager step does."""
    step, worker, index = _recorded(model, index_dir, monkeypatch)
    tables = index.resident
    assert tables is not None and tables.captions is not None
    runs: dict[tuple[int, int, bool], int] = {}
    run_images = step.run_images

    def counted(tables, pixels, m, rerank):  # type: ignore[no-untyped-def]
        runs[(pixels.shape[0], m, rerank)] = runs.get((pixels.shape[0], m, rerank), 0) + 1
        return run_images(tables, pixels, m, rerank)

    with monkeypatch.context() as patched:
        patched.setattr(step, "run_images", counted)
        patched.setattr(worker, "_seed_cost", lambda *_: None)
        worker.warm_step(index, False, 4, 120.0)
    rows = tables.captions.rows
    images = {(b, IMAGE, min(m, rows), r) for b, _, m, r in worker.step_shapes}
    assert isinstance(tables.graphs, _Recorded) and len(images) > 4
    assert {k for k in tables.graphs._graphs if k[1] == IMAGE} == images
    assert runs == {(b, m, r): 2 for b, _, m, r in images}
    pixels = varied_pixels(3, model.model.cfg.image_size)
    key = image_key(step, tables, 3, 20, True)
    assert key == (4, IMAGE, 20, True) and key in images
    before = tables.graphs.replays[key]  # its check's replay
    got = step.collect(step.launch_images(tables, pixels, 20, True), 3)
    assert tables.graphs.replays[key] == before + 1
    eager = DeviceStep(model.model, torch.device("cpu"), "fp32")
    plain = eager.tables(np.asarray(tables.vectors), np.asarray(index.image_tokens))
    caps = tables.captions
    plain.captions = CaptionTables(np.asarray(caps.vectors), np.asarray(caps.ids), step.device)
    want = eager.collect(eager.launch_images(plain, pixels, 20, True), 3)
    np.testing.assert_array_equal(got.rows, want.rows)
    assert got.logits is not None and want.logits is not None
    np.testing.assert_allclose(got.logits, want.logits, atol=1e-5)
    index.close()


class _ImagesDiffer(_Recorded):
    """Recorded graphs whose image queries replay an answer unlike the eager step's."""

    def replay(self, graph, host):  # type: ignore[no-untyped-def]
        rows, dots, logits = super().replay(graph, host)
        return (rows, dots + 1.0, logits) if graph[0][1] == IMAGE else (rows, dots, logits)


def test_an_image_capture_that_disagrees_turns_off_image_graphs_alone(
    index_dir: Path, model: BuiltinModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An image query's graph unlike the eager step turns off the image queries' graphs (for
    this version and later ones); the text shapes keep theirs, and image queries answer
    through the eager step."""
    step, worker, index = _recorded(model, index_dir, monkeypatch, _ImagesDiffer)
    worker.warm_step(index, False, 4, 120.0)
    tables = index.resident
    assert tables is not None and isinstance(tables.graphs, _Recorded)
    shapes = {(b, n, min(m, tables.rows), r) for b, n, m, r in worker.step_shapes}
    assert step.graphs and not step.image_graphs and not tables.graphs.broken
    assert set(tables.graphs._graphs) == shapes  # every text shape, no image query
    pixels = varied_pixels(3, model.model.cfg.image_size)
    replays = dict(tables.graphs.replays)
    out = step.collect(step.launch_images(tables, pixels, 20, True), 3)
    assert tables.graphs.replays == replays and out.logits is not None  # answered eagerly
    second = IndexVersion.open(resolve_current(index_dir))
    worker.prepare(second)
    assert second.resident is not None and isinstance(second.resident.graphs, _Recorded)
    assert set(second.resident.graphs._graphs) == shapes
    second.close()
    index.close()


async def test_the_served_versions_graphs_are_counted_on_metrics(
    index_dir: Path, model: BuiltinModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`duet_cuda_graphs` counts the served version's graphs by query kind once start-up has
    captured them (recorded graphs on the CPU, as on CUDA); 0 before."""
    import models.device_step as device_step
    from app.cache import LRUCache, ResilientCache
    from app.metrics import Metrics
    from app.pipeline import SearchPipeline

    monkeypatch.setattr(device_step, "StepGraphs", _Recorded)
    step = DeviceStep(model.model, torch.device("cpu"), "fp32")
    step.graphs = step.image_graphs = True  # as on CUDA
    index = IndexVersion.open(resolve_current(index_dir))
    metrics = Metrics()
    cache = ResilientCache(LRUCache(100, 60.0), metrics, timeout_s=1.0)
    pipeline = SearchPipeline(
        model,
        index,
        cache,
        metrics,
        fusion_lambda=0.1,
        step=step,
        max_batch=4,
        rerank_max_batch=200,
    )

    def gauge(kind: str) -> float:
        return metrics.cuda_graphs.labels(queries=kind)._value.get()

    assert gauge("text") == gauge("image") == 0
    await pipeline.start()
    try:
        tables = index.resident
        assert tables is not None and tables.captions is not None
        shapes = pipeline.worker.step_shapes
        keys = {(b, n, min(m, tables.rows), r) for b, n, m, r in shapes}
        images = {(b, IMAGE, min(m, tables.captions.rows), r) for b, _, m, r in shapes}
        assert gauge("text") == len(keys) and gauge("image") == len(images) > 0
    finally:
        await pipeline.stop()
        index.close()
