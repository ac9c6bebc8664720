"""The served version's files damaged in place, then mended: a 503 that says so (it was a 500
with a traceback), /readyz and a gauge telling it while they fail the checks, a reopen once
they pass again (SQLite reads the item store as immutable: only a restart read the mended
file), and no answer missing its captions cached (one was, for the cache's TTL)."""

from __future__ import annotations

import os
import shutil
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest

from app.errors import IndexUnreadable
from app.schemas import SearchOptions
from app.work import CaptionsUnread, items_of
from models.builtin import BuiltinModel
from store import indexio
from tests.conftest import in_process_pipeline, start_service, stop_service


def _wait(check: object, what: str, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.slow
@pytest.mark.parametrize("fronts", ["0", "2"])
def test_an_item_store_damaged_in_place_is_told_then_reopened_when_mended(
    index_dir: Path, tmp_path: Path, fronts: str
) -> None:
    good = indexio.resolve_current(index_dir)
    idx = tmp_path.resolve() / "idx"
    shutil.copytree(good, idx / good.name)
    (idx / "current").symlink_to(good.name)
    items = idx / good.name / indexio.ITEMS
    whole, stat = items.read_bytes(), items.stat()
    svc = start_service(idx, tmp_path / "serve.log", DUET_INDEX_POLL_S="0.2", DUET_FRONTENDS=fronts)
    try:
        with svc.client() as c:

            def reload() -> dict[str, object]:
                r = c.get("/readyz")  # ready throughout: a replica serves on what it reads
                assert r.status_code == 200, r.text
                return r.json()["reload"]

            assert c.post("/search/text", json={"query": "a red circle"}).status_code == 200
            items.write_bytes(b"")  # truncated in place, as `truncate -s 0` does
            _wait(lambda: reload()["served_damaged"], "the damage to be told")
            assert "items" in str(reload()["last_refused"])
            assert "duet_index_served_damaged 1.0" in c.get("/metrics").text
            # mended as `cp -p` mends it: the built bytes and the old mtime (the newest mtime
            # alone, the stamp before, took that for no change: damaged for good)
            items.write_bytes(whole)
            os.utime(items, ns=(stat.st_atime_ns, stat.st_mtime_ns))
            _wait(lambda: not reload()["served_damaged"], "the reopen")
            r = c.post("/search/text", json={"query": "two green triangles", "top_k": 3})
            assert r.status_code == 200, r.text  # without a restart (the mended file read)
            assert all(h["caption"] for h in r.json()["hits"])
            assert "duet_index_served_damaged 0.0" in c.get("/metrics").text
            again = c.post("/search/text", json={"query": "a small red square"}).json()
            assert again["cached"] is False  # computed from the mended files, then cached
            assert c.post("/search/text", json={"query": "a small red square"}).json()["cached"]
        log = svc.log.read_text()
        assert "changed on disk and fails its checks" in log
        assert "reopened, whole again, index" in log and "Traceback" not in log, log
    finally:
        stop_service(svc)


@pytest.mark.slow
@pytest.mark.parametrize("fronts", ["0", "2"])
def test_answers_are_not_cached_while_the_served_files_changed_and_are_not_yet_checked(
    index_dir: Path, tmp_path: Path, fronts: str
) -> None:
    """A change to the served version's files is checked once it holds a poll; meanwhile
    (and while it is checked) no answer of it is cached, here and in every front, and after
    it passes they are again. Only an mtime changes here: every answer is whole, so what
    keeps one out of the cache is the flag alone."""
    good = indexio.resolve_current(index_dir)
    idx = tmp_path.resolve() / "idx"
    shutil.copytree(good, idx / good.name)
    (idx / "current").symlink_to(good.name)
    svc = start_service(idx, tmp_path / "serve.log", DUET_INDEX_POLL_S="1.5", DUET_FRONTENDS=fronts)

    def cached_twice(c: Any, query: str) -> bool:
        first = c.post("/search/text", json={"query": query}).json()
        return bool(c.post("/search/text", json={"query": query}).json()["cached"]) and (
            first["cached"] is False
        )

    try:
        with svc.client() as c:
            assert cached_twice(c, "a red circle")
            os.utime(idx / good.name / indexio.ITEMS)  # `touch`: the same bytes, a new mtime
            _wait(lambda: not c.get("/readyz").json()["reload"]["answers_cached"], "a pause")
            time.sleep(0.2)  # the fronts hear it with the version
            assert not cached_twice(c, "two blue squares")
            _wait(lambda: c.get("/readyz").json()["reload"]["answers_cached"], "the check")
            time.sleep(0.2)
            assert cached_twice(c, "a green cross")
        assert "reopened, whole again, index" in svc.log.read_text()
    finally:
        stop_service(svc)


@pytest.mark.parametrize("layout", ["cpu", "gpu"])  # the host path; the device step (on CPU)
async def test_an_unreadable_item_store_is_a_503_without_a_traceback(
    index_dir: Path,
    corpus: Path,
    model: BuiltinModel,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    layout: str,
) -> None:
    """Text and image queries alike: a 503 index_unreadable (it was a 500), and no traceback
    in the log (an image query's was logged as a failed re-ranking, and on the device step
    ran again on the host path to fail once more)."""
    import torch
    from PIL import Image

    from models.device_step import DeviceStep

    index = indexio.IndexVersion.open(indexio.resolve_current(index_dir))
    step = DeviceStep(model.model, torch.device("cpu"), "fp32") if layout == "gpu" else None
    pipeline = in_process_pipeline(model, index, timeout_s=30.0, workers=1, step=step)
    await pipeline.start()
    image = Image.open(next((corpus.parent / "images").glob("*.png"))).convert("RGB")
    try:

        def unreadable(rows: object) -> object:
            raise sqlite3.DatabaseError("database disk image is malformed")

        monkeypatch.setattr(index.store, "images", unreadable)
        monkeypatch.setattr(index.store, "texts", unreadable)
        with pytest.raises(IndexUnreadable, match="restore them or build the version again"):
            await pipeline.search_text("two blue squares", SearchOptions(top_k=3))
        with pytest.raises(IndexUnreadable, match="restore them or build the version again"):
            await pipeline.search_image(b"png", image, SearchOptions(top_k=3))
        assert not [r for r in caplog.records if r.exc_info], [r.message for r in caplog.records]
        assert "host path" not in caplog.text
        assert caplog.text.count("queries failed") <= 1  # not a line per search
    finally:
        await pipeline.stop()
        index.close()


async def test_an_answer_whose_captions_cannot_be_read_is_not_cached(
    index_dir: Path, model: BuiltinModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The captions are a courtesy (the hits go out without them), but such an answer was
    cached for the cache's TTL, and served so after the store read again."""
    index = indexio.IndexVersion.open(indexio.resolve_current(index_dir))
    pipeline = in_process_pipeline(model, index, timeout_s=30.0, workers=1)
    await pipeline.start()
    try:

        def unreadable(ids: object) -> dict[str, list[str]]:
            raise sqlite3.DatabaseError("database disk image is malformed")

        monkeypatch.setattr(index.store, "captions", unreadable)
        assert isinstance(items_of(index.store, "text", [0, 1])[1], CaptionsUnread)
        opts = SearchOptions(top_k=3)
        first = await pipeline.search_text("a red circle", opts)
        assert '"caption":null' in first.json.replace(" ", "")
        monkeypatch.undo()
        again = await pipeline.search_text("a red circle", opts)
        assert '"cached":false' in again.json.replace(" ", "")  # computed, with its captions
        assert '"caption":null' not in again.json.replace(" ", "")
    finally:
        await pipeline.stop()
        index.close()


def test_a_fronts_store_is_opened_afresh_when_its_version_is_reopened(index_dir: Path) -> None:
    """A front looks its hits up in a store of its own: the owner's reopen of the same path
    opens it afresh too (once the answers using the old one are done), else the front read
    the damaged file's pages on."""
    from app.stores import Stores

    path = str(indexio.resolve_current(index_dir))
    stores = Stores(path)
    with stores.use(path) as before:
        stores.swapped(path)  # reopened while an answer reads the old store
        assert before.images([0])  # still readable: closed only once unused
        with stores.use(path) as after:
            assert after is not before and after.images([0]) == before.images([0])
    with stores.use(path) as again:
        assert again is after  # the fresh one stays open for the current version
    with pytest.raises(sqlite3.ProgrammingError):
        before.images([1])  # the old one closed
    stores.close()
