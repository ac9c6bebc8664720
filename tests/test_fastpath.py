"""models.fastpath: the text and image towers at inference call the fused layer kernel
directly, with the modules' own results, and fall back to the modules everywhere else."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import nn

import models.fastpath as fp
from models.builtin import BuiltinModel
from models.joint import JointModel


@pytest.fixture(scope="module")
def model() -> BuiltinModel:
    return BuiltinModel.load()


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Counts the direct kernel calls (the kernel itself still runs)."""
    calls: list[int] = []
    kernel = fp._KERNEL
    assert kernel is not None, "this torch has no fused encoder-layer kernel"

    def wrapped(*args: Any) -> torch.Tensor:
        calls.append(1)
        return kernel(*args)

    monkeypatch.setattr(fp, "_KERNEL", wrapped)
    yield calls


@contextmanager
def modules_only() -> Iterator[None]:
    """torch's own switch for the modules' fused path, off for the block."""
    was = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(was)


TEXTS = [
    "a red circle",
    "two small green triangles left of a large red diamond",
    "one big blue square above a tiny yellow cross",
]


def test_text_and_image_states_equal_the_modules(model: BuiltinModel, counted: list[int]) -> None:
    net = model.model
    ids, pad = model._batch(TEXTS)  # padded: the texts differ in length
    pixels = torch.rand(
        3, 3, net.cfg.image_size, net.cfg.image_size, generator=torch.Generator().manual_seed(0)
    )
    with torch.inference_mode():
        fast_t = net.text_tokens(ids, pad)
        fast_i = net.image_tokens(pixels)
    assert counted, "inference did not take the direct path"
    with torch.inference_mode(), modules_only():
        slow_t = net.text_tokens(ids, pad)
        slow_i = net.image_tokens(pixels)
    keep = ~pad
    torch.testing.assert_close(fast_t[keep], slow_t[keep], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast_i, slow_i, rtol=1e-5, atol=1e-5)


def test_modules_run_where_the_kernel_does_not_apply(
    model: BuiltinModel, counted: list[int]
) -> None:
    net = model.model
    ids, pad = model._batch(TEXTS)
    net.text_tokens(ids, pad)  # autograd on: training's path
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        net.text_tokens(ids, pad)
    with torch.inference_mode(), modules_only():
        net.text_tokens(ids, pad)
    net.train()
    try:
        with torch.inference_mode():
            net.text_tokens(ids, pad)
    finally:
        net.eval()
    net.serve_kernels(False)  # a model as trained (and the benchmarks' plain script)
    try:
        with torch.inference_mode():
            net.text_tokens(ids, pad)
            net.image_tokens(torch.rand(1, 3, net.cfg.image_size, net.cfg.image_size))
    finally:
        net.serve_kernels()
    assert counted == []
    assert not JointModel(net.cfg).kernels  # made to train: the modules


def test_a_layer_the_kernel_cannot_take_keeps_its_stack_on_the_modules(counted: list[int]) -> None:
    odd = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(24, 3, 48, dropout=0.0, batch_first=True, norm_first=True),
        2,
        enable_nested_tensor=False,
    ).eval()
    x = torch.randn(2, 5, 24)
    with torch.inference_mode():
        out = fp.run_layers(odd, x)
        want = odd(x)
    assert counted == []  # three heads: the modules' fast path refuses odd head counts too
    torch.testing.assert_close(out, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_the_direct_path_equals_the_modules_without_a_sync(counted: list[int]) -> None:
    gpu = BuiltinModel.load(device="cuda")
    net = gpu.model
    ids, pad = gpu._batch(TEXTS)
    with torch.inference_mode():
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            fast = net.text_tokens(ids, pad)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        with modules_only():
            slow = net.text_tokens(ids, pad)
    assert counted
    keep = ~pad
    # fp32 both ways, but different CUDA kernels (the direct path's attention against the
    # modules' fused one) sum in another order: on an H100 they differed by up to 3.4e-4
    torch.testing.assert_close(fast[keep], slow[keep], rtol=1e-3, atol=1e-3)
