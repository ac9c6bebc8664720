"""The build benchmark (benchmarks/build_devices.py) runs end to end and its agreement check
reads the two builds' vectors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks.build_devices import agreement, stages, top10
from index_builder.build import build
from index_builder.stages import STAGES
from models.builtin import BuiltinModel
from tests.conftest import REPO

SCRIPT = [sys.executable, str(REPO / "benchmarks" / "build_devices.py")]


def test_agreement_of_a_build_with_itself_and_with_a_changed_copy(
    index_dir: Path, tmp_path: Path
) -> None:
    same = agreement(index_dir, index_dir)
    assert same["min_cos_image"] == pytest.approx(1.0) and same["top10_shared"] == 1.0
    assert same["top1_same"] == 1.0
    # a copy whose image vectors are reversed in order: the same vectors, other rows
    copy = tmp_path / "copy"
    version = copy / "v1"
    version.mkdir(parents=True)
    cur = (index_dir / "current").resolve()
    np.save(version / "image_vectors.npy", np.load(cur / "image_vectors.npy")[::-1])
    np.save(version / "text_vectors.npy", np.load(cur / "text_vectors.npy"))
    (copy / "current").symlink_to("v1")
    moved = agreement(index_dir, copy)
    assert moved["min_cos_image"] < 0.99 and moved["top1_same"] < 0.2


def test_top10_in_chunks_is_argsorts_top10() -> None:
    rng = np.random.default_rng(0)
    queries = rng.standard_normal((500, 16)).astype(np.float32)
    items = rng.standard_normal((300, 16)).astype(np.float32)
    want = np.argsort(-(queries @ items.T), axis=1)[:, :10]
    assert (top10(queries, items, chunk=64) == want).all()
    assert top10(queries, items[:4]).shape == (500, 4)


def test_stages_reads_the_builds_own_stage_times(index_dir: Path) -> None:
    got = stages(index_dir, 1000.0)
    times = got["stages"]
    assert isinstance(times, dict) and set(STAGES) <= set(times)
    assert 0 < sum(times[k] for k in STAGES) < 1000 and 0 < float(str(got["other"])) < 1000


@pytest.mark.slow
def test_build_devices_benchmark_runs() -> None:
    res = subprocess.run(
        [*SCRIPT, "--devices", "cpu", "--images", "48", "--batch-size", "16"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    (row,) = [json.loads(line) for line in res.stdout.splitlines()]
    assert row["device"] == "cpu" and row["images"] == 48 and row["images_per_s"] > 0
    assert row["stages"]["encode_images"] > 0 and row["cpus"] == "all"
    for args, said in (
        (["--devices", "cpu,cpu"], "names a device twice"),
        (["--runs", "cpu;cuda@0-7;tpu"], "unknown device 'tpu'"),
        (["--runs", "cpu;cuda-nvjpeg:0.4;cuda-nvjpeg:1.5"], "unknown device 'cuda-nvjpeg:1.5'"),
        (["--runs", "cpu;cuda:0.4"], "unknown device 'cuda:0.4'"),
    ):
        refused = subprocess.run(
            [*SCRIPT, *args], capture_output=True, text=True, timeout=60, cwd=REPO
        )
        assert refused.returncode == 2 and said in refused.stderr, args


def test_a_repeated_corpus_builds_with_every_item_under_new_ids(
    corpus: Path, model: BuiltinModel, tmp_path: Path
) -> None:
    """benchmarks/repeat_corpus.py: the session corpus listed three times builds into a
    version of three times the items, each repeat's vectors its original's."""
    from benchmarks.repeat_corpus import main

    out = tmp_path / "elsewhere" / "m.jsonl"  # not beside the images: paths are absolute
    assert main([str(corpus), "--times", "3", "--out", str(out)]) == 0
    lines = [json.loads(line) for line in out.open()]
    assert len(lines) == 3 * 40 and len({x["id"] for x in lines}) == 120
    assert all(Path(x["image"]).is_absolute() and Path(x["image"]).is_file() for x in lines)
    report = build(out, tmp_path / "idx", model, progress=False)
    assert report.manifest.counts.images == 120 and report.manifest.counts.texts == 600
    vecs = np.load(report.path / "image_vectors.npy")
    np.testing.assert_allclose(vecs[:40], vecs[80:], atol=1e-6)  # repeat 2 is repeat 0
    with pytest.raises(SystemExit):
        main([str(corpus), "--times", "0", "--out", str(out)])
