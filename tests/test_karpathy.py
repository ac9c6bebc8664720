"""Karpathy split JSON corpora (dataset_flickr30k.json / dataset_coco.json) for build and eval,
on a Karpathy-style file describing a real generated corpus."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from index_builder.build import build
from index_builder.corpus import CorpusError, CorpusFileError, CorpusSelection, read_corpus
from index_builder.encode import PlanItem
from index_builder.sources import _shard_key
from models.builtin import BuiltinModel
from models.device import resolve_device
from models.trainconfig import HELD_OUT_SEED_BASE
from models.world import write_corpus
from store import indexio
from tests.conftest import CHILD_PYTHONPATH, DUET

# image i of the generated corpus -> its Karpathy split
SPLITS = ["train"] * 5 + ["restval", "val", "val"] + ["test"] * 4
ENV = {**os.environ, "PYTHONPATH": CHILD_PYTHONPATH}


def _karpathy(manifest: Path, out: Path, dataset: str, coco: bool) -> Path:
    """A Karpathy JSON describing the corpus: Flickr30k style (images under a separate root,
    no "filepath"), or COCO style ("filepath": "images", root = the JSON's folder)."""
    images = []
    sentid = 0
    for imgid, line in enumerate(manifest.read_text().splitlines()):
        row = json.loads(line)
        folder, name = row["image"].split("/")
        sentences = []
        for cap in row["captions"]:
            sentences.append({"raw": cap, "tokens": cap.split(), "imgid": imgid, "sentid": sentid})
            sentid += 1
        entry = {
            "filename": name,
            "imgid": imgid,
            "split": SPLITS[imgid],
            "sentids": [s["sentid"] for s in sentences],
            "sentences": sentences,
        }
        if coco:
            entry.update(filepath=folder, cocoid=1000 + imgid)
        images.append(entry)
    out.write_text(json.dumps({"images": images, "dataset": dataset}))
    return out


@pytest.fixture(scope="module")
def kcorpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """12 generated images (5 captions each) and, next to their manifest, flickr.json."""
    out = tmp_path_factory.mktemp("karpathy")
    manifest = write_corpus(out, len(SPLITS), HELD_OUT_SEED_BASE + 13, progress=False)
    _karpathy(manifest, out / "flickr.json", "flickr30k", coco=False)
    return manifest


def _captions(manifest: Path) -> list[list[str]]:
    return [json.loads(line)["captions"] for line in manifest.read_text().splitlines()]


def _duet(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*DUET, *args], capture_output=True, text=True, env=ENV, timeout=120)


def test_reader_selects_splits_with_stable_ids_and_all_captions(
    kcorpus: Path, tmp_path: Path
) -> None:
    caps = _captions(kcorpus)
    sel, entries = read_corpus(
        kcorpus.parent / "flickr.json", "test", images_root=kcorpus.parent / "images"
    )
    items = list(entries)
    assert not [e for e in items if isinstance(e, CorpusError)]
    assert [it.id for it in items] == [f"flickr30k-{i:04d}" for i in range(8, 12)]  # type: ignore[union-attr]
    assert [it.captions for it in items] == caps[8:]  # type: ignore[union-attr]
    assert all(it.image is not None and it.image.is_file() for it in items)  # type: ignore
    assert sel.as_json() == {
        "format": "karpathy",
        "dataset": "flickr30k",
        "split": "test",
        "images_root": str((kcorpus.parent / "images").resolve()),
    }
    # restval is its own split name; train,restval is the usual training set
    _, train = read_corpus(
        kcorpus.parent / "flickr.json", "train,restval", kcorpus.parent / "images"
    )
    assert len(list(train)) == 6
    _, every = read_corpus(kcorpus.parent / "flickr.json", "all", kcorpus.parent / "images")
    assert len(list(every)) == 12
    # COCO style: ROOT/filepath/filename, ROOT defaulting to the JSON's folder
    coco = _karpathy(kcorpus, kcorpus.parent / "coco.json", "coco", coco=True)
    _, entries = read_corpus(coco, "val")
    val = list(entries)
    assert [(it.id, it.image_rel, it.meta["cocoid"]) for it in val] == [  # type: ignore
        ("coco-0006", "images/0006.png", 1006),
        ("coco-0007", "images/0007.png", 1007),
    ]
    assert val[0].image == kcorpus.parent / "images" / "0006.png"  # type: ignore[union-attr]


