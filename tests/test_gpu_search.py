"""GPU search paths, run on the CPU where no GPU is: the torch matmul + top-k backend answers as
FAISS Flat does, and `place` keeps IVF / HNSW on FAISS (CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from store import ann


def _unit(n: int, d: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_torch_flat_answers_as_faiss_flat_does() -> None:
    items, queries = _unit(500, 32, 0), _unit(7, 32, 1)
    flat = ann.build_index("Flat", items)
    want_s, want_r = ann.search(flat, queries, 10)
    got_s, got_r = ann.search(ann.TorchFlat(items, "cpu"), queries, 10)
    np.testing.assert_array_equal(got_r, want_r)
    np.testing.assert_allclose(got_s, want_s, rtol=1e-5, atol=1e-6)
    # more asked than held: FAISS pads with row -1, and so does the torch backend
    few = ann.TorchFlat(items[:3], "cpu")
    s, r = ann.search(few, queries[:2], 5)
    assert (r[:, 3:] == -1).all() and np.isneginf(s[:, 3:]).all()
    assert sorted(r[0, :3]) == [0, 1, 2]
    assert (few.ntotal, few.d) == (3, 32)


def test_place_moves_only_flat_indexes_and_only_to_a_gpu() -> None:
    items = _unit(2000, 32, 2)
    flat, ivf = ann.build_index("Flat", items), ann.build_index("IVF16,Flat", items)
    assert ann.place(flat, "cpu") is flat
    assert ann.place(ivf, "cuda") is ivf  # IVF / HNSW stay FAISS on the CPU


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_flat_search_on_the_gpu_equals_the_cpu() -> None:
    items, queries = _unit(5000, 64, 3), _unit(16, 64, 4)
    flat = ann.build_index("Flat", items)
    on_gpu = ann.place(flat, "cuda")
    assert on_gpu is not flat
    want_s, want_r = ann.search(flat, queries, 20)
    got_s, got_r = ann.search(on_gpu, queries, 20)
    np.testing.assert_array_equal(got_r, want_r)
    np.testing.assert_allclose(got_s, want_s, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(ann.search(ann.TorchFlat(items, "cuda"), queries, 20)[1], want_r)
