"""The page at / and GET /images/{id} against a real `duet serve` (issue 16)."""

from __future__ import annotations

import io
import json
import shutil
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from PIL import Image

from app.routes.ui import allowed, inside
from store.indexio import ITEMS, MANIFEST, file_sha256, point_current, resolve_current
from tests.conftest import Service, start_service, stop_service


@pytest.fixture(scope="module")
def service(
    index_dir: Path, corpus: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Service]:
    svc = start_service(
        index_dir, tmp_path_factory.mktemp("ui") / "serve.log", DUET_IMAGES_DIR=str(corpus.parent)
    )
    yield svc
    stop_service(svc)


def test_page_is_served(service: Service) -> None:
    r = httpx.get(f"{service.url}/", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    for part in ('id="query"', 'id="file"', 'id="reranker"', "/search/text", "/search/image"):
        assert part in r.text
    assert "http://" not in r.text and "https://" not in r.text  # nothing from elsewhere


def test_text_hits_link_their_images(service: Service, corpus: Path) -> None:
    with service.client() as c:
        hits = c.post("/search/text", json={"query": "a red circle", "top_k": 3}).json()["hits"]
        for hit in hits:
            assert hit["image_url"] == f"/images/{hit['id']}"
            r = c.get(hit["image_url"])
            assert r.status_code == 200 and r.headers["content-type"] == "image/png"
            assert "max-age" in r.headers["cache-control"]
            assert r.content == (corpus.parent / hit["meta"]["image"]).read_bytes()


def test_an_image_the_browser_holds_is_a_304_without_its_bytes(service: Service) -> None:
    """The ETag sent with an image, sent back (If-None-Match), gets a 304 and no body; any
    other tag gets the file again."""
    with service.client() as c:
        first = c.get("/images/img-0001")
        etag = first.headers["etag"]
        again = c.get("/images/img-0001", headers={"If-None-Match": f'"other", {etag}'})
        assert again.status_code == 304 and again.content == b""
        assert again.headers["etag"] == etag and "max-age" in again.headers["cache-control"]
        changed = c.get("/images/img-0001", headers={"If-None-Match": '"other"'})
        assert changed.status_code == 200 and changed.content == first.content


def test_a_range_is_served_ignored_or_a_json_416(service: Service) -> None:
    """Byte ranges are served (a video-style client, a resumed download); a Range header duet
    cannot read is ignored, the whole file sent (it was a plain-text 400), and one asking
    for no byte of the file is a JSON 416 naming the file's length (an empty text body)."""
    with httpx.Client(base_url=service.url, timeout=10) as c:
        whole = c.get("/images/img-0001").content
        n = len(whole)
        part = c.get("/images/img-0001", headers={"Range": "bytes=2-5"})
        assert part.status_code == 206 and part.content == whole[2:6]
        kept = c.get("/images/img-0001", headers={"Range": f"bytes=-3, {n + 9}-"})
        assert kept.status_code == 206 and kept.content == whole[-3:]  # the range in the file
        huge = "9" * 5000  # past int()'s 4,300 digits: it was a 500
        for ignored in (
            "chars=0-3",
            "bytes=abc",
            "bytes=5-2",
            "bytes=",
            "bytes 0-1",
            f"bytes={huge}-",
        ):
            r = c.get("/images/img-0001", headers={"Range": ignored})
            assert r.status_code == 200 and r.content == whole, ignored
        for outside in (f"bytes={n}-", "bytes=-0", f"bytes={n + 1}-{n + 5}"):
            r = c.get("/images/img-0001", headers={"Range": outside})
            assert r.status_code == 416 and r.json()["error"]["code"] == "range_not_satisfiable"
            assert r.headers["content-range"] == f"bytes */{n}", outside
        # If-Range: ranges of the file as the client holds it, else the whole file
        tag = part.headers["etag"]
        same = c.get("/images/img-0001", headers={"Range": "bytes=2-5", "If-Range": tag})
        assert same.status_code == 206 and same.content == whole[2:6]
        stale = {"Range": f"bytes={n}-", "If-Range": '"stale"'}  # was a 416
        r = c.get("/images/img-0001", headers=stale)
        assert r.status_code == 200 and r.content == whole


def test_caption_hits_link_the_image_they_describe(service: Service, corpus: Path) -> None:
    png = (corpus.parent / "images" / "0003.png").read_bytes()
    with service.client() as c:
        r = c.post(
            "/search/image", files={"image": ("q.png", png, "image/png")}, data={"top_k": "3"}
        )
        for hit in r.json()["hits"]:
            assert hit["image_url"] == f"/images/{hit['meta']['image_id']}"
            img = Image.open(io.BytesIO(c.get(hit["image_url"]).content))
            assert img.size[0] > 0


@pytest.mark.parametrize("item_id", ["no-such-id", "..%2F..%2Fetc%2Fpasswd", "%2Fetc%2Fpasswd"])
def test_unknown_images_are_404(service: Service, item_id: str) -> None:
    r = httpx.get(f"{service.url}/images/{item_id}", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_no_path_leaves_the_corpus_folder(tmp_path: Path) -> None:
    """A manifest's path never leads out of its corpus folder; a link in the corpus is
    followed only to where the images are served from (DUET_IMAGES_DIR): an images folder
    kept on another disk and linked in is served once that folder is, a link planted to a
    secret never."""
    root = tmp_path / "corpus"
    (root / "images").mkdir(parents=True)
    (root / "images" / "a.png").write_bytes(b"x")
    (tmp_path / "secret").write_text("no")
    (root / "images" / "link.png").symlink_to(tmp_path / "secret")
    (tmp_path / "disk" / "imgs").mkdir(parents=True)
    (tmp_path / "disk" / "imgs" / "b.png").write_bytes(b"y")
    (root / "linked").symlink_to(tmp_path / "disk" / "imgs")
    assert inside(root, "images/a.png") == root / "images" / "a.png"
    for rel in ("../secret", "images/../../secret", "/etc/hostname", "images/missing.png"):
        assert inside(root, rel) is None, rel
    assert inside(root, "images") is None  # a folder
    link = inside(root, "images/link.png")
    assert link is not None and not allowed(link, [root])
    linked = inside(root, "linked/b.png")
    assert linked is not None and not allowed(linked, [root])
    assert allowed(linked, [tmp_path / "disk"]) and not allowed(link, [tmp_path / "disk"])


def test_images_only_from_the_configured_folder(
    index_dir: Path, corpus: Path, tmp_path: Path
) -> None:
    """Issue 36 row 9: a version whose manifest names `/manifest.jsonl` as its corpus and an
    item path of `etc/passwd` (hashes made to match) served /etc/passwd as an image. Files
    are served only from under DUET_IMAGES_DIR (or the version folder)."""
    good = resolve_current(index_dir)
    version = tmp_path / "idx" / "tampered"
    shutil.copytree(good, version)
    con = sqlite3.connect(version / ITEMS)
    victim = con.execute("SELECT id FROM images WHERE row = 7").fetchone()[0]
    con.execute("UPDATE images SET path = 'etc/passwd' WHERE row = 7")
    con.commit()
    con.close()
    manifest = json.loads((version / MANIFEST).read_text())
    manifest["corpus"] = "/manifest.jsonl"
    manifest["files"][ITEMS] = file_sha256(version / ITEMS)
    (version / MANIFEST).write_text(json.dumps(manifest))
    point_current(tmp_path / "idx", "tampered")
    svc = start_service(
        tmp_path / "idx", tmp_path / "serve.log", DUET_IMAGES_DIR=str(corpus.parent)
    )
    try:
        r = httpx.get(f"{svc.url}/images/{victim}", timeout=10)
        assert r.status_code == 404, r.text[:200]
        assert "DUET_IMAGES_DIR" in r.json()["error"]["message"]
    finally:
        stop_service(svc)
