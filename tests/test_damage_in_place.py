"""The served version's files damaged in place, then mended: a 503 that says so (it was a 500
with a traceback), /readyz not ready while they fail the checks (it said ready), a reopen once
they pass again (SQLite reads the item store as immutable: only a restart read the mended
file), and no answer missing its captions cached (one was, for the cache's TTL)."""

from __future__ import annotations

import shutil
import sqlite3
import time
from pathlib import Path

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
    whole = items.read_bytes()
    svc = start_service(idx, tmp_path / "serve.log", DUET_INDEX_POLL_S="0.2", DUET_FRONTENDS=fronts)
    try:
        with svc.client() as c:
            first = c.post("/search/text", json={"query": "a red circle", "top_k": 3})
            assert first.status_code == 200
            items.write_bytes(b"")  # truncated in place, as `truncate -s 0` does
            _wait(lambda: c.get("/readyz").status_code == 503, "/readyz to say not ready")
            ready = c.get("/readyz").json()["error"]
            assert ready["code"] == "index_unreadable" and "restore its files" in ready["message"]
            metrics = c.get("/metrics").text
            assert "duet_index_current_refused 1.0" in metrics
            items.write_bytes(whole)  # mended: the same bytes, a new mtime
            _wait(lambda: c.get("/readyz").status_code == 200, "/readyz to say ready again")
            r = c.post("/search/text", json={"query": "two green triangles", "top_k": 3})
            assert r.status_code == 200, r.text  # without a restart (the mended file read)
            assert all(h["caption"] for h in r.json()["hits"])
            assert "duet_index_current_refused 0.0" in c.get("/metrics").text
        log = svc.log.read_text()
        assert "reopened, whole again, index" in log and "Traceback" not in log, log
    finally:
        stop_service(svc)


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
        with monkeypatch.context() as m:  # the hits themselves unreadable: a 503 that says so
            m.setattr(index.store, "images", unreadable)
            with pytest.raises(IndexUnreadable, match="restore them or build the version again"):
                await pipeline.search_text("two blue squares", SearchOptions(top_k=3))
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
