"""In-process parts of the index swap: version leases, /admin/reload's token, worker threads."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import httpx
import pytest

from app.config import Settings
from app.main import create_app
from app.versions import ServedIndex
from store.indexio import IndexVersion, resolve_current

TOKEN = "reload-test-token"


def _open(index_dir: Path) -> IndexVersion:
    return IndexVersion.open(resolve_current(index_dir))


def test_swapped_out_version_stays_open_until_its_last_request_ends(index_dir: Path) -> None:
    old, new = _open(index_dir), _open(index_dir)
    served = ServedIndex(old)
    with served.lease() as a, served.lease() as b:
        assert a is b is old and served.in_use(old) == 2
        assert served.swap(new) is old
        with served.lease() as c:
            assert c is new  # requests starting after the swap get the new version
        assert a.store.images([0])[0].id  # in-flight requests still read the old one
    assert served.in_use(old) == 0
    with pytest.raises(sqlite3.ProgrammingError):  # closed by the last release, and the
        old.store.images([0])  # rows it kept (ItemStore's recent map) dropped with it
    assert old.image_index.ntotal == old.text_index.ntotal == len(old.image_tokens) == 0
    newer = _open(index_dir)
    served.swap(newer)  # nobody holds `new`: closed at once
    with pytest.raises(sqlite3.ProgrammingError):
        new.store.images([0])
    newer.close()


@pytest.mark.parametrize(
    ("token", "headers", "status", "code"),
    [
        (None, {"authorization": f"Bearer {TOKEN}"}, 403, "admin_disabled"),
        (TOKEN, {}, 401, "unauthorized"),
        (TOKEN, {"authorization": "Bearer wrong"}, 401, "unauthorized"),
        (TOKEN, {"authorization": TOKEN}, 401, "unauthorized"),  # scheme missing
    ],
)
async def test_admin_reload_refuses_without_the_token(
    index_dir: Path, token: str | None, headers: dict[str, str], status: int, code: str
) -> None:
    app = create_app(Settings(index_dir=index_dir, index_poll_s=0, admin_token=token))
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://duet") as client,
    ):
        r = await client.post("/admin/reload", headers=headers)
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code
    assert "DUET_ADMIN_TOKEN" in r.json()["error"]["message"]
    if status == 401:
        assert r.headers["www-authenticate"] == "Bearer"


async def test_admin_reload_of_the_served_version_is_a_no_op(index_dir: Path) -> None:
    app = create_app(Settings(index_dir=index_dir, index_poll_s=0, admin_token=TOKEN))
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://duet") as client,
    ):
        r = await client.post("/admin/reload", headers={"authorization": f"Bearer {TOKEN}"})
        ready = (await client.get("/readyz")).json()
    assert r.status_code == 200, r.text
    assert r.json()["result"] == "current" and r.json()["version"] == ready["index_version"]
    assert ready["reload"] == {
        "poll_s": 0,
        "last_swap": None,
        "last_refused": None,
        "served_damaged": False,
        "answers_cached": True,
    }


async def test_loading_runs_off_the_event_loop(
    index_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reloader opens a version in a worker thread, never on the loop's thread."""
    import app.reload as reload_mod

    threads: list[int] = []
    real = reload_mod.load_checked

    def spy(path: Path, model: object) -> IndexVersion:
        threads.append(threading.get_ident())
        return real(path, model)  # type: ignore[arg-type]

    monkeypatch.setattr(reload_mod, "load_checked", spy)
    app = create_app(Settings(index_dir=index_dir, index_poll_s=0))
    async with app.router.lifespan_context(app):
        reloader = app.state.reloader
        served = app.state.pipeline.index
        # pretend another version is served, so that `current` counts as new
        served.path = Path("/elsewhere")
        outcome = await reloader.reload(force=False)
        assert outcome.result == "swapped", outcome
        assert app.state.pipeline.index is not served
    assert threads and threading.get_ident() not in threads
