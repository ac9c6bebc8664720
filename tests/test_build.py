"""The index builder: versions, atomic `current`, bad lines named, --skip-bad."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from index_builder.build import build
from index_builder.corpus import CorpusError
from models.builtin import BuiltinModel
from store import indexio
from tests.conftest import CHILD_PYTHONPATH, DUET


def _copy_corpus(src: Path, dst: Path, n: int) -> Path:
    """First n lines of a corpus, images copied, as a new manifest."""
    (dst / "images").mkdir(parents=True)
    lines = src.read_text().splitlines()[:n]
    for line in lines:
        rel = json.loads(line)["image"]
        (dst / rel).write_bytes((src.parent / rel).read_bytes())
    manifest = dst / "manifest.jsonl"
    manifest.write_text("\n".join(lines) + "\n")
    return manifest


def test_build_writes_a_version_and_points_current(
    index_dir: Path, corpus: Path, model: BuiltinModel
) -> None:
    current = indexio.resolve_current(index_dir)
    assert (index_dir / "current").is_symlink()
    names = {p.name for p in current.iterdir()}
    assert {
        "manifest.json",
        "image.faiss",
        "text.faiss",
        "items.sqlite",
        "image_tokens.npy",
    } <= names
    manifest = json.loads((current / "manifest.json").read_text())
    assert manifest["model"]["fingerprint"] == model.fingerprint
    assert manifest["counts"] == {"images": 40, "texts": 200}
    assert manifest["dim"] == model.dim and manifest["index_type"] == "Flat"
    assert len(manifest["content_hash"]) == 64 and manifest["version"] == current.name
    loaded = indexio.IndexVersion.open(current, expect_fingerprint=model.fingerprint)
    # FAISS row i is items row i: the stored vector equals a fresh encoding of that caption
    row = loaded.store.texts([7])[0]
    vec = loaded.text_index.reconstruct(7)
    np.testing.assert_allclose(vec, model.encode_texts([row.text])[0], atol=1e-5)
    assert row.image_id is not None and row.id.startswith(row.image_id + "#")
    # one encode path: the stored image vector and tokens are what the service computes for
    # that image as a query
    image = loaded.store.images([3])[0]
    assert image.path is not None
    path = Path(image.path) if Path(image.path).is_absolute() else corpus.parent / image.path
    qvec, qtok = model.encode_images([Image.open(path)])
    np.testing.assert_allclose(loaded.image_index.reconstruct(3), qvec[0], atol=1e-5)
    np.testing.assert_allclose(loaded.image_tokens[3], qtok[0], atol=2e-3)


def test_rebuild_makes_a_new_version_and_keeps_the_old(
    tmp_path: Path, corpus: Path, model: BuiltinModel
) -> None:
    manifest = _copy_corpus(corpus, tmp_path / "c", 5)
    first = build(manifest, tmp_path / "idx", model, progress=False)
    second = build(manifest, tmp_path / "idx", model, progress=False)
    assert first.version != second.version
    assert indexio.resolve_current(tmp_path / "idx").name == second.version
    assert (tmp_path / "idx" / first.version / "manifest.json").is_file()
    a = json.loads((first.path / "manifest.json").read_text())["content_hash"]
    b = json.loads((second.path / "manifest.json").read_text())["content_hash"]
    assert a == b  # same content, same hash
    assert not list((tmp_path / "idx").glob(".building-*"))


def test_missing_image_stops_the_build_naming_the_line(
    tmp_path: Path, corpus: Path, model: BuiltinModel
) -> None:
    manifest = _copy_corpus(corpus, tmp_path / "c", 6)
    (tmp_path / "c" / "images" / "0003.png").unlink()
    with pytest.raises(CorpusError) as err:
        build(manifest, tmp_path / "idx", model, progress=False)
    assert err.value.line == 4 and "0003.png" in str(err.value)
    assert "No such file" in str(err.value)  # not "not a regular file", as a pipe is
    assert not (tmp_path / "idx" / "current").exists()  # nothing half-built is served


def test_skip_bad_skips_and_reports(tmp_path: Path, corpus: Path, model: BuiltinModel) -> None:
    manifest = _copy_corpus(corpus, tmp_path / "c", 6)
    (tmp_path / "c" / "images" / "0001.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    with manifest.open("a") as fh:
        fh.write("{not json\n")
        fh.write(json.dumps({"id": "txt-1", "captions": ["a red circle on the left"]}) + "\n")
    report = build(manifest, tmp_path / "idx", model, skip_bad=True, progress=False)
    assert report.images == 5 and report.texts == 5 * 5 + 1
    # in line order: the image of line 2 fails as it is decoded, after line 7 was read
    assert len(report.skipped) == 2 and ":2:" in report.skipped[0]
    assert ":7:" in report.skipped[1] and "malformed" in report.skipped[1]


def test_cli_build_error_is_clear(tmp_path: Path, corpus: Path) -> None:
    manifest = _copy_corpus(corpus, tmp_path / "c", 3)
    (tmp_path / "c" / "images" / "0002.png").unlink()
    env = {**os.environ, "PYTHONPATH": CHILD_PYTHONPATH}
    proc = subprocess.run(
        [
            *DUET,
            "build",
            "--corpus",
            str(manifest),
            "--out",
            str(tmp_path / "idx"),
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "manifest.jsonl:3" in proc.stderr and "--skip-bad" in proc.stderr


@pytest.mark.parametrize("cmd", ["serve", "build", "train", "demo-corpus"])
def test_every_command_has_help(cmd: str) -> None:
    env = {**os.environ, "PYTHONPATH": CHILD_PYTHONPATH}
    proc = subprocess.run(
        [*DUET, cmd, "--help"], capture_output=True, text=True, env=env, timeout=60
    )
    assert proc.returncode == 0 and "usage: duet " + cmd in proc.stdout


def test_a_killed_builds_folder_is_removed_by_the_next_build(
    corpus: Path, model: BuiltinModel, tmp_path: Path
) -> None:
    """Issue 36: a build SIGKILLed while writing left `.building-<version>/` for good. The
    next build removes every such folder whose lock no live build holds, and leaves a
    build in progress alone."""
    out = tmp_path / "idx"
    out.mkdir()
    killed = subprocess.Popen(  # a build that took the lock as a build does, then died
        [
            sys.executable,
            "-c",
            "import sys; from pathlib import Path; from index_builder.publish import _building\n"
            "with _building(Path(sys.argv[1]), 'v-killed') as tmp:\n"
            "    (tmp / 'image.faiss').write_bytes(bytes(1000))\n"
            "    print('writing', flush=True); sys.stdin.read()\n",
            str(out),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": CHILD_PYTHONPATH},
    )
    assert killed.stdout is not None and killed.stdout.readline() == b"writing\n"
    killed.kill()
    killed.wait()
    older = out / ".building-v-older"  # left by a build from before the lock files
    older.mkdir()
    (older / "items.sqlite").write_bytes(b"half")
    busy = out / ".building-v-busy"  # a build in progress: its lock is held
    busy.mkdir()
    held = os.open(out / ".building-v-busy.lock", os.O_CREAT | os.O_RDWR)
    fcntl.flock(held, fcntl.LOCK_EX)
    try:
        assert (out / ".building-v-killed").is_dir()
        build(_copy_corpus(corpus, tmp_path / "c", 6), out, model, progress=False)
        left = sorted(p.name for p in out.iterdir() if p.name.startswith(".building-"))
        assert left == [".building-v-busy", ".building-v-busy.lock"]
    finally:
        os.close(held)
