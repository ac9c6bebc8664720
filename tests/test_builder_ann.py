"""The builder's ANN layer at scale, without a build: index factories, per-call search
parameters (never set on the shared index), recall against brute force, deterministic index
bytes, device selection and the autocast encode path."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import pytest
import torch

from index_builder.encode import autocast_dtype
from models.builtin import BuiltinModel
from models.device import DeviceError, resolve_device
from store import ann
from tests.builder_helpers import FAMILIES


def _unit(n: int, d: int = 32, seed: int = 0) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_default_factory_follows_faiss_guidance() -> None:
    assert ann.default_factory(40) == "Flat"
    assert ann.default_factory(ann.FLAT_MAX) == "Flat"
    ivf = ann.default_factory(500_000)
    nlist = int(ivf[3 : ivf.index(",")])
    assert ivf.endswith(",Flat") and 4 * 500_000**0.5 <= nlist <= 16 * 500_000**0.5
    assert ann.default_factory(5_000_000).endswith("_HNSW32,SQ8")
    index = ann.make_index("IVF1024,Flat", 32)
    assert 30 * 1024 <= ann.training_size(index, 10**7) <= 256 * 1024
    assert ann.training_size(index, 5000) == 5000


def test_recall_matches_brute_force() -> None:
    vecs, queries = _unit(3000), _unit(200, seed=1)
    index = ann.build_index("IVF32,Flat", vecs)
    truth = np.argsort(-(queries @ vecs.T), axis=1)[:, :10]
    for nprobe in (1, 4, 32):
        knobs = ann.SearchKnobs(nprobe=nprobe)
        params = ann.search_params(index, knobs)
        assert params is not None
        _, got = index.search(queries, 10, params=params.params)
        expected = np.mean([len(set(g) & set(t)) / 10 for g, t in zip(got, truth, strict=True)])
        assert ann.recall_at_k(index, vecs, queries, 10, knobs) == pytest.approx(expected)
    assert ann.recall_at_k(index, vecs, queries, 10, ann.SearchKnobs(nprobe=32)) == 1.0
    assert ann.recall_at_k(index, vecs, queries, 10, ann.SearchKnobs(nprobe=1)) < 0.9


def test_per_call_params_do_not_touch_the_shared_index() -> None:
    vecs, queries = _unit(4000), _unit(50, seed=2)
    ivf = ann.build_index("IVF64,Flat", vecs)
    hnsw: Any = ann.build_index("HNSW32", vecs)
    own_nprobe, own_ef = faiss.extract_index_ivf(ivf).nprobe, hnsw.hnsw.efSearch
    cases = [
        (ivf, ann.SearchKnobs(nprobe=1)),
        (ivf, ann.SearchKnobs(nprobe=64)),
        (hnsw, ann.SearchKnobs(ef_search=16)),
        (hnsw, ann.SearchKnobs(ef_search=256)),
    ]
    expected = [ann.search(index, queries, 10, knobs)[1] for index, knobs in cases]
    assert not np.array_equal(expected[0], expected[1])  # nprobe matters here
    results: dict[int, list[np.ndarray]] = {i: [] for i in range(len(cases))}
    start = threading.Barrier(len(cases))

    def run(i: int) -> None:
        start.wait()
        for _ in range(30):
            results[i].append(ann.search(cases[i][0], queries, 10, cases[i][1])[1])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, got in results.items():
        assert all(np.array_equal(g, expected[i]) for g in got), cases[i][1]
    assert faiss.extract_index_ivf(ivf).nprobe == own_nprobe
    assert hnsw.hnsw.efSearch == own_ef


def test_service_search_uses_its_settings_per_call() -> None:
    from types import SimpleNamespace

    from app.batch import BatchWorker
    from app.config import Settings

    settings = Settings(index_nprobe=1, index_ef_search=8)
    vecs, query = _unit(4000), _unit(1, seed=3)
    index = ann.build_index("IVF64,Flat", vecs)
    faiss.extract_index_ivf(index).nprobe = 64  # what the pipeline must not rely on or touch
    fake = SimpleNamespace(
        search_knobs=ann.SearchKnobs(settings.index_nprobe, settings.index_ef_search)
    )
    cand = BatchWorker.top(fake, query, index, 10)  # type: ignore[arg-type]
    _, want = ann.search(index, query, 10, ann.SearchKnobs(nprobe=1))
    assert cand.rows.tolist() == want[0][want[0] >= 0].tolist()
    assert faiss.extract_index_ivf(index).nprobe == 64
    assert Settings().index_nprobe == ann.DEFAULT_NPROBE


def test_ivf_hnsw_quantizer_gets_ef_search_per_call() -> None:
    index = ann.build_index("IVF16_HNSW32,SQ8", _unit(2000))
    params = ann.search_params(index, ann.SearchKnobs(nprobe=8, ef_search=40))
    assert params is not None and params.params.nprobe == 8
    assert params.params.quantizer_params is not None and params.keep[0].efSearch == 40
    assert ann.search_params(ann.build_index("Flat", _unit(10)), ann.SearchKnobs()) is None


def test_same_vectors_same_index_bytes() -> None:
    vecs = _unit(400)
    for factory in FAMILIES:
        a = faiss.serialize_index(ann.build_index(factory, vecs))
        b = faiss.serialize_index(ann.build_index(factory, vecs))
        assert a.tobytes() == b.tobytes(), factory


def test_an_hnsw_quantized_ivf_fills_on_every_core_with_the_same_bytes() -> None:
    """Only a graph index is filled on one thread; an IVF whose coarse quantizer is an HNSW
    graph (1M vectors and up) fills on every core, byte for byte as on one (its graph is made
    when it trains; filling only searches it)."""
    vecs = _unit(20_000)
    factory = "IVF256_HNSW32,SQ8"  # a graph of 256 centroids: threads could order it
    threads = faiss.omp_get_max_threads()
    try:
        faiss.omp_set_num_threads(1)
        one = faiss.serialize_index(ann.build_index(factory, vecs)).tobytes()
        faiss.omp_set_num_threads(max(2, threads))
        many = faiss.serialize_index(ann.build_index(factory, vecs)).tobytes()
    finally:
        faiss.omp_set_num_threads(threads)
    assert one == many
    assert not ann._add_builds_a_graph(ann.make_index(factory, 128))
    assert ann._add_builds_a_graph(ann.make_index("HNSW32", 128))


def test_device_selection() -> None:
    assert resolve_device("cpu").type == "cpu"
    assert autocast_dtype(torch.device("cpu")) is None
    if not torch.cuda.is_available():
        assert resolve_device("auto").type == "cpu"
        with pytest.raises(DeviceError):
            resolve_device("cuda")


def test_autocast_path_matches_fp32(model: BuiltinModel, corpus: Path) -> None:
    """The GPU path's autocast code, run on CPU in fp16: same shapes, dtypes, close vectors."""
    from index_builder.encode import Encoder, PlanItem, decode

    items = [
        PlanItem(i, str(i), str(corpus.parent / f"images/{i:04d}.png"), None, i + 1, ())
        for i in range(4)
    ]
    pixels = torch.stack([p for p in (decode(it, 64).pixels for it in items) if p is not None])
    exact = Encoder(model, torch.device("cpu"))
    mixed = Encoder(model, torch.device("cpu"))
    mixed.dtype = torch.float16
    (v32, t32), (v16, t16) = exact.images(pixels), mixed.images(pixels)
    assert v16.dtype == np.float32 and t16.dtype == np.float16 and t16.shape == t32.shape
    np.testing.assert_allclose(np.linalg.norm(v16, axis=1), 1.0, atol=1e-5)
    assert (v16 * v32).sum(axis=1).min() > 0.999
    texts = ["a small red circle", "two blue squares"]
    assert (mixed.texts(texts) * exact.texts(texts)).sum(axis=1).min() > 0.999
    np.testing.assert_allclose(exact.texts(texts), model.encode_texts(texts), atol=1e-5)


