"""The process layout's split of a search: the owner answers ranked rows and scores only
(`look_up=False`, on the engine's queue with a callback), the front looks the hits' items
up in the version's item store (`app.work.items_of`): the same items as the owner's own
look-up, less work and fewer bytes for the one process every search crosses."""

from __future__ import annotations

import asyncio
import pickle
import sqlite3
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from app.errors import NotReady
from app.schemas import SearchOptions
from app.stores import Stores
from app.work import items_of
from models.builtin import BuiltinModel
from models.device_step import DeviceStep
from store import indexio
from tests.conftest import in_process_pipeline


@pytest.mark.parametrize("layout", ["cpu", "gpu"])  # the host path; the device step (on the CPU)
async def test_an_answer_without_look_ups_plus_the_fronts_look_up_is_the_whole_answer(
    index_dir: Path, corpus: Path, model: BuiltinModel, layout: str
) -> None:
    index = indexio.IndexVersion.open(indexio.resolve_current(index_dir))
    pipeline = in_process_pipeline(
        model,
        index,
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
            bare = await _as_the_owner_asks(pipeline, index, kind, text, img, plan)
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


async def _as_the_owner_asks(
    pipeline: Any, index: Any, kind: str, text: Any, img: Any, plan: Any
) -> Any:
    """The search as the process layout's owner runs it (`app.owner`): no look-ups, put on
    the engine's queue with a callback that the answering worker calls."""
    loop = asyncio.get_running_loop()
    got: asyncio.Future[tuple[Any, BaseException | None]] = loop.create_future()
    query, cost = pipeline.work_of(index, kind, text, img, plan, 20, 5, look_up=False)
    pipeline.engine.enqueue(
        query, cost, lambda answer, exc: loop.call_soon_threadsafe(got.set_result, (answer, exc))
    )
    answer, exc = await asyncio.wait_for(got, 30)
    assert exc is None
    return answer


def test_the_store_says_when_a_look_up_needs_no_sqlite(index_dir: Path) -> None:
    """What decides whether a front reads on its event loop or in a thread."""
    path = indexio.resolve_current(index_dir)
    store = indexio.ItemStore(path / indexio.ITEMS)
    try:
        assert not store.holds("text", [0, 1, 2]) and not store.holds("image", [0, 1])
        items_of(store, "text", [0, 1, 2])
        assert store.holds("text", [0, 1, 2]) and store.holds("text", [2])
        assert not store.holds("text", [0, 3]) and not store.holds("image", [0, 1])
        items_of(store, "image", [0, 1])
        assert store.holds("image", [1, 0])
    finally:
        store.close()


def test_a_front_keeps_the_current_versions_store_and_closes_the_others_when_unused(
    index_dir: Path, tmp_path: Path
) -> None:
    current = str(indexio.resolve_current(index_dir))
    old = tmp_path / "old"
    old.mkdir()
    (old / indexio.ITEMS).write_bytes((Path(current) / indexio.ITEMS).read_bytes())
    stores = Stores(current)
    with stores.use(current) as a:
        pass
    with stores.use(current) as b:
        assert a is b  # kept open between answers
    with stores.use(str(old)) as late:  # an answer from before a swap
        assert late.holds("text", []) and items_of(late, "text", [0])[0]
    with pytest.raises(sqlite3.ProgrammingError):  # closed once no answer used it
        late.images([1])
    with stores.use(current) as a, stores.use(str(old)) as other:
        stores.swapped(str(old))  # the owner swapped while both were in use
        assert a.images([0]) and other.images([0])  # neither closed under its user
    with pytest.raises(sqlite3.ProgrammingError):
        a.images([1])  # the swapped-out version's, once unused
    assert other.images([1])  # the current one's stays
    stores.close()
    with pytest.raises(NotReady), stores.use(str(tmp_path / "gone")):
        pass


async def test_a_front_reads_a_lone_searchs_hits_on_its_loop_and_a_bursts_in_threads(
    index_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where a front reads its hits' items when they are not decoded yet: a search alone on
    its loop (a thread hop would cost what the reads do); searches the owner answered
    together (one write, so every answer is in before any search resumes) in threads: each
    is still counted with the others, whose reads are under way, and the loop stays free."""
    import asyncio

    import app.fronts as fronts
    from app.work import Answer

    path = str(indexio.resolve_current(index_dir))
    gate = asyncio.Event()
    asked: list[list[int]] = []  # each search's hits, in the order the searches ask

    class Owner:  # the owner's side of the socket: answers held until `gate` opens
        async def search(self, **msg: object) -> dict[str, object]:
            rows = asked.pop(0)
            await gate.wait()
            ranked: list[tuple[int, float, float | None, float]] = [
                (r, 0.5, None, 0.5) for r in rows
            ]
            return {"answer": Answer(ranked, [], {}, None, False), "version": "v", "path": path}

    pipeline = object.__new__(fronts.FrontPipeline)  # the owner and the model stood in for
    pipeline.remote = Owner()  # type: ignore[assignment]
    pipeline.remote_model = type("Model", (), {"tokenizer": None})()
    pipeline._served = fronts._Version("v")
    pipeline.stores = Stores(path)
    pipeline._running = 0
    threads: list[object] = []
    real = asyncio.to_thread

    async def counted(fn: object, *args: object) -> object:
        threads.append(fn)
        return await real(fn, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(asyncio, "to_thread", counted)

    async def search(rows: list[int]) -> Answer:
        asked.append(rows)
        answer, _ = await pipeline.run(pipeline.index, "text", "q", None, None, 3, 3)  # type: ignore[arg-type]
        return answer

    fresh = indexio.ItemStore(Path(path) / indexio.ITEMS, recent=0)
    hits = [[0, 1, 2], [3, 4], [5, 6], [7, 8]]
    want = {k: items_of(fresh, "text", rows)[0] for k, rows in enumerate(hits)}
    fresh.close()
    gate.set()
    lone = await search([0, 1, 2])
    assert threads == [] and lone.meta == want[0]
    gate.clear()
    burst = [asyncio.ensure_future(search(rows)) for rows in ([3, 4], [5, 6], [7, 8])]
    await asyncio.sleep(0.05)
    assert pipeline._running == 3
    gate.set()
    answers = await asyncio.gather(*burst)
    assert len(threads) == 3 and [a.meta for a in answers] == [want[1], want[2], want[3]]
    assert pipeline._running == 0
    pipeline.stores.close()


async def test_an_announcement_read_with_the_hello_is_not_lost() -> None:
    """The owner sends a version announcement (a swap, or caching turned off or on) right
    after a hello under one lock: read in the same chunk, before the front listens, it was
    dropped (the hello's info then overwrote it), and the front kept the hello's version,
    path and caching until the next announcement."""
    from app.remote import RemoteEngine

    link = RemoteEngine("/nowhere")
    link._hello = asyncio.get_running_loop().create_future()
    info = {"version": "v1", "path": "/v1", "cache": True, "timeout_s": 2.0}
    link._message({"op": "hello", "info": dict(info)})
    link._message({"op": "version", "version": "v1", "path": "/v1", "cache": False})
    assert link._hello.done()
    assert link.info == {**info, "cache": False}  # what the front is built from
