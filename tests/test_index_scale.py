"""benchmarks/index_scale.py in quick mode: every type measured, recall sane, files written."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from store import ann
from tests.conftest import REPO


def _load() -> ModuleType:
    """The benchmark is a script, not a package module: load it from its path."""
    spec = importlib.util.spec_from_file_location(
        "index_scale", REPO / "benchmarks" / "index_scale.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


index_scale = _load()


def test_quick_run_measures_every_type(tmp_path: Path) -> None:
    out, png = tmp_path / "scale.md", tmp_path / "scale.png"
    out.write_text(f"# kept above\n\n{index_scale.BEGIN}\nold\n{index_scale.END}\n\nkept below\n")
    assert (
        index_scale.main(
            ["--sizes", "1000", "--queries", "100", "--out", str(out), "--plot", str(png)]
        )
        == 0
    )

    text = out.read_text()
    assert text.startswith("# kept above") and text.endswith("kept below\n")
    assert "\nold\n" not in text
    rows = {
        m[1]: m[2].split(" | ")
        for m in re.finditer(r"^\| `([^`]+)` \| (.*) \|$", text, re.MULTILINE)
    }
    assert set(rows) == set(index_scale.DEFAULT_TYPES)
    # columns after type: N, params, build s, vectors/s, p50, p99, recall@10, bytes, queries
    recall = {t: float(cells[6]) for t, cells in rows.items()}
    assert recall["Flat"] == 1.0
    assert all(r >= 0.5 for r in recall.values()), recall
    assert recall["HNSW32"] >= 0.85 and recall["IVF{nlist},Flat"] >= 0.85, recall
    assert float(rows["Flat"][7]) == 512.0  # 128 float32 per vector, header negligible
    assert float(rows["IVF{nlist},PQ32x8"][7]) < 512  # codes, codebooks, 256 centroids
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_recall_counts_shared_ids_and_ignores_padding() -> None:
    truth = np.array([[1, 2, 3], [4, 5, 6]])
    found = np.array([[3, 2, 9], [-1, -1, 4]])
    assert index_scale.recall_at_k(found, truth) == pytest.approx(3 / 6)


def test_indexes_are_the_builders_own() -> None:
    """The benchmark measures what `duet build` writes: the builder's nlist for each N."""
    for n in (10_000, 100_000, 1_000_000):
        assert index_scale.factory_for("IVF{nlist},Flat", n) == f"IVF{ann.default_nlist(n)},Flat"


@pytest.mark.parametrize("argv", [["--sizes", "10k"], ["--sizes", "500"], ["--queries", "5"]])
def test_bad_options_exit_2(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        index_scale.main(argv)
    assert e.value.code == 2


def test_unknown_index_type_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert index_scale.main(["--types", "IVF{nlist},Nope", "--out", "", "--plot", ""]) == 2
    assert "--types 'IVF{nlist},Nope'" in capsys.readouterr().err


def test_out_without_markers_is_refused_before_running(tmp_path: Path) -> None:
    out = tmp_path / "notes.md"
    out.write_text("hand-written\n")
    assert index_scale.main(["--sizes", "2000", "--out", str(out), "--plot", ""]) == 2
    assert out.read_text() == "hand-written\n"
