"""The photo-sized JPEG corpus (`duet demo-corpus --format jpeg`, issue 38): its files, the
same bytes whether one process or a pool encodes them, and the command's options."""

from __future__ import annotations

import io
import json
import subprocess
from pathlib import Path

import pytest
from PIL import Image

from models.world import PhotoStyle, write_corpus
from tests.conftest import DUET


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


def test_a_photo_worker_that_fails_stops_the_corpus_with_its_error(tmp_path: Path) -> None:
    out = tmp_path / "c"
    (out / "images" / "0003.jpg").mkdir(parents=True)  # a folder where a photo goes
    with pytest.raises(IsADirectoryError):
        write_corpus(out, 12, seed=6, progress=False, photo=PhotoStyle(size=(64, 48)), workers=2)


def test_demo_corpus_workers_default_to_the_cores_and_never_pass_them() -> None:
    from duet.commands.demo import _corpus_workers
    from index_builder.write import cpu_threads

    cores = cpu_threads()
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
