"""The photo-sized JPEG corpus (`duet demo-corpus --format jpeg`, issue 38): its files, the
same bytes whether one process or a pool encodes them, and the command's options."""

from __future__ import annotations

import argparse
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from models.world import PhotoStyle, write_corpus
from models.world.corpus import _Photos
from tests.conftest import DUET, REPO, child_pids, process_alive


def test_jpeg_corpus_holds_jpegs_of_the_asked_size_and_is_deterministic(tmp_path: Path) -> None:
    style = PhotoStyle(size=(96, 72), quality=85, tiles=2)
    first = write_corpus(tmp_path / "a", 3, seed=5, progress=False, photo=style)
    again = write_corpus(tmp_path / "b", 3, seed=5, progress=False, photo=style)
    lines = [json.loads(line) for line in first.read_text().splitlines()]
    assert [line["image"] for line in lines] == [
        "images/0000.jpg",
        "images/0001.jpg",
        "images/0002.jpg",
    ]
    for line in lines:
        data = (first.parent / line["image"]).read_bytes()
        assert data == (again.parent / line["image"]).read_bytes()
        img = Image.open(io.BytesIO(data))
        assert img.format == "JPEG" and img.size == (96, 72) and img.mode == "RGB"


def test_a_jpeg_corpus_is_the_same_bytes_encoded_by_a_pool_of_processes(tmp_path: Path) -> None:
    style = PhotoStyle(size=(96, 72), quality=85, tiles=3)
    here = write_corpus(tmp_path / "a", 40, seed=6, progress=False, photo=style)
    pooled = write_corpus(tmp_path / "b", 40, seed=6, progress=False, photo=style, workers=2)
    assert pooled.read_text() == here.read_text()
    names = sorted(p.name for p in (tmp_path / "a" / "images").iterdir())
    assert len(names) == 40 and names == sorted(
        p.name for p in (tmp_path / "b" / "images").iterdir()
    )
    for name in names:
        assert (tmp_path / "a" / "images" / name).read_bytes() == (
            tmp_path / "b" / "images" / name
        ).read_bytes(), name


def test_the_photos_go_to_a_pool_only_when_asked_and_only_for_photos(tmp_path: Path) -> None:
    style = PhotoStyle(size=(64, 48), tiles=1)
    with _Photos(tmp_path, style, 1, workers=2, n_images=10) as pooled:
        assert pooled._pool is not None
    with _Photos(tmp_path, style, 1, workers=1, n_images=10) as here:
        assert here._pool is None
    with _Photos(tmp_path, None, 1, workers=4, n_images=10) as pngs:
        assert pngs._pool is None


def test_a_photo_worker_that_fails_stops_the_corpus_with_its_error_and_no_manifest(
    tmp_path: Path,
) -> None:
    out = tmp_path / "c"
    (out / "images" / "0003.jpg").mkdir(parents=True)  # a folder where a photo goes
    (out / "manifest.jsonl").write_text("an older corpus's\n")
    with pytest.raises(IsADirectoryError):
        write_corpus(out, 12, seed=6, progress=False, photo=PhotoStyle(size=(64, 48)), workers=2)
    # no manifest that lists a photo never written (nor the older corpus's, over new files)
    assert not (out / "manifest.jsonl").exists()
    assert (out / "manifest.jsonl.partial").is_file()


def test_a_pools_workers_exit_when_the_process_that_made_them_is_killed(tmp_path: Path) -> None:
    script = (
        "from pathlib import Path\n"
        "from models.world import PhotoStyle, write_corpus\n"
        f"write_corpus(Path({str(tmp_path / 'c')!r}), 100000, seed=3, progress=False,\n"
        "             photo=PhotoStyle(size=(256, 192), tiles=1), workers=2)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while len(child_pids(proc.pid)) < 2 or not any((tmp_path / "c" / "images").glob("*")):
            assert proc.poll() is None and time.monotonic() < deadline, "no pool started"
            time.sleep(0.2)
        workers = child_pids(proc.pid)
    finally:
        proc.kill()  # no clean-up of its own: SIGKILL
        proc.wait(30)
    deadline = time.monotonic() + 20
    while (alive := [pid for pid in workers if process_alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive, f"workers {alive} outlived the process that made them"


def test_the_demo_corpus_command_hands_its_workers_to_the_corpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import models.world
    from duet.commands.demo import cmd_demo_corpus

    seen: dict[str, Any] = {}

    def record(out: Path, *args: Any, **kwargs: Any) -> Path:
        seen.update(kwargs)
        return out / "manifest.jsonl"

    monkeypatch.setattr(models.world, "write_corpus", record)
    base = {"out": str(tmp_path), "seed": 1, "captions": 5, "image_size": None, "quality": 90}
    base["force"] = False
    args = argparse.Namespace(**base, images=300, format="jpeg", workers=1, no_progress=True)
    assert cmd_demo_corpus(args) == 0 and seen["workers"] == 1
    args = argparse.Namespace(**base, images=300, format="png", workers=None, no_progress=True)
    assert cmd_demo_corpus(args) == 0 and seen["workers"] == 1  # PNGs: no pool


def test_demo_corpus_workers_default_to_the_cores_and_never_pass_them() -> None:
    from app.engine import available_cores
    from duet.commands.demo import _corpus_workers

    cores = available_cores()
    assert _corpus_workers(None, 20000) == cores
    assert _corpus_workers(None, 10) == 1  # too few photos to pay for the processes
    assert _corpus_workers(10 * cores, 20000) == cores
    assert _corpus_workers(1, 20000) == 1


def test_demo_corpus_cli_takes_a_jpeg_size_and_refuses_bad_ones(tmp_path: Path) -> None:
    cmd = [*DUET, "demo-corpus", "--out", str(tmp_path / "j"), "--images", "2", "--no-progress"]
    ok = subprocess.run(
        [*cmd, "--format", "jpeg", "--image-size", "80x60", "--quality", "90"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ok.returncode == 0, ok.stderr
    assert Image.open(tmp_path / "j" / "images" / "0001.jpg").size == (80, 60)
    for bad, message in (
        (["--image-size", "80x60"], "apply to --format jpeg"),
        (["--format", "jpeg", "--image-size", "80by60"], "WIDTHxHEIGHT"),
        (["--format", "jpeg", "--quality", "100"], "1 to 95"),
        (["--format", "jpeg", "--workers", "0"], "at least 1"),
    ):
        res = subprocess.run(
            [*DUET, "demo-corpus", "--out", str(tmp_path / "x"), "--images", "1", *bad],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert res.returncode != 0 and message in res.stderr, res.stderr
