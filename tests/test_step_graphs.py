"""The device step's CUDA graphs (`models.step_graphs`): what runs on the CPU here (the
check that compares a replay with the eager step, the ids it captures with, graphs off off
CUDA, a failing capture turning them off), and on a CUDA host the graphs themselves against
the eager step (text and image queries), without a sync, from two threads at once, and for a
version swapped in. The workers' use of them: `tests/test_step_recorded.py`."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from models.builtin import BuiltinModel
from models.device_step import DeviceStep
from models.inference import Precision
from models.step_graphs import (
    CaptureBroke,
    StepGraphs,
    agree,
    capture_shapes,
    image_key,
    varied_ids,
    varied_pixels,
)
from models.step_tables import CaptionTables, ResidentTables
from tests.test_device_step import TEXTS, _table, _worker, caption_ids

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_agree_compares_rows_dots_and_logits() -> None:
    rows = np.arange(200).reshape(4, 50)
    dots = np.linspace(0, 1, 200, dtype=np.float32).reshape(4, 50)
    logits = dots * 3
    same = (rows, dots, logits)
    assert agree(same, (rows.copy(), dots + 1e-5, logits - 1e-5))
    assert not agree(same, (rows, dots, logits + 0.1))
    assert not agree(same, (rows, dots + 0.1, logits))
    assert not agree(same, (rows, dots, None))
    assert agree((rows, dots, None), (rows, dots, None))
    swapped = rows.copy()
    swapped[0, [3, 4]] = swapped[0, [4, 3]]  # a tie swapped: 2 of 200 rows differ
    assert agree(same, (swapped, dots, logits))
    assert not agree(same, (rows[::-1].copy(), dots, logits))
    assert not agree(same, (rows[:2], dots[:2], logits[:2]))


def test_varied_ids_differ_by_row_and_fit_the_width_and_vocabulary() -> None:
    ids = varied_ids(8, 16, 64)
    assert len(ids) == 8 and len({tuple(r) for r in ids}) == 8
    assert all(1 <= len(r) <= 16 and r[0] == 2 for r in ids)
    assert all(0 < t < 64 for r in ids for t in r)


def test_graphs_stay_off_off_cuda(model: BuiltinModel) -> None:
    """Asked for graphs on the CPU device, the step has none and captures none: the eager
    step answers."""
    step = DeviceStep(model.model, torch.device("cpu"), "fp32", graphs=True)
    assert not step.graphs
    vecs, toks = _table()
    tables = step.tables(vecs, toks)
    assert tables.graphs is None
    shapes = step.shapes_within(100, 2)
    assert capture_shapes(step, tables, shapes, 10.0) == 0
    ids = [model.tokenizer.ids(t) for t in TEXTS]
    assert step(tables, ids, 20, True).logits is not None


def _pair(
    precision: Precision = "fp16",
) -> tuple[DeviceStep, ResidentTables, DeviceStep, ResidentTables]:
    """A step with graphs and one without, each over its own copy of the same tables."""
    gpu = BuiltinModel.load(device="cuda", precision=precision)
    vecs, toks = _table()
    cuda_dev = torch.device("cuda")
    graphed = DeviceStep(gpu.model, cuda_dev, precision, graphs=True)
    eager = DeviceStep(gpu.model, cuda_dev, precision, graphs=False)
    return graphed, graphed.tables(vecs, toks), eager, eager.tables(vecs, toks)


def _batches(model: BuiltinModel) -> list[list[list[int]]]:
    ids = [model.tokenizer.ids(t) for t in TEXTS]
    return [ids[:1], ids[:3], ids, ids[1:3] * 2]


@cuda
def test_cuda_graphs_answer_as_the_eager_step(model: BuiltinModel) -> None:
    """Every shape within the budget captured and checked; then batches of 1, 3, 4 and 5
    queries (padded to 1, 4, 4, 8) answer through the graphs as the eager step does, both
    re-ranked and not, and a shape never captured still answers (eagerly)."""
    graphed, tables, eager, plain = _pair()
    shapes = graphed.shapes_within(400, 8)
    n = capture_shapes(graphed, tables, shapes, 120.0)
    assert tables.graphs is not None and not tables.graphs.broken
    assert n == len(tables.graphs) == len({(b, t, min(m, 300), r) for b, t, m, r in shapes})
    for ids in _batches(model):
        for m, rerank in ((50, True), (10, False), (20, True)):
            got, want = graphed(tables, ids, m, rerank), eager(plain, ids, m, rerank)
            np.testing.assert_array_equal(got.rows, want.rows)
            np.testing.assert_allclose(got.dots, want.dots, atol=1e-5)
            if rerank:
                assert got.logits is not None and want.logits is not None
                np.testing.assert_allclose(got.logits, want.logits, atol=1e-2)
    big = [model.tokenizer.ids(TEXTS[0])] * 16  # 16 x 50 pairs: past the budget, not captured
    got, want = graphed(tables, big, 50, True), eager(plain, big, 50, True)
    assert got.logits is not None and want.logits is not None
    np.testing.assert_allclose(got.logits, want.logits, atol=1e-2)


@cuda
def test_cuda_graphs_answer_image_queries_as_the_eager_step(model: BuiltinModel) -> None:
    """With the captions resident, image queries' graphs (1 and 3 queries, padded to 1 and
    4; re-ranked and not) answer as the eager step does."""
    graphed, tables, eager, plain = _pair()
    vecs, _ = _table()
    ids = caption_ids(len(vecs), [model.tokenizer.ids(t) for t in TEXTS])
    for t in (tables, plain):
        t.captions = CaptionTables(vecs, ids, torch.device("cuda"))
    modes = ((50, True), (10, False))
    shapes = [(b, graphed.text_buckets[0], m, r) for b in (1, 4) for m, r in modes]
    assert capture_shapes(graphed, tables, shapes, 60.0) == 2 * len(shapes)
    assert tables.graphs is not None and not tables.graphs.broken
    for q in (1, 3):
        pixels = varied_pixels(q, graphed.model.cfg.image_size)
        for m, rerank in modes:
            assert tables.graphs.get(image_key(graphed, tables, q, m, rerank)) is not None
            got = graphed.collect(graphed.launch_images(tables, pixels, m, rerank), q)
            want = eager.collect(eager.launch_images(plain, pixels, m, rerank), q)
            np.testing.assert_array_equal(got.rows, want.rows)
            np.testing.assert_allclose(got.dots, want.dots, atol=1e-5)
            if rerank:
                assert got.logits is not None and want.logits is not None
                np.testing.assert_allclose(got.logits, want.logits, atol=1e-2)


@cuda
def test_cuda_graph_replay_queues_without_a_sync(model: BuiltinModel) -> None:
    graphed, tables, eager, plain = _pair()
    shapes = [(4, t, 50, True) for t in graphed.text_buckets]
    assert capture_shapes(graphed, tables, shapes, 60.0) == len(shapes)
    ids = _batches(model)[1]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        launched = graphed.launch(tables, ids, 50, True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    out = graphed.collect(launched, len(ids))
    want = eager(plain, ids, 50, True)
    assert out.logits is not None and want.logits is not None
    np.testing.assert_allclose(out.logits, want.logits, atol=1e-2)


@cuda
def test_cuda_graphs_from_two_threads_keep_their_answers_apart(model: BuiltinModel) -> None:
    """Two workers replaying the same graph (and another) at once each get their own batch's
    answer: a replay's input, run and outputs are not interleaved with another's."""
    graphed, tables, eager, plain = _pair()
    shapes = [(b, t, 50, True) for b in (1, 4) for t in graphed.text_buckets]
    assert capture_shapes(graphed, tables, shapes, 60.0) == len(shapes)
    batches = [[model.tokenizer.ids(t)] for t in TEXTS] + [_batches(model)[1]]
    want = [eager(plain, ids, 50, True).logits for ids in batches]
    errors: list[str] = []

    def worker(k: int) -> None:
        for i in range(60):
            j = (i + k) % len(batches)
            got = graphed(tables, batches[j], 50, True).logits
            if got is None or not np.allclose(got, want[j], atol=1e-2):  # type: ignore[arg-type]
                errors.append(f"thread {k}, batch {j}")

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:5]


@cuda
def test_a_version_swapped_in_is_captured_while_the_old_one_serves(
    index_dir: Path, model: BuiltinModel
) -> None:
    """Once warm_step has run, `prepare` captures a later version's shapes too, while two
    threads go on answering from the old version's graphs and eager shapes (each answer
    checked); closing the version drops its graphs."""
    from store.indexio import IndexVersion, resolve_current

    gpu = BuiltinModel.load(device="cuda", precision="fp16")
    step = DeviceStep(gpu.model, torch.device("cuda"), "fp16", graphs=True)
    worker = _worker(gpu, step)
    first = IndexVersion.open(resolve_current(index_dir))
    worker.prepare(first)
    worker.warm_step(first, False, 4, 60.0)
    old = first.resident
    assert old is not None and old.graphs is not None and len(old.graphs) > 0
    assert worker.step_shapes and step.graphs
    batches = _batches(gpu)[:3]  # 1, 3 and 5 queries: captured (1, 4) and eager (8 > 4)
    want = [step(old, ids, 50, True) for ids in batches]
    stop, errors = threading.Event(), []

    def serve(k: int) -> None:
        i = k
        while not stop.is_set():
            i += 1
            got = step(old, batches[i % 3], 50, True)
            if not np.array_equal(got.rows, want[i % 3].rows):
                errors.append(f"thread {k}: batch {i % 3}")

    threads = [threading.Thread(target=serve, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    second = IndexVersion.open(resolve_current(index_dir))
    try:
        worker.prepare(second)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors[:5]
    tables = second.resident
    assert tables is not None and tables.graphs is not None and step.graphs
    assert len(tables.graphs) == len(old.graphs)
    second.close()
    assert tables.graphs is None
    first.close()


class _Faulty(StepGraphs):
    """Graphs that go wrong the way a real capture can (`how`: "raise" fails the capture once
    begun, "differ" replays an answer unlike the eager step's): what `capture_shapes` does
    then is under test, on the CPU."""

    def __init__(self, step: DeviceStep, tables: ResidentTables, how: str) -> None:
        self.device, self.lock, self._graphs, self.broken = step.device, threading.Lock(), {}, False
        self.step, self.tables, self.how = step, tables, how

    def capture(self, key, host, run, check_syncs):  # type: ignore[no-untyped-def]
        if self.how == "raise":
            raise CaptureBroke("operation not permitted when stream is capturing")
        self._graphs[key] = key
        return key

    def replay(self, graph, host):  # type: ignore[no-untyped-def]
        _, length, m, rerank = graph
        rows, dots, logits = self.step.run(self.tables, host, length, m, rerank)
        return rows, dots + 1.0, logits


@pytest.mark.parametrize("how", ["raise", "differ"])
def test_a_capture_that_fails_or_disagrees_turns_graphs_off(
    model: BuiltinModel, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A capture that fails, or a graph whose replay differs from the eager step, turns
    graphs off for the step (no later version gets any) and for these tables, with a
    warning; the eager step then answers every shape."""
    step = DeviceStep(model.model, torch.device("cpu"), "fp32")
    vecs, toks = _table()
    tables = step.tables(vecs, toks)
    tables.graphs = faulty = _Faulty(step, tables, how)
    step.graphs = step.image_graphs = True  # as on CUDA
    shapes = [(1, step.text_buckets[0], 10, False), (2, step.text_buckets[0], 20, True)]
    with caplog.at_level("WARNING", logger="duet.device_step"):
        assert capture_shapes(step, tables, shapes, 10.0) == 0
    assert "CUDA graphs off" in caplog.text
    assert not step.graphs and faulty.broken and len(faulty) == 0
    assert step.tables(vecs, toks).graphs is None  # a later version: none asked for
    ids = [model.tokenizer.ids(t) for t in TEXTS[:2]]
    eager = DeviceStep(model.model, torch.device("cpu"), "fp32")
    got, want = step(tables, ids, 20, True), eager(eager.tables(vecs, toks), ids, 20, True)
    np.testing.assert_array_equal(got.dots, want.dots)