def test_a_batch_that_overflows_fp16_is_encoded_again_in_fp32(
    model: BuiltinModel, corpus: Path
) -> None:
    """Projections scaled past fp16's range: the autocast path gives inf, so the encoder
    encodes those batches in fp32 and hands back the fp32 vectors, never NaN."""
    import copy

    from index_builder.encode import Encoder, PlanItem, decode

    items = [
        PlanItem(i, str(i), str(corpus.parent / f"images/{i:04d}.png"), None, i + 1, ())
        for i in range(2)
    ]
    pixels = torch.stack([p for p in (decode(it, 64).pixels for it in items) if p is not None])
    exact = Encoder(model, torch.device("cpu"))
    exact.net = copy.deepcopy(model.model)
    with torch.no_grad():
        exact.net.image_proj.weight.mul_(1e6)
        exact.net.text_proj.weight.mul_(1e6)
    mixed = Encoder(model, torch.device("cpu"))
    mixed.net, mixed.dtype = exact.net, torch.float16
    with torch.autocast("cpu", dtype=torch.float16), torch.inference_mode():
        raw = exact.net.image_proj(exact.net.image_tokens(pixels.float() / 255).mean(1))
    assert not torch.isfinite(raw).all()  # the case the fallback is for
    np.testing.assert_allclose(mixed.images(pixels)[0], exact.images(pixels)[0], atol=1e-6)
    texts = ["a small red circle", "two blue squares"]
    np.testing.assert_allclose(mixed.texts(texts), exact.texts(texts), atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_cuda_builds_ivf_centroids_come_from_its_gpu_deterministically() -> None:
    """On a GPU host: `gpu_kmeans("cuda")` trains the builder's default million-scale family
    (an HNSW-quantized IVF with SQ8), the same bytes twice, recall@10 FAISS's own to within
    noise."""
    from index_builder.kmeans import gpu_kmeans

    hook = gpu_kmeans("cuda")
    assert hook is not None
    rng = np.random.default_rng(0)
    centers = rng.standard_normal((300, 64)).astype(np.float32)
    vecs = centers[rng.integers(0, 300, 20000)]
    vecs += rng.standard_normal(vecs.shape).astype(np.float32)
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    queries = vecs[:500] + 0.1 * rng.standard_normal((500, 64)).astype(np.float32)
    knobs = ann.SearchKnobs(nprobe=8)
    plain = ann.build_index("IVF256_HNSW32,SQ8", vecs)
    first = ann.build_index("IVF256_HNSW32,SQ8", vecs, centroids=hook)
    second = ann.build_index("IVF256_HNSW32,SQ8", vecs, centroids=hook)
    assert faiss.serialize_index(first).tobytes() == faiss.serialize_index(second).tobytes()
    want = ann.recall_at_k(plain, vecs, queries, 10, knobs)
    assert ann.recall_at_k(first, vecs, queries, 10, knobs) > want - 0.03
