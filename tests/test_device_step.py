"""The GPU layout's device step (`models.device_step`), its batching and its cost model, run
on the CPU device here (the same code as on CUDA; the CUDA test at the end runs where a GPU
is)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import faiss
import numpy as np
import pytest
import torch

from app.batch import BatchWorker
from app.costs import BatchCost
from app.engine import Engine, Ticket
from app.metrics import Metrics
from models.builtin import BuiltinModel
from models.device_step import DeviceStep
from models.masked_cross import MaskedCrossEncoder
from models.step_tables import CaptionTables, ResidentTables, id_table
from store import ann
from tests.conftest import start_service, stop_service

TEXTS = [
    "a small red diamond left of a small yellow triangle",
    "two blue squares",
    "a red square",
    "a large green cross in the top left corner",
    "three purple circles",
]


def caption_ids(n: int, ids: list[list[int]]) -> np.ndarray:
    """A caption table's (n, 16) token ids: the given rows over and over, zero-padded."""
    return id_table([ids[i % len(ids)] for i in range(n)], 16)


def _table(n: int = 300, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    vecs = rng.standard_normal((n, 128)).astype(np.float32)
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    return vecs, rng.standard_normal((n, 16, 128)).astype(np.float16)


def test_masked_cross_encoder_equals_training_forward(model: BuiltinModel) -> None:
    """Padded and masked to fixed shapes, each pair's logit is the model's own forward's."""
    net = model.model
    ids, pad = model.tokenizer.batch(TEXTS)
    _, toks = _table(len(TEXTS))
    img = torch.from_numpy(toks.astype(np.float32))
    with torch.inference_mode():
        states = net.text_tokens(ids, pad)
        want = net.itm_logits(states, pad, img)
        width = 39  # wider than any text, as a bucket is: the extra positions are masked
        grown = torch.nn.functional.pad(states, (0, 0, 0, width - states.shape[1]))
        keep = torch.nn.functional.pad(~pad, (0, width - pad.shape[1]), value=False)
        got = MaskedCrossEncoder(net, torch.float32).logits(
            grown, keep, torch.arange(len(TEXTS)), img
        )
    np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-4)


def test_step_equals_host_path(model: BuiltinModel) -> None:
    """Search rows and dots equal FAISS's Flat search of the host path's query vectors, and
    the logits equal the serving runtime's (`score_pairs`), for a batch of mixed lengths."""
    vecs, toks = _table()
    step = DeviceStep(model.model, torch.device("cpu"), "fp32")
    tables = step.tables(vecs, toks)
    out = step(tables, [model.tokenizer.ids(t) for t in TEXTS], 30, True)
    assert out.logits is not None and out.rows.shape == (len(TEXTS), 50)  # 30 -> bucket 50
    index = faiss.IndexFlatIP(128)
    index.add(vecs)
    dots, rows = index.search(model.encode_texts(TEXTS), 50)
    for i, text in enumerate(TEXTS):
        np.testing.assert_array_equal(out.rows[i], rows[i])
        np.testing.assert_allclose(out.dots[i], dots[i], atol=1e-5)
        want = model.score_pairs([text] * 50, toks[rows[i]].astype(np.float32))
        np.testing.assert_allclose(out.logits[i], want, atol=1e-4)


def test_padding_changes_no_answer(model: BuiltinModel) -> None:
    """A query alone, or in a batch padded to 8 queries and a wider text bucket, gets the
    same candidates and scores; a dot-only step returns no logits."""
    vecs, toks = _table()
    step = DeviceStep(model.model, torch.device("cpu"), "fp32")
    tables = step.tables(vecs, toks)
    ids = [model.tokenizer.ids(t) for t in TEXTS]
    alone = step(tables, ids[2:3], 50, True)
    batch = step(tables, ids, 50, True)
    assert step.padded(len(ids), max(map(len, ids)), 50) == (8, 15, 50)
    np.testing.assert_array_equal(alone.rows[0], batch.rows[2])
    assert alone.logits is not None and batch.logits is not None
    np.testing.assert_allclose(alone.logits[0], batch.logits[2], atol=1e-4)
    dot_only = step(tables, ids, 10, False)
    assert dot_only.logits is None
    np.testing.assert_array_equal(dot_only.rows, batch.rows[:, :10])


