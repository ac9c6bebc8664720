"""Every image of a version stays served after an append from another folder and after a
delete (`index_builder.roots`): before, an append read the base's paths against the new
corpus's folder (another picture for an id, or a 404), and a delete recorded no corpus (no
image of the version was served)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from index_builder.build import build
from models.builtin import BuiltinModel
from store.indexio import IndexVersion
from tests.conftest import start_service, stop_service


def _corpus(src: Path, dst: Path, lines: list[str], prefix: str) -> Path:
    """`lines` of the corpus at `src`, their images copied under the same names, ids
    prefixed: two such corpora name different pictures alike (images/0000.png)."""
    (dst / "images").mkdir(parents=True)
    out = []
    for k, line in enumerate(lines):
        item = json.loads(line)
        name = f"images/{k:04d}.png"
        (dst / name).write_bytes((src.parent / item["image"]).read_bytes())
        out.append(json.dumps({**item, "id": f"{prefix}-{item['id']}", "image": name}))
    manifest = dst / "manifest.jsonl"
    manifest.write_text("".join(f"{ln}\n" for ln in out))
    return manifest


def _files(index_dir: Path) -> dict[str, bytes]:
    """Each image id of the current version and the bytes its path names under its root."""
    version = IndexVersion.open(index_dir / "current")
    root = version.images_root
    assert root is not None
    rows = version.store.images(range(version.image_index.ntotal))
    return {row.id: (root / str(row.path)).read_bytes() for row in rows}


def test_an_append_from_another_folder_and_a_delete_keep_every_image_served(
    tmp_path: Path, corpus: Path, model: BuiltinModel
) -> None:
    lines = corpus.read_text().splitlines()
    first = _corpus(corpus, tmp_path / "data" / "first", lines[:3], "a")
    second = _corpus(corpus, tmp_path / "data" / "second", lines[3:5], "b")
    # the second corpus's images carry the first's names, with other pictures
    same_name = "images/0000.png"
    assert (first.parent / same_name).read_bytes() != (second.parent / same_name).read_bytes()
    out = tmp_path / "idx"
    build(first, out, model, progress=False, workers=0)
    expected = _files(out)
    build(second, out, model, progress=False, workers=0, append=True)
    for line in second.read_text().splitlines():
        item = json.loads(line)
        expected[item["id"]] = (second.parent / item["image"]).read_bytes()
    assert _files(out) == expected
    manifest = json.loads((out / "current" / "manifest.json").read_text())
    assert manifest["corpus_selection"]["images_root"] == str((tmp_path / "data").resolve())
    gone = sorted(expected)[0]
    (tmp_path / "gone.txt").write_text(f"{gone}\n")
    build(None, out, model, progress=False, workers=0, delete=tmp_path / "gone.txt")
    del expected[gone]
    assert _files(out) == expected
    svc = start_service(out, tmp_path / "serve.log", DUET_IMAGES_DIR=str(tmp_path / "data"))
    try:
        assert httpx.get(f"{svc.url}/readyz").json()["images"] == "served"
        for item_id, data in expected.items():
            r = httpx.get(f"{svc.url}/images/{item_id}", timeout=10)
            assert r.status_code == 200 and r.content == data, item_id
    finally:
        stop_service(svc)


def test_an_append_keeps_paths_when_the_bases_folder_is_elsewhere_and_refuses_folders_apart(
    tmp_path: Path, corpus: Path, model: BuiltinModel, caplog: pytest.LogCaptureFixture
) -> None:
    """A base whose corpus folder is not on this host (built on another, or moved) keeps its
    paths, read against the new folder as before, with a warning; folders that share only
    the file system's root are refused, since serving both would take DUET_IMAGES_DIR=/."""
    import dataclasses
    import shutil
    import tempfile

    from index_builder.corpus import CorpusSelection
    from index_builder.errors import BuildError
    from index_builder.roots import rooted
    from store.manifest import Manifest

    lines = corpus.read_text().splitlines()
    first = _corpus(corpus, tmp_path / "data" / "first", lines[:2], "a")
    build(first, tmp_path / "idx", model, progress=False, workers=0)
    base = Manifest.read((tmp_path / "idx" / "current").resolve())
    second = _corpus(corpus, tmp_path / "data" / "second", lines[2:3], "b")
    moved = dataclasses.replace(base, corpus="/nowhere/first/manifest.jsonl")
    roots = rooted(moved, second, CorpusSelection("manifest"))
    assert roots.base_path is None and roots.new_path is None
    assert roots.record is not None and roots.record.images_root is None
    assert "/nowhere/first) is not on this host" in caplog.text
    apart = next((Path(d) for d in ("/dev/shm", "/var/tmp") if Path(d).is_dir()), None)
    if apart is None or Path(tmp_path.parts[1]) == Path(apart.parts[1]):
        pytest.skip("no folder here that shares only / with the test's")
    far = Path(tempfile.mkdtemp(dir=apart))
    try:
        elsewhere = _corpus(corpus, far / "c", lines[2:3], "c")
        with pytest.raises(BuildError, match="share no folder but /"):
            rooted(base, elsewhere, CorpusSelection("manifest"))
    finally:
        shutil.rmtree(far)


