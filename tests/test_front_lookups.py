"""The process layout's split of a search: the owner answers ranked rows and scores only
(`look_up=False`), the front looks the hits' items up in the version's item store
(`app.work.items_of`): the same items as the owner's own look-up, less work and fewer bytes
for the one process every search crosses."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
from PIL import Image

from app.cache import LRUCache, ResilientCache
from app.metrics import Metrics
from app.pipeline import SearchPipeline
from app.schemas import SearchOptions
from app.work import items_of
from models.builtin import BuiltinModel
from models.device_step import DeviceStep
from store import indexio


@pytest.mark.parametrize("layout", ["cpu", "gpu"])  # the host path; the device step (on the CPU)
async def test_an_answer_without_look_ups_plus_the_fronts_look_up_is_the_whole_answer(
    index_dir: Path, corpus: Path, model: BuiltinModel, layout: str
) -> None:
    index = indexio.IndexVersion.open(indexio.resolve_current(index_dir))
    metrics = Metrics()
    pipeline = SearchPipeline(
        model,
        index,
        ResilientCache(LRUCache(100, 60), metrics, timeout_s=1.0),
        metrics,
        fusion_lambda=0.1,
        timeout_s=30.0,
        workers=2,
        step=DeviceStep(model.model, torch.device("cpu"), "fp32") if layout == "gpu" else None,
    )
    await pipeline.start()
    image = Image.open(next((corpus.parent / "images").glob("*.png"))).convert("RGB")
    try:
        plan = pipeline.plan(SearchOptions(top_k=5, candidates=20))
        for kind, text, img in (("text", "two blue squares", None), ("image", None, image)):
            whole, _ = await pipeline.run(index, kind, text, img, plan, 20, 5)  # type: ignore[arg-type]
            bare, _ = await pipeline.run(index, kind, text, img, plan, 20, 5, look_up=False)  # type: ignore[arg-type]
            assert bare.ranked == whole.ranked and whole.meta
            assert ("device" in whole.timings) == (layout == "gpu")  # the path meant
            assert bare.meta == [] and bare.captions == {}
            assert len(pickle.dumps(bare)) < len(pickle.dumps(whole)) / 3
            rows = [r for r, _, _, _ in bare.ranked]
            assert items_of(index.store, kind, rows) == (whole.meta, whole.captions)  # type: ignore[arg-type]
            if kind == "text":
                assert whole.captions  # the builder's corpus has captions for its images
    finally:
        await pipeline.stop()
        index.close()
