"""Zero-downtime index swap, end to end: a real `duet serve` process, real builds, httpx.

The second version is built from a corpus whose ids carry a prefix, so every hit names the
version it came from; a response whose hits are not all in its `index_version` mixed versions.
"""

from __future__ import annotations

import base64
import itertools
import json
import shutil
import sqlite3
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from index_builder.build import build
from models.builtin import BuiltinModel
from models.trainconfig import HELD_OUT_SEED_BASE
from models.world import write_corpus
from store.indexio import (
    IMAGE_INDEX,
    IMAGE_TOKENS,
    ITEMS,
    MANIFEST,
    file_sha256,
    point_current,
    resolve_current,
)
from tests.conftest import Service, start_service, stop_service
from tests.index_damage import break_meta, faiss_vectors, list_file, random_faiss
from tests.test_e2e import _metric

pytestmark = pytest.mark.slow

TOKEN = "swap-test-token"
PASSWD_SHA256 = file_sha256(Path("/etc/passwd"))
AUTH = {"authorization": f"Bearer {TOKEN}"}


def _ids(version_dir: Path) -> set[str]:
    """Every image and caption id stored in one version."""
    con = sqlite3.connect(version_dir / ITEMS)
    try:
        return {r[0] for t in ("images", "texts") for r in con.execute(f"SELECT id FROM {t}")}
    finally:
        con.close()


def _prefixed_corpus(out: Path, n: int, seed: int, prefix: str) -> Path:
    manifest = write_corpus(out, n, seed, progress=False)
    lines = [json.loads(line) for line in manifest.read_text().splitlines()]
    manifest.write_text("".join(json.dumps({**d, "id": prefix + d["id"]}) + "\n" for d in lines))
    return manifest


