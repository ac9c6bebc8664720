"""What the builder-at-scale tests (test_builder_scale.py, test_builder_ann.py) share."""

from __future__ import annotations

from pathlib import Path

from index_builder.build import BuildReport, build
from models.builtin import BuiltinModel
from store import indexio

# one FAISS factory string of each index family the builder offers, small enough for tests
FAMILIES = ["Flat", "IVF4,Flat", "IVF4_HNSW32,SQ8", "IVF4,PQ8x4", "HNSW32"]


def reindexed(tmp_path: Path, index_dir: Path, model: BuiltinModel, factory: str) -> BuildReport:
    """The session index's stored vectors indexed again with `factory`, in tmp_path/idx: a
    --delete of nothing, so nothing is encoded."""
    out = tmp_path / "idx"
    out.mkdir()
    base = indexio.resolve_current(index_dir)
    (out / base.name).symlink_to(base)
    indexio.point_current(out, base.name)
    (tmp_path / "none.txt").write_text("")
    return build(None, out, model, progress=False, factory=factory, delete=tmp_path / "none.txt")