def test_cli_build_test_split_then_eval(kcorpus: Path, tmp_path: Path, model: BuiltinModel) -> None:
    idx = tmp_path / "idx-test"
    proc = _duet(
        "build",
        "--corpus",
        str(kcorpus.parent / "flickr.json"),
        "--split",
        "test",
        "--images-root",
        str(kcorpus.parent / "images"),
        "--out",
        str(idx),
        "--no-progress",
        "--workers",
        "0",
    )
    assert proc.returncode == 0, proc.stderr
    version = indexio.IndexVersion.open(
        indexio.resolve_current(idx), expect_fingerprint=model.fingerprint
    )
    manifest = json.loads((version.path / "manifest.json").read_text())
    assert manifest["counts"] == {"images": 4, "texts": 20}
    assert manifest["corpus_selection"]["split"] == "test"
    images = version.store.images(list(range(4)))
    assert [r.id for r in images] == [f"flickr30k-{i:04d}" for i in range(8, 12)]
    assert images[0].path == "0008.png" and images[0].meta["split"] == "test"
    texts = version.store.texts(list(range(20)))
    assert [t.text for t in texts] == [c for cs in _captions(kcorpus)[8:] for c in cs]
    assert texts[5].id == "flickr30k-0009#0" and texts[5].image_id == "flickr30k-0009"

    out = _duet("eval", "--index", str(idx), "--split", "test", "--json", "--modes", "dot")
    assert out.returncode == 0, out.stderr
    body = json.loads(out.stdout)
    assert body["pool"] == {"images": 4, "texts": 20}
    assert body["corpus"]["split"] == "test" and body["corpus"]["dataset"] == "flickr30k"
    assert 0 <= body["modes"]["dot"]["t2i"]["R@1"] <= 100
    wrong = _duet("eval", "--index", str(idx), "--split", "val", "--json", "--modes", "dot")
    assert wrong.returncode == 2 and "split 'test'" in wrong.stderr
    assert "--split val --out" in wrong.stderr
    # the tables name the corpus and split too (only --json did, where the docs said both)
    text = _duet("eval", "--index", str(idx), "--split", "test", "--modes", "dot", "--no-progress")
    said = f"index {version.path.name}: corpus {(kcorpus.parent / 'flickr.json').resolve()}"
    assert text.stdout.splitlines()[0] == f"{said}, split test", text.stdout
    # an append's corpus record is its own file: the split check named that file as the
    # index's corpus; the index is no longer one split's
    more = tmp_path / "more"
    more.mkdir()
    (more / "a.png").write_bytes((kcorpus.parent / "images" / "0000.png").read_bytes())
    (more / "m.jsonl").write_text(json.dumps({"id": "x", "image": "a.png", "captions": ["a"]}))
    grown = _duet("build", "--append", str(more / "m.jsonl"), "--out", str(idx))
    assert grown.returncode == 0, grown.stderr
    mixed = _duet("eval", "--index", str(idx), "--split", "test", "--modes", "dot")
    assert mixed.returncode == 2, mixed.stderr
    assert f"version {version.path.name} by an --append or --delete" in mixed.stderr
    assert "so its items are not one split's" in mixed.stderr


def test_cli_bad_file_or_image_exits_2_naming_the_problem(
    kcorpus: Path, tmp_path: Path, model: BuiltinModel
) -> None:
    root = [
        "--images-root",
        str(kcorpus.parent / "images"),
        "--out",
        str(tmp_path / "i"),
        "--no-progress",
        "--workers",
        "0",
    ]
    broken = tmp_path / "broken.json"
    broken.write_text((kcorpus.parent / "flickr.json").read_text()[:-40])
    proc = _duet("build", "--corpus", str(broken), "--split", "test", *root)
    assert proc.returncode == 2 and "broken.json is not valid JSON" in proc.stderr

    # a missing image names the entry and the file; --skip-bad builds the rest
    flickr = str(kcorpus.parent / "flickr.json")
    images = tmp_path / "images"
    images.mkdir()
    for i in (8, 10, 11):
        (images / f"{i:04d}.png").write_bytes(
            (kcorpus.parent / "images" / f"{i:04d}.png").read_bytes()
        )
    rest = [*root[2:]]
    proc = _duet(
        "build", "--corpus", flickr, "--split", "test", "--images-root", str(images), *rest
    )
    assert proc.returncode == 2
    assert "flickr.json:images[9] (0009.png): cannot read image '0009.png'" in proc.stderr
    assert "--skip-bad" in proc.stderr
    assert not (tmp_path / "i" / "current").exists()
    report = build(
        Path(flickr),
        tmp_path / "i",
        model,
        progress=False,
        skip_bad=True,
        split="test",
        images_root=images,
        workers=0,
    )
    assert (report.images, report.texts) == (3, 15) and len(report.skipped) == 1
    assert "images[9] (0009.png)" in report.skipped[0]


