"""benchmarks/paper_tables.py: the pattern check on hand-made results, and a tiny real run."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.conftest import REPO


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "paper_tables", REPO / "benchmarks" / "paper_tables.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


paper_tables = _load()


def _r(r1: float, r10: float = 99.0) -> dict[str, float]:
    return {"R@1": r1, "R@5": 90.0, "R@10": r10}


def _mode(t2i: float, i2t: float, ms: float = 1.0) -> dict[str, Any]:
    return {"t2i": _r(t2i), "i2t": _r(i2t), "ms_per_query": {"t2i": ms, "i2t": ms}}


def test_pattern_reads_the_papers_findings_off_the_numbers() -> None:
    full = {
        **_mode(70, 70, ms=100.0),
        "queries": {"t2i": 5, "i2t": 5},
        "coop_same_queries": {"t2i": _r(69), "i2t": _r(71)},
    }
    plain = {
        "modes": {"dot": _mode(50, 50, ms=0.1), "coop": _mode(61, 62, ms=1.0), "ce-full": full}
    }
    mixed = {"modes": {"dot": _mode(40, 41), "coop": _mode(58, 60)}}
    checks = {claim: ok for claim, ok, _ in paper_tables.pattern(plain, mixed)}
    assert all(checks.values()), checks
    # the same numbers with re-ranking below the dot product: the lift check says no
    plain["modes"]["coop"] = _mode(45, 62)
    lift = paper_tables.pattern(plain, mixed)[0]
    assert lift[1] is False and "(-5.0)" in lift[2]
    # a slow coop is not 50x cheaper than ce-full
    plain["modes"]["coop"] = _mode(61, 62, ms=10.0)
    speed = next(c for c in paper_tables.pattern(plain, mixed) if "50x" in c[0])
    assert speed[1] is False and "10x" in speed[2]


def test_pattern_checks_the_served_fusion_when_the_sweep_has_it() -> None:
    plain: dict[str, Any] = {"modes": {"dot": _mode(50, 50), "coop": _mode(45, 62)}}
    mixed = {"modes": {"dot": _mode(40, 41), "coop": _mode(40, 60)}}
    claims = [c for c, _, _ in paper_tables.pattern(plain, mixed)]
    assert not any("as served" in c for c in claims)  # no fusion sweep, no such row
    key = paper_tables.DEFAULT_FUSION
    for r1, holds in ((61.0, True), (59.0, False)):
        plain["sweeps"] = {"fusion": {key: {"t2i": _r(r1), "i2t": _r(60)}}}
        row = next(c for c in paper_tables.pattern(plain, mixed) if "as served" in c[0])
        assert row[1] is holds and key in row[0] and f"({r1 - 50:+.1f})" in row[2]


def test_served_checks_read_issue_13s_goals_off_the_numbers() -> None:
    key = paper_tables.DEFAULT_FUSION
    plain: dict[str, Any] = {
        "sweeps": {"M": {"10": _mode(90, 90), "20": _mode(91, 90), "50": _mode(90, 91)}}
    }
    served: dict[str, Any] = {
        "modes": {"dot": _mode(70, 71), "coop": _mode(90, 91)},
        "partial": {"modes": {"dot": {"P@1": 0.5, "P@10": 0.5}, key: {"P@1": 0.95, "P@10": 0.81}}},
    }
    checks = paper_tables.served_checks(plain, served, key)
    assert [ok for _, ok, _ in checks] == [True, True, True], checks
    assert "P@1 0.950, P@10 0.810" in checks[0][2] and "t2i 90.0 vs 90.0" in checks[1][2]
    # one query fewer at M = 50 than at 10 fails the M check; P@10 below 0.80 the partial one
    plain["sweeps"]["M"]["50"] = _mode(89.9, 91)
    served["partial"]["modes"][key]["P@10"] = 0.79
    served["modes"]["coop"] = _mode(69, 91)
    assert [ok for _, ok, _ in paper_tables.served_checks(plain, served, key)] == [False] * 3


@pytest.mark.slow
def test_a_tiny_run_writes_every_table(tmp_path: Path) -> None:
    out = tmp_path / "results.md"
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "paper_tables.py"),
            "--out",
            str(out),
            "--images",
            "30",
            "--ce-full-queries",
            "4",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    text = out.read_text()
    for heading in (
        "What the papers found",
        "Test split (pool: 30 images, 150 texts)",
        "With distractors (pool: 60 images, 300 texts)",
        "M sweep",
        "Score fusion",
        f"As served: M = 50, {paper_tables.DEFAULT_FUSION}",
        "partial queries: 300 (world seed 1013000), ",
    ):
        assert heading in text
    for mode in ("dot (bi-encoder)", "coop (", "late (", "han (", "ce-full ("):
        assert f"| {mode}" in text
    assert f"| {paper_tables.DEFAULT_FUSION} | " in text  # the served rows, full and partial
    # the raw JSON names the corpus relative to the run's work directory, gone once it ends
    assert '"path": "test-corpus/manifest.jsonl"' in text and '"path": "/' not in text


def test_paths_under_the_work_directory_are_made_relative(tmp_path: Path) -> None:
    raw = {"corpus": {"path": f"{tmp_path}/test-corpus/manifest.jsonl"}, "n": [1, f"{tmp_path}x"]}
    assert paper_tables.relative_to(raw, tmp_path) == {
        "corpus": {"path": "test-corpus/manifest.jsonl"},
        "n": [1, f"{tmp_path}x"],
    }