def test_readyz_and_the_images_say_what_to_serve_from(
    tmp_path: Path, corpus: Path, model: BuiltinModel
) -> None:
    """An append that widened the root past DUET_IMAGES_DIR, and an images folder linked in
    from another disk: `images_unserved` (start-up log, /readyz) names the setting to give,
    and with it every image is served."""
    from app.config import Settings
    from app.routes.ui import images_unserved

    lines = corpus.read_text().splitlines()
    first = _corpus(corpus, tmp_path / "data" / "first", lines[:2], "a")
    second = _corpus(corpus, tmp_path / "data" / "second", lines[2:3], "b")
    out = tmp_path / "idx"
    build(first, out, model, progress=False, workers=0)
    build(second, out, model, progress=False, workers=0, append=True)
    version = IndexVersion.open(out / "current")
    narrow = Settings(index_dir=out, images_dir=first.parent)
    data = (tmp_path / "data").resolve()
    assert f"set DUET_IMAGES_DIR={data}" in str(images_unserved(version, narrow))
    assert images_unserved(version, Settings(index_dir=out, images_dir=data)) is None
    # images kept on another disk, their folder linked into the corpus
    disk = tmp_path / "disk"
    (disk / "c").mkdir(parents=True)
    linked = _corpus(corpus, disk / "c" / "real", lines[:2], "c")
    (tmp_path / "linked").mkdir()
    (tmp_path / "linked" / "images").symlink_to(linked.parent / "images")
    (tmp_path / "linked" / "manifest.jsonl").write_text(linked.read_text())
    build(tmp_path / "linked" / "manifest.jsonl", tmp_path / "idx2", model, progress=False)
    version = IndexVersion.open(tmp_path / "idx2" / "current")
    said = images_unserved(version, Settings(index_dir=out, images_dir=tmp_path / "linked"))
    assert said is not None and "is a link to" in said and "set DUET_IMAGES_DIR" in said
    assert images_unserved(version, Settings(index_dir=out, images_dir=tmp_path)) is None


