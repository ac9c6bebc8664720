"""First run: `duet demo-index`, what the compose and Kubernetes init containers run, builds
the demo index once even when two replicas start it at once on one volume."""

from __future__ import annotations

import fcntl
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO


def test_demo_index_builds_once_even_when_started_twice_at_once(tmp_path: Path) -> None:
    """Two replicas' init containers on one volume: one builds, the other waits and skips.
    The test holds the lock while both start, so both reach it before either has built."""
    out = tmp_path / "indexes"
    out.mkdir()
    cmd = [
        sys.executable,
        "-m",
        "duet.cli",
        "demo-index",
        "--out",
        str(out),
        "--images",
        "12",
        "--no-progress",
    ]
    with (out / ".demo-index.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        procs = [
            subprocess.Popen(
                cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
            for _ in range(2)
        ]
        time.sleep(3)  # both import and wait on the lock
        assert not (out / "current").exists() and all(p.poll() is None for p in procs)
    outputs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert sum("nothing to do" in stdout for stdout, _ in outputs) == 1
    assert (out / "current" / "manifest.json").is_file()
    assert (tmp_path / "demo-corpus" / "manifest.jsonl").is_file()
    versions = [d for d in out.iterdir() if d.is_dir() and not d.is_symlink()]
    assert versions == [(out / "current").resolve()]


def _other_weights(tmp_path: Path) -> Path:
    """The shipped weights with one cross-encoder tensor nudged: another fingerprint."""
    import shutil

    from safetensors.torch import load_file, save_file

    from models.builtin import WEIGHTS_FILE
    from models.trainconfig import DEFAULT_WEIGHTS

    other = tmp_path / "other-weights"
    shutil.copytree(DEFAULT_WEIGHTS, other)
    state = load_file(str(other / WEIGHTS_FILE))
    state["itm_token"] = state["itm_token"] + 1e-3
    save_file(state, str(other / WEIGHTS_FILE), metadata={"format": "pt"})
    return other


def test_demo_index_is_built_again_for_new_weights_and_other_indexes_are_left_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A pull that brings new weights: `make serve` must not stop at a demo index the service
    will refuse. An index of the user's own corpus is never replaced by the demo."""
    from duet.cli import main
    from models.world import write_corpus
    from store.manifest import Manifest

    out, corpus = tmp_path / "indexes", tmp_path / "demo"
    demo = ["demo-index", "--out", str(out), "--corpus-out", str(corpus), "--images", "6"]
    assert main([*demo, "--no-progress"]) == 0
    first = (out / "current").resolve()
    assert main([*demo, "--no-progress"]) == 0
    assert "built by these models; nothing to do" in capsys.readouterr().out
    monkeypatch.setenv("DUET_MODEL_DIR", str(_other_weights(tmp_path)))
    images = {f.name: f.stat().st_mtime_ns for f in (corpus / "images").iterdir()}
    assert main([*demo, "--no-progress"]) == 0
    # built from the same corpus, which the old version still points at: not rewritten
    assert {f.name: f.stat().st_mtime_ns for f in (corpus / "images").iterdir()} == images
    said = capsys.readouterr().out
    second = (out / "current").resolve()
    assert "building it again as a new version" in said and second != first
    assert first.is_dir()  # the old version stays
    assert Manifest.read(second).model.fingerprint != Manifest.read(first).model.fingerprint
    # the user's own index, built by the shipped weights, under the other ones: left alone
    monkeypatch.delenv("DUET_MODEL_DIR")
    mine = tmp_path / "mine"
    write_corpus(tmp_path / "own", 4, 11, progress=False)
    build = ["build", "--corpus", str(tmp_path / "own" / "manifest.jsonl"), "--out", str(mine)]
    assert main([*build, "--no-progress"]) == 0
    own = (mine / "current").resolve()
    monkeypatch.setenv("DUET_MODEL_DIR", str(tmp_path / "other-weights"))
    capsys.readouterr()
    assert main(["demo-index", "--out", str(mine), "--images", "6", "--no-progress"]) == 0
    assert "not the demo corpus; left as it is" in capsys.readouterr().out
    assert (mine / "current").resolve() == own
    assert [d for d in mine.iterdir() if d.is_dir() and not d.is_symlink()] == [own]