def test_text_buckets_align_and_cover(model: BuiltinModel) -> None:
    step = DeviceStep(model.model, torch.device("cpu"), "fp32")
    assert all((1 + n + 16) % 8 == 0 for n in step.text_buckets)
    assert max(step.text_buckets) >= model.model.cfg.max_text_len
    # a lone query may exceed the pair budget; batches of more stay within it
    shapes = step.shapes_within(200, 8)
    reranked = [(b, m) for b, _, m, rerank in shapes if rerank]
    assert (1, 1000) in reranked and all(b * m <= 200 for b, m in reranked if b > 1)
    assert (8, 10) in reranked and (8, 50) not in reranked
    # dot-only batches: any number of queries up to max_batch, candidates up to top_k's 100
    dot = {(b, m) for b, _, m, rerank in shapes if not rerank}
    assert (8, 100) in dot and (8, 200) not in dot and (1, 200) not in dot


def test_half_precision_step_stays_close(model: BuiltinModel) -> None:
    """bf16 weights cast once at construction (the CPU has no fast fp16): the ranking of
    the candidates is the fp32 step's, to the precision's tolerance."""
    vecs, toks = _table()
    ids = [model.tokenizer.ids(t) for t in TEXTS[:2]]
    full = DeviceStep(model.model, torch.device("cpu"), "fp32")
    half = DeviceStep(model.model, torch.device("cpu"), "bf16")
    assert half.cross.layers[0].qkv[0].dtype == torch.bfloat16
    assert next(model.model.parameters()).dtype == torch.float32  # the model is untouched
    a = full(full.tables(vecs, toks), ids, 50, True)
    b = half(half.tables(vecs, toks), ids, 50, True)
    np.testing.assert_array_equal(a.rows, b.rows)
    assert a.logits is not None and b.logits is not None
    np.testing.assert_allclose(a.logits, b.logits, atol=0.15)


def test_tables_release_and_flat_only() -> None:
    vecs, toks = _table(20)
    tables = ResidentTables(vecs, toks, torch.device("cpu"), torch.float32)
    assert tables.rows == 20 and tables.nbytes == 20 * 128 * 4 + 20 * 16 * 128 * 4
    tables.release()
    assert tables.rows == 0 and tables.tokens.shape == (0, 16, 128)
    flat = faiss.IndexFlatIP(128)
    flat.add(vecs)
    got = ann.flat_vectors(flat)
    assert got is not None
    np.testing.assert_array_equal(got, vecs)
    hnsw = faiss.IndexHNSWFlat(128, 8, faiss.METRIC_INNER_PRODUCT)
    hnsw.add(vecs)
    assert ann.flat_vectors(hnsw) is None  # its queries take the host path
    with pytest.raises(ValueError, match="image-state rows"):
        ResidentTables(vecs, toks[:5], torch.device("cpu"), torch.float32)


def test_batch_cost_fits_fixed_and_per_pair_parts() -> None:
    cost = BatchCost(0.01, 0.01, 0.01)  # a poor first guess
    rng = np.random.default_rng(1)
    for _ in range(200):
        q = int(rng.integers(1, 64))
        pairs = q * int(rng.choice([0, 50]))
        cost.observe(q, pairs, 0.004 + 0.0001 * q + 0.00002 * pairs)
    assert cost.fixed_s == pytest.approx(0.004, rel=0.05)
    assert cost.ticket_s(50) == pytest.approx(0.0001 + 50 * 0.00002, rel=0.05)
    assert cost.batch_s(10, 500) == pytest.approx(0.004 + 0.001 + 0.01, rel=0.05)


async def test_engine_cuts_batches_by_units() -> None:
    """Tickets of 50 units under a 120-unit budget run two to a batch; a lone ticket larger
    than the budget still runs; the queue's fixed cost per batch enters the wait."""
    sizes: list[int] = []
    gate = threading.Event()

    def run(batch: list[Ticket[int, int]]) -> None:
        gate.wait(5)
        sizes.append(sum(t.payload for t in batch))
        for t in batch:
            t.resolve(t.payload)

    engine: Engine[int, int] = Engine(
        run,  # type: ignore[arg-type]
        workers=1,
        max_batch=64,
        max_queue=100,
        timeout_s=30,
        units=lambda p: p,
        max_units=120,
        batch_cost_s=lambda: 0.5,
    )
    engine.start()
    try:
        first = asyncio.ensure_future(engine.submit(500, 0.0))  # alone, over the budget
        await asyncio.sleep(0.2)  # the worker holds it at the gate
        rest = [asyncio.ensure_future(engine.submit(50, 0.01)) for _ in range(5)]
        await asyncio.sleep(0.1)
        # five tickets of 50 in batches of <= 120 units: 3 batches, 0.5 s each, ahead
        assert engine.wait_s() == pytest.approx(1.5 + 5 * 0.01, abs=0.02)
        gate.set()
        assert await first == 500
        assert await asyncio.gather(*rest) == [50] * 5
    finally:
        engine.stop()
    assert sizes == [500, 100, 100, 50]