def test_a_build_warns_of_images_outside_its_corpus_folder(
    tmp_path: Path, corpus: Path, model: BuiltinModel, caplog: pytest.LogCaptureFixture
) -> None:
    lines = corpus.read_text().splitlines()
    manifest = _corpus(corpus, tmp_path / "c", lines[:2], "a")
    item = json.loads(lines[2])
    (tmp_path / "out.png").write_bytes((corpus.parent / item["image"]).read_bytes())
    extra = json.dumps({**item, "id": "far", "image": "../out.png"})
    manifest.write_text(manifest.read_text() + extra + "\n")
    build(manifest, tmp_path / "idx", model, progress=False, workers=0)
    assert "1 image path(s) lead out of the corpus folder" in caplog.text
    assert "'../out.png'" in caplog.text
    assert "move the corpus file up to a folder that holds them all" in caplog.text
    # the service says so first: DUET_IMAGES_DIR, which it asked for, would not serve it
    from app.config import Settings
    from app.routes.ui import images_unserved

    first_out = json.dumps({**item, "id": "far", "image": "../out.png"})
    manifest.write_text(first_out + "\n" + "".join(f"{ln}\n" for ln in lines[:2]))
    build(manifest, tmp_path / "idx2", model, progress=False, workers=0)
    version = IndexVersion.open(tmp_path / "idx2" / "current")
    said = str(images_unserved(version, Settings(index_dir=tmp_path / "idx2")))
    assert "its first image's path, '../out.png', leads out of its corpus folder" in said
    assert "DUET_IMAGES_DIR" not in said
    # an absolute path stays one wherever the corpus file is moved
    caplog.clear()
    absolute = json.dumps({**item, "id": "abs", "image": str(tmp_path / "out.png")})
    (tmp_path / "c" / "abs.jsonl").write_text(absolute + "\n")
    build(tmp_path / "c" / "abs.jsonl", tmp_path / "idx3", model, progress=False, workers=0)
    assert "write each image's path relative to the corpus file" in caplog.text


def test_a_swap_to_a_version_whose_images_are_not_all_served_warns_as_start_up_does(
    tmp_path: Path, corpus: Path, model: BuiltinModel
) -> None:
    """A running service swapped to an append from another folder logged only "swapped
    index": the appended images were 404s with no word. Its message says that the images
    under DUET_IMAGES_DIR are still served (it said none were)."""
    import time

    lines = corpus.read_text().splitlines()
    first = _corpus(corpus, tmp_path / "data" / "first", lines[:2], "a")
    second = _corpus(corpus, tmp_path / "data" / "second", lines[2:3], "b")
    out = tmp_path / "idx"
    build(first, out, model, progress=False, workers=0)
    log = tmp_path / "serve.log"
    svc = start_service(out, log, DUET_IMAGES_DIR=str(first.parent), DUET_INDEX_POLL_S="0.2")
    try:
        build(second, out, model, progress=False, workers=0, append=True)
        deadline = time.monotonic() + 30
        while "swapped index" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        said = log.read_text()
        assert "GET /images/{id} cannot serve this version's images: its corpus folder" in said
        assert "only the images under that one are served, the rest are 404s; set " in said
        assert f"DUET_IMAGES_DIR={(tmp_path / 'data').resolve()}" in said
        first_id = json.loads(first.read_text().splitlines()[0])["id"]
        second_id = json.loads(second.read_text().splitlines()[0])["id"]
        assert httpx.get(f"{svc.url}/images/{first_id}", timeout=10).status_code == 200
        assert httpx.get(f"{svc.url}/images/{second_id}", timeout=10).status_code == 404
    finally:
        stop_service(svc)


def test_an_append_from_a_folder_inside_the_bases_and_a_refused_one_give_no_root_warning(
    tmp_path: Path, corpus: Path, model: BuiltinModel, caplog: pytest.LogCaptureFixture
) -> None:
    """An append from a folder inside the base's corpus folder moves no image out of it:
    it warned "the version's images now lie under X (the base's under X)". An append refused
    for its duplicate ids warned so too, of a version never written, before its error."""
    from index_builder.errors import BuildError

    lines = corpus.read_text().splitlines()
    first = _corpus(corpus, tmp_path / "first", lines[:2], "a")
    out = tmp_path / "idx"
    build(first, out, model, progress=False, workers=0)
    expected = _files(out)
    inner = _corpus(corpus, tmp_path / "first" / "more", lines[2:3], "b")
    build(inner, out, model, progress=False, workers=0, append=True)
    expected["b-" + json.loads(lines[2])["id"]] = (inner.parent / "images/0000.png").read_bytes()
    assert _files(out) == expected
    assert IndexVersion.open(out / "current").images_root == (tmp_path / "first").resolve()
    assert "now lie under" not in caplog.text
    again = _corpus(corpus, tmp_path / "other", lines[:1], "a")  # a-... is there already
    with pytest.raises(BuildError, match="already in the current version"):
        build(again, out, model, progress=False, workers=0, append=True)
    assert "now lie under" not in caplog.text