def test_file_level_errors(kcorpus: Path, tmp_path: Path, model: BuiltinModel) -> None:
    flickr = kcorpus.parent / "flickr.json"
    with pytest.raises(CorpusFileError, match=r"choose its split with --split test.*test 4"):
        read_corpus(flickr)
    with pytest.raises(
        CorpusFileError,
        match="unknown split tset: use train, restval, val, "
        r"test.*\(this file has: train 5, restval 1, val 2, test 4\)",
    ):
        read_corpus(flickr, "tset")
    with pytest.raises(CorpusFileError, match="no images in split restval"):
        doc = json.loads(flickr.read_text())
        doc["images"] = [im for im in doc["images"] if im["split"] != "restval"]
        (tmp_path / "f.json").write_text(json.dumps(doc))
        read_corpus(tmp_path / "f.json", "restval")
    (tmp_path / "list.json").write_text("[]")
    with pytest.raises(CorpusFileError, match=r'"images" list.*\.jsonl'):
        read_corpus(tmp_path / "list.json", "test")
    with pytest.raises(CorpusFileError, match="apply to Karpathy JSON"):
        read_corpus(kcorpus, "test")  # a JSONL manifest has no splits
    with pytest.raises(CorpusFileError, match=r"images root .* is not a directory"):
        read_corpus(flickr, "test", tmp_path / "nowhere")
    # a malformed selected entry is a per-entry error (skippable), others are not read
    doc = json.loads(flickr.read_text())
    doc["images"][9]["sentences"] = []
    doc["images"][0]["sentences"] = "not even a list"  # train: not selected
    (tmp_path / "bad.json").write_text(json.dumps(doc))
    report = build(
        tmp_path / "bad.json",
        tmp_path / "idx",
        model,
        progress=False,
        skip_bad=True,
        split="test",
        images_root=kcorpus.parent / "images",
        workers=0,
    )
    assert report.images == 3 and len(report.skipped) == 1
    assert 'images[9] (0009.png): malformed entry: "sentences"' in report.skipped[0]


def test_split_and_images_root_key_the_shards(model: BuiltinModel) -> None:
    """Resuming must never pick up another split's (or another root's) shards, even when the
    file and the planned items were the same."""
    plan = [PlanItem(0, "x", None, None, 0, ("a red circle",))]
    dev = resolve_device("cpu")

    def key(sel: CorpusSelection) -> str:
        return _shard_key(None, sel, plan, model, dev, 64, 1024, None)

    test = CorpusSelection("karpathy", "flickr30k", ("test",), "/data/f30k")
    assert key(test) == key(CorpusSelection("karpathy", "flickr30k", ("test",), "/data/f30k"))
    assert (
        len(
            {
                key(test),
                key(CorpusSelection("karpathy", "flickr30k", ("val",), "/data/f30k")),
                key(CorpusSelection("karpathy", "flickr30k", ("test",), "/other")),
                key(CorpusSelection("manifest")),
            }
        )
        == 4
    )


def test_a_lone_surrogate_is_a_bad_entry_in_either_format(kcorpus: Path, tmp_path: Path) -> None:
    """JSON's "\\ud800" with no other half is no text UTF-8 holds: such an id, caption or meta
    value ended the build in a UnicodeEncodeError as the item store was written. Now the
    entry is bad (skippable), naming it; a whole pair (an emoji) is text."""
    good = json.loads(kcorpus.read_text().splitlines()[0])
    lines = [
        json.dumps({**good, "id": "pair", "captions": ["a red \U0001f534 circle"]}),
        json.dumps({**good, "id": "a\ud800b"}),
        json.dumps({**good, "id": "cap", "captions": ["a red \udc00 circle"]}),
        json.dumps({**good, "id": "meta", "meta": {"note": "\ud83d"}}),
    ]
    (tmp_path / "m.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "images").symlink_to(kcorpus.parent / "images")
    entries = list(read_corpus(tmp_path / "m.jsonl")[1])
    assert not isinstance(entries[0], CorpusError) and entries[0].id == "pair"
    for bad in entries[1:]:
        assert isinstance(bad, CorpusError) and "surrogate pair with no other half" in str(bad)
    doc = json.loads((kcorpus.parent / "flickr.json").read_text())
    doc["images"][9]["sentences"][0]["raw"] = "a red \ud800 circle"
    (tmp_path / "k.json").write_text(json.dumps(doc))
    selected = list(read_corpus(tmp_path / "k.json", "test", kcorpus.parent / "images")[1])
    [bad] = [e for e in selected if isinstance(e, CorpusError)]
    assert "images[9] (0009.png)" in str(bad) and "no other half" in str(bad)