def _wait_for(cond: Callable[[], bool], what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _queries(corpus: Path) -> tuple[list[str], list[str]]:
    """What the load searches for: two captions of each of the first 12 images, and the first
    6 images, base64-encoded."""
    captions = [
        c for line in corpus.read_text().splitlines()[:12] for c in json.loads(line)["captions"][:2]
    ]
    images = [
        base64.b64encode(p.read_bytes()).decode()
        for p in sorted((corpus.parent / "images").glob("*.png"))[:6]
    ]
    return captions, images


def _search_until_stopped(
    svc: Service,
    w: int,
    captions: list[str],
    images: list[str],
    stop: threading.Event,
    results: list[tuple[int, int, dict[str, Any]]],
) -> None:
    """Load worker `w`: text and image searches back to back until `stop` is set, each answer
    appended to `results` as (worker, status, body); a transport failure as status -1."""
    with svc.client() as c:
        for n in itertools.count():
            if stop.is_set():
                return
            i = w + 7 * n  # `candidates` varies so that few requests are cache hits
            opts = {"top_k": 5, "candidates": 10 + n % 30, "rerank": i % 2 == 0}
            try:
                if i % 3 == 2:
                    r = c.post("/search/image", json={"image_b64": images[i % len(images)], **opts})
                else:
                    r = c.post("/search/text", json={"query": captions[i % len(captions)], **opts})
                results.append((w, r.status_code, r.json()))
            except httpx.HTTPError as exc:  # recorded, so the report shows every failure
                results.append((w, -1, {"error": repr(exc)}))


def test_swap_under_load_never_mixes_versions(
    corpus: Path, model: BuiltinModel, tmp_path: Path
) -> None:
    idx = tmp_path / "idx"
    v1 = build(corpus, idx, model, progress=False)
    corpus2 = _prefixed_corpus(tmp_path / "corpus2", 24, HELD_OUT_SEED_BASE + 12, "b-")
    ids = {v1.version: _ids(v1.path)}
    captions, images = _queries(corpus)
    cached_q = {"query": "a small red circle left of a large blue square", "top_k": 5}
    svc = start_service(idx, tmp_path / "serve.log", DUET_INDEX_POLL_S="0.2")
    results: list[tuple[int, int, dict[str, Any]]] = []  # (worker, status, body)
    stop = threading.Event()

    try:
        with svc.client() as c:
            assert c.post("/search/text", json=cached_q).json()["cached"] is False
            before = c.post("/search/text", json=cached_q).json()
        assert before["cached"] is True and before["index_version"] == v1.version

        with ThreadPoolExecutor(6) as pool:
            futures = [
                pool.submit(_search_until_stopped, svc, w, captions, images, stop, results)
                for w in range(6)
            ]
            _wait_for(lambda: len(results) >= 80, "80 requests before the swap")
            v2 = build(corpus2, idx, model, progress=False)  # re-points `current`
            ids[v2.version] = _ids(v2.path)
            _wait_for(
                lambda: (
                    len(results) >= 240
                    and sum(b.get("index_version") == v2.version for _, _, b in results) >= 60
                ),
                "60 requests after the swap",
            )
            stop.set()
            for f in futures:
                f.result()

        with svc.client() as c:
            after = c.post("/search/text", json=cached_q).json()
            metrics = c.get("/metrics").text
            ready = c.get("/readyz").json()
    finally:
        stop.set()
        stop_service(svc)

    assert len(results) >= 240
    bad = [(s, b) for _, s, b in results if s != 200]
    assert not bad, bad[:3]
    for _, _, body in results:
        got = {h["id"] for h in body["hits"]}
        assert got and got <= ids[body["index_version"]], (body["index_version"], got)
    for w in range(6):  # each worker's requests are sequential: never back to the old version
        seen = [b["index_version"] for x, _, b in results if x == w]
        assert seen == sorted(seen, key=[v1.version, v2.version].index), seen
    # the query cached before the swap is answered afresh, from the new version
    assert after["cached"] is False and after["index_version"] == v2.version
    assert {h["id"] for h in after["hits"]} <= ids[v2.version]
    assert _metric(metrics, "duet_index_reloads_total", result="ok") == 1
    assert _metric(metrics, "duet_index_reloads_total", result="refused") == 0
    assert _metric(metrics, "duet_index_info", version=v2.version) == 1
    assert f'version="{v1.version}"' not in metrics  # one version on the dashboard
    assert _metric(metrics, "duet_index_items", modality="image") == 24
    assert ready["index_version"] == v2.version
    assert ready["reload"]["last_swap"]["previous"] == v1.version
    assert f"closed index version {v1.version}" in (tmp_path / "serve.log").read_text()


def _truncate_faiss(d: Path) -> None:
    f = d / "image.faiss"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _edit_manifest(**changes: Any) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        manifest = json.loads((d / MANIFEST).read_text())
        (d / MANIFEST).write_text(json.dumps({**manifest, **changes}))

    return edit


def _garble_items(d: Path) -> None:
    (d / ITEMS).write_bytes(b"this is not a database " * 200)


def _rehashed(damage: Callable[[Path], None], name: str) -> Callable[[Path], None]:
    """`damage`, then the manifest's sha256 of `name` made to match: a version whose hashes
    agree must still be refused by the deeper checks (rows, SQLite, finite values)."""

    def edit(d: Path) -> None:
        damage(d)
        manifest = json.loads((d / MANIFEST).read_text())
        manifest["files"][name] = file_sha256(d / name)
        (d / MANIFEST).write_text(json.dumps(manifest))

    return edit


def _delete_half_the_image_rows(d: Path) -> None:
    con = sqlite3.connect(d / ITEMS)
    con.execute("DELETE FROM images WHERE row % 2 = 1")
    con.commit()
    con.close()


def _zero_pages(d: Path) -> None:
    """Eight 4 KiB pages of items.sqlite overwritten with zeros, the header kept."""
    data = bytearray((d / ITEMS).read_bytes())
    page = 4096
    for k in range(1, 9):
        start = min(k * page, len(data) - page)
        data[start : start + page] = bytes(page)
    (d / ITEMS).write_bytes(bytes(data))


def _nan_tokens(d: Path) -> None:
    tokens = np.load(d / IMAGE_TOKENS)
    tokens[:] = np.nan
    np.save(d / IMAGE_TOKENS, tokens)


def _flip_a_byte(d: Path) -> None:
    data = bytearray((d / IMAGE_TOKENS).read_bytes())
    data[-1] ^= 0xFF
    (d / IMAGE_TOKENS).write_bytes(bytes(data))


BROKEN: list[tuple[str, Callable[[Path], None], str]] = [
    ("truncated-faiss", _truncate_faiss, "image.faiss differs from what the build wrote"),
    (
        "other-model",
        _edit_manifest(model={"name": "x", "fingerprint": "duet-joint:0000"}),
        "was built by model",
    ),
    ("counts", _edit_manifest(counts={"images": 41, "texts": 200}), "counts"),
    ("garbled-items", _garble_items, "differs from what the build wrote"),
    ("flipped-byte", _flip_a_byte, "image_tokens.npy differs from what the build wrote"),
    ("half-the-rows", _rehashed(_delete_half_the_image_rows, ITEMS), "table images has 20 rows"),
    ("zeroed-pages", _rehashed(_zero_pages, ITEMS), "items.sqlite is"),
    ("nan-tokens", _rehashed(_nan_tokens, IMAGE_TOKENS), "NaN"),
    # issue 36 rows 5 to 8: each was accepted (row 8's first hung the reloader for good)
    ("unlisted-faiss", random_faiss, "image.faiss not listed in manifest.json's files"),
    ("no-files", _edit_manifest(files={}), "not listed in manifest.json's files"),
    ("nan-faiss", _rehashed(faiss_vectors(np.nan), IMAGE_INDEX), "NaN or infinite values"),
    (
        "huge-faiss",
        _rehashed(faiss_vectors(3e38), IMAGE_INDEX),
        "at row 3; the model's vectors have norm 1",
    ),
    ("broken-meta", _rehashed(break_meta, ITEMS), "table images row 7 has unreadable meta"),
    ("dev-zero", list_file("../" * 16 + "dev/zero"), "not a plain file name"),
    ("passwd", list_file("../" * 16 + "etc/passwd"), "not a plain file name"),
]


def _refuse_broken(
    c: httpx.Client,
    idx: Path,
    good: Path,
    case: tuple[str, Callable[[Path], None], str],
    *,
    version: str,
    query: dict[str, Any],
    refused: int,
    tmp_path: Path,
) -> int:
    """One BROKEN case, copied from `good` into `idx` and made `current` while `version`
    serves: the poller refuses it once, the old version still answers, /readyz says why (no
    host paths), and an explicit /admin/reload retries and is refused. `refused`: the refusals
    counted before; returns it with these two added."""
    name, damage, reason = case
    shutil.copytree(good, idx / name)
    damage(idx / name)
    point_current(idx, name)
    _wait_for(
        lambda n=name: (  # type: ignore[misc]
            (c.get("/readyz").json()["reload"]["last_refused"] or {}).get("version") == n
        ),
        f"{name} refused",
    )
    refused += 1
    time.sleep(0.5)  # five more polls: the same broken files are not retried
    assert _metric(c.get("/metrics").text, "duet_index_reloads_total", result="refused") == refused
    r = c.post("/search/text", json=query)
    assert r.status_code == 200 and r.json()["index_version"] == version
    last = c.get("/readyz").json()["reload"]["last_refused"]
    assert reason in last["reason"] and last["at"], last
    # /readyz is unauthenticated: no host paths (/admin/reload has them), no digest of a file
    # outside the version
    assert "path" not in last and str(tmp_path) not in last["reason"], last
    assert PASSWD_SHA256[:12] not in last["reason"], last
    r = c.post("/admin/reload", headers=AUTH)  # an explicit reload retries
    refused += 1
    assert r.status_code == 409, r.text
    err = r.json()["error"]
    assert err["code"] == "index_refused" and reason in err["message"]
    assert err["version"] == name and err["serving"] == version
    return refused


def test_broken_versions_are_refused_while_the_old_one_serves(
    index_dir: Path, tmp_path: Path
) -> None:
    idx = tmp_path.resolve() / "idx"
    good = resolve_current(index_dir)
    shutil.copytree(good, idx / good.name)
    point_current(idx, good.name)
    log = tmp_path / "serve.log"
    svc = start_service(idx, log, DUET_INDEX_POLL_S="0.1", DUET_ADMIN_TOKEN=TOKEN)
    version = json.loads((good / MANIFEST).read_text())["version"]
    query = {"query": "a large yellow diamond", "top_k": 3}
    refused = 0
    try:
        with svc.client() as c:
            for case in BROKEN:
                refused = _refuse_broken(
                    c,
                    idx,
                    good,
                    case,
                    version=version,
                    query=query,
                    refused=refused,
                    tmp_path=tmp_path,
                )

            point_current(idx, "nowhere")  # `current` -> a missing directory
            _wait_for(
                lambda: (
                    "current points to nowhere, which does not exist"
                    in (c.get("/readyz").json()["reload"]["last_refused"] or {}).get("reason", "")
                ),
                "dangling refused",
            )
            time.sleep(0.5)
            refused += 1
            assert (
                _metric(c.get("/metrics").text, "duet_index_reloads_total", result="refused")
                == refused
            )
            r = c.post("/admin/reload", headers=AUTH)
            refused += 1
            assert r.status_code == 409 and "which does not exist" in r.json()["error"]["message"]
            time.sleep(0.3)  # polls that find the same refusal keep the gauge up (the alert's)
            assert _metric(c.get("/metrics").text, "duet_index_current_refused") == 1

            point_current(idx, good.name)
            r = c.post("/admin/reload", headers=AUTH)
            assert r.status_code == 200 and r.json()["result"] == "current", r.text
            assert _metric(c.get("/metrics").text, "duet_index_current_refused") == 0
            shutil.copytree(good, idx / "fixed")
            _edit_manifest(version="fixed")(idx / "fixed")
            point_current(idx, "fixed")
            r = c.post("/admin/reload", headers=AUTH)
            assert r.status_code == 200, r.text
            assert r.json() | {"at": None} == {
                "result": "swapped",
                "version": "fixed",
                "path": str(idx / "fixed"),
                "previous": version,
                "at": None,
            }
            assert c.post("/search/text", json=query).json()["index_version"] == "fixed"
            metrics = c.get("/metrics").text
    finally:
        stop_service(svc)
    assert _metric(metrics, "duet_index_reloads_total", result="refused") == refused
    assert _metric(metrics, "duet_index_reloads_total", result="ok") == 1
    text = log.read_text()
    for name, _, _ in BROKEN:  # once by the poller, once by /admin/reload
        assert text.count(f"refused index {idx / name}:") == 2, name
    assert "ERROR duet.reload" in text
