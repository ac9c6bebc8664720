"""The device step over a version whose FAISS indexes are approximate (IVF, HNSW: what the
builder writes for large corpora): it searches the vectors the version keeps for --append /
--delete exactly, row for row, instead of sending its queries down the host path. Run on the
CPU device; the same code runs on CUDA."""

from __future__ import annotations

from pathlib import Path

import faiss
import numpy as np
import pytest
import torch

from app.stepping import exact_vectors
from models.builtin import BuiltinModel
from models.device_step import DeviceStep
from models.step_tables import ResidentTables
from store import indexio
from tests.builder_helpers import reindexed
from tests.test_device_step import TEXTS, _worker


@pytest.mark.parametrize("factory", ["IVF4,Flat", "HNSW32"])
def test_an_approximate_version_is_searched_exactly_on_the_device(
    tmp_path: Path, index_dir: Path, model: BuiltinModel, factory: str
) -> None:
    version = indexio.IndexVersion.open(reindexed(tmp_path, index_dir, model, factory).path)
    assert not isinstance(faiss.downcast_index(version.image_index), faiss.IndexFlat)
    kept = np.load(version.path / indexio.IMAGE_VECTORS)
    got = exact_vectors(version, text=False)
    assert got is not None
    np.testing.assert_array_equal(got, kept)
    step = DeviceStep(model.model, torch.device("cpu"), "fp32")
    worker = _worker(model, step)
    worker.prepare(version)
    tables = version.resident
    assert isinstance(tables, ResidentTables) and tables.rows == len(kept)
    assert tables.captions is not None  # image queries stay on the step too
    assert tables.captions.rows == version.text_index.ntotal
    out = step(tables, [model.tokenizer.ids(t) for t in TEXTS], 10, False)
    flat = faiss.IndexFlatIP(kept.shape[1])
    flat.add(kept)
    qvecs = model.encode_texts(TEXTS)
    _, want = flat.search(qvecs, 10)
    np.testing.assert_array_equal(out.rows[:, :10], want)  # exact: FAISS Flat's rows, not IVF's
    version.close()


def test_without_kept_vectors_an_approximate_version_takes_the_host_path(
    tmp_path: Path, index_dir: Path, model: BuiltinModel
) -> None:
    version_dir = reindexed(tmp_path, index_dir, model, "HNSW32").path
    version = indexio.IndexVersion.open(version_dir)
    (version_dir / indexio.IMAGE_VECTORS).rename(tmp_path / "gone.npy")
    assert exact_vectors(version, text=False) is None
    _worker(model, DeviceStep(model.model, torch.device("cpu"), "fp32")).prepare(version)
    assert version.resident is None
    version.close()


def test_caption_tables_that_would_not_fit_leave_image_queries_on_the_host_path(
    index_dir: Path, model: BuiltinModel, caplog: pytest.LogCaptureFixture
) -> None:
    """The device's free memory is read again before the caption tables are copied: too
    little left beside the image tables, and only image queries take the host path."""
    version = indexio.IndexVersion.open(indexio.resolve_current(index_dir))
    step = DeviceStep(model.model, torch.device("cpu"), "fp32")
    left = iter([10**10, 1_000])  # as a GPU would say: plenty, then 1 KB after the copy
    step.free_bytes = lambda: next(left)  # type: ignore[method-assign]
    _worker(model, step).prepare(version)
    assert isinstance(version.resident, ResidentTables) and version.resident.captions is None
    assert (
        "caption tables need" in caplog.text and "image queries take the host path" in caplog.text
    )
    version.close()
