"""Every image of a version stays served after an append from another folder and after a
delete (`index_builder.roots`): before, an append read the base's paths against the new
corpus's folder (another picture for an id, or a 404), and a delete recorded no corpus (no
image of the version was served)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx

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