@pytest.mark.slow
def test_service_gpu_layout_on_cpu_answers_as_cpu_layout(index_dir: Path, tmp_path: Path) -> None:
    """`DUET_LAYOUT=gpu` on the CPU device (the step's code path, real uvicorn): the same hits
    and scores as the CPU layout, a `device` stage, the step on /metrics; image queries and
    other re-rankers still answer through the host path."""
    env = {"DUET_DEVICE": "cpu", "DUET_MAX_BATCH": "8", "DUET_RERANK_MAX_BATCH": "200"}
    gpu = start_service(index_dir, tmp_path / "gpu.log", DUET_LAYOUT="gpu", **env)
    cpu = start_service(index_dir, tmp_path / "cpu.log", DUET_LAYOUT="cpu", **env)
    try:
        with gpu.client() as g, cpu.client() as c:
            for body in (
                {"query": TEXTS[0], "top_k": 5},
                {"query": TEXTS[1], "top_k": 3, "candidates": 20, "fusion": "norm_add"},
                {"query": TEXTS[2], "top_k": 4, "rerank": False},
            ):
                a = g.post("/search/text", json=body).json()
                b = c.post("/search/text", json=body).json()
                assert [h["id"] for h in a["hits"]] == [h["id"] for h in b["hits"]], body
                for x, y in zip(a["hits"], b["hits"], strict=True):
                    assert x["score"] == pytest.approx(y["score"], abs=1e-4)
                    assert x["retrieval_score"] == pytest.approx(y["retrieval_score"], abs=1e-5)
                assert "device" in a["timings_ms"] and "device" not in b["timings_ms"]
            upload = _corpus_image(index_dir)
            a = g.post("/search/image", files={"image": ("q.png", upload)}, data={"top_k": "4"})
            b = c.post("/search/image", files={"image": ("q.png", upload)}, data={"top_k": "4"})
            assert a.status_code == 200, a.text
            assert [h["id"] for h in a.json()["hits"]] == [h["id"] for h in b.json()["hits"]]
            for x, y in zip(a.json()["hits"], b.json()["hits"], strict=True):
                assert x["score"] == pytest.approx(y["score"], abs=1e-4)
            assert "device" in a.json()["timings_ms"]  # image queries take the step too
            late = g.post("/search/text", json={"query": TEXTS[3], "reranker": "late"})
            assert late.status_code == 200 and "device" not in late.json()["timings_ms"]
            metrics = g.get("/metrics").text
            count = next(
                line
                for line in metrics.splitlines()
                if line.startswith("duet_device_step_seconds_count")
            )
            assert float(count.split()[-1]) >= 3
        log = (tmp_path / "gpu.log").read_text()
        assert "resident on cpu" in log and "device step:" in log
    finally:
        stop_service(gpu)
        stop_service(cpu)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_step_launches_without_a_sync(model: BuiltinModel) -> None:
    """On CUDA the step from the ids' copy in to the logits queues its work without one
    host-device synchronisation (torch raises on any under sync debug mode "error"); the
    copy back is the one wait. fp16 logits stay within fp16's reach of the CPU's."""
    gpu = BuiltinModel.load(device="cuda", precision="fp16")
    vecs, toks = _table()
    step = DeviceStep(gpu.model, torch.device("cuda"), "fp16")
    tables = step.tables(vecs, toks)
    ids = [gpu.tokenizer.ids(t) for t in TEXTS]
    step(tables, ids, 50, True)  # first call: kernels load, allocator grows
    torch.cuda.synchronize()
    # image queries too: captions of the test texts' ids over random caption vectors
    tables.captions = CaptionTables(vecs, caption_ids(len(vecs), ids), torch.device("cuda"))
    pixels = torch.randint(0, 255, (3, 3, 64, 64), dtype=torch.uint8)
    step.collect(step.launch_images(tables, pixels, 50, True), 3)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        launched = step.launch(tables, ids, 50, True)
        launched_images = step.launch_images(tables, pixels, 50, True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert step.collect(launched_images, 3).logits is not None
    out = step.collect(launched, len(ids))
    cpu = DeviceStep(model.model, torch.device("cpu"), "fp32")
    want = cpu(cpu.tables(vecs, toks), ids, 50, True)
    np.testing.assert_array_equal(out.rows, want.rows)
    assert out.logits is not None and want.logits is not None
    np.testing.assert_allclose(out.logits, want.logits, rtol=2e-3, atol=5e-2)


def test_a_version_resident_on_the_device_releases_it_on_close(
    index_dir: Path, model: BuiltinModel
) -> None:
    """`BatchWorker.prepare` copies a version's vectors and image states to the step's device;
    closing the version (what a swap does once no request holds it) frees them."""
    from store.indexio import IndexVersion, resolve_current

    version = IndexVersion.open(resolve_current(index_dir))
    step = DeviceStep(model.model, torch.device("cpu"), "fp32")
    worker = _worker(model, step)
    worker.prepare(version)
    tables = version.resident
    assert isinstance(tables, ResidentTables)
    assert tables.rows == version.image_index.ntotal > 0
    np.testing.assert_array_equal(
        tables.tokens.numpy(), np.asarray(version.image_tokens, dtype=np.float32)
    )
    version.close()
    assert version.resident is None and tables.rows == 0 and tables.tokens.numel() == 0


def _corpus_image(index_dir: Path) -> bytes:
    import json

    current = (index_dir / "current").resolve()
    corpus = Path(json.loads((current / "manifest.json").read_text())["corpus"]).parent
    return next((corpus / "images").glob("*.png")).read_bytes()


def test_image_queries_step_equals_host_path(index_dir: Path, model: BuiltinModel) -> None:
    """An image query on the step: its caption candidates are FAISS's over the host path's
    image vector, and each caption's logit is the serving runtime's with the query's states
    rounded to float16 (as the host path reads them)."""
    import io

    from PIL import Image

    from models.builtin import pixel_bytes
    from store.indexio import IndexVersion, resolve_current

    version = IndexVersion.open(resolve_current(index_dir))
    step = DeviceStep(model.model, torch.device("cpu"), "fp32")
    worker = _worker(model, step)
    worker.prepare(version)
    tables = version.resident
    assert isinstance(tables, ResidentTables) and tables.captions is not None
    assert tables.captions.rows == version.text_index.ntotal
    image = Image.open(io.BytesIO(_corpus_image(index_dir)))
    pixels = pixel_bytes([image, image.rotate(90)], model.model.cfg.image_size)
    out = step.collect(step.launch_images(tables, pixels, 20, True), 2)
    vecs, toks = model.encode_images([image, image.rotate(90)])
    _, rows = ann.search(version.text_index, vecs, 20)
    assert out.logits is not None
    for i in range(2):
        np.testing.assert_array_equal(out.rows[i], rows[i])
        texts = [t.text for t in version.store.texts([int(r) for r in rows[i]])]
        want = model.score_pairs(texts, np.repeat(toks[i][None], 20, axis=0))
        np.testing.assert_allclose(out.logits[i], want, atol=1e-4)
    version.close()


def _worker(model: BuiltinModel, step: DeviceStep) -> BatchWorker:
    """An engine worker with the step, as the service makes one (no re-rankers needed)."""
    return BatchWorker(
        model,
        {},
        Metrics(),
        search_knobs=ann.SearchKnobs(),
        rerank_max_batch=200,
        cores=1,
        torch_threads=None,
        worker_nice=0,
        step=step,
    )


def test_a_query_stepped_after_its_batch_mates_chunk_names_that_wait(
    index_dir: Path, model: BuiltinModel
) -> None:
    """Two re-ranked text queries whose pairs need a device step each (a pair budget of
    20): the second waits in the worker for the first's step, which its `batch` stage says;
    a query alone in its batch has none."""
    from app.work import Answer, Query, RerankPlan
    from store.indexio import IndexVersion, resolve_current

    version = IndexVersion.open(resolve_current(index_dir))
    worker = _worker(model, DeviceStep(model.model, torch.device("cpu"), "fp32"))
    worker.prepare(version)
    worker.rerank_max_batch = 20
    got: dict[str, Answer] = {}

    def ticket(text: str) -> Ticket[Query, Answer]:
        plan = RerankPlan("ce", "add", 0.1, None)
        q = Query("text", text, None, version, plan, 20, 5, model.text_ids(text), True)

        def done(answer: Answer | None, exc: BaseException | None) -> None:
            assert answer is not None, exc
            got[text] = answer

        return Ticket(q, 0.01, 1e12, None, None, done)

    worker.run_batch([ticket("a red circle"), ticket("two blue squares")])
    first, second = got["a red circle"].timings, got["two blue squares"].timings
    assert second["batch"] >= 0.5 * first["device"], (first, second)
    worker.run_batch([ticket("a green cross")])
    assert "batch" not in got["a green cross"].timings
    version.close()
