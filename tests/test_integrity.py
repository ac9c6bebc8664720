"""What verification proves of a version before it serves (issue 36 rows 5 to 8), in
process on real files and real FAISS indexes; `test_swap.py` has the same damage refused by
a running service."""

from __future__ import annotations

import json
import shutil
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from app.answers import hits_of
from app.schemas import SearchResponse
from app.work import Answer
from store import ann, integrity
from store.indexio import (
    IMAGE_VECTORS,
    ITEMS,
    MANIFEST,
    TEXT_INDEX,
    IndexLoadError,
    IndexVersion,
    ItemStore,
    file_sha256,
    resolve_current,
)


def _unit(n: int, d: int = 16, seed: int = 0) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)
    return np.asarray(x / np.linalg.norm(x, axis=1, keepdims=True))


@pytest.mark.parametrize(
    ("name", "plain"),
    [
        ("image.faiss", True),
        ("..", False),
        (".", False),
        ("", False),
        ("../../etc/passwd", False),
        ("/dev/zero", False),
        ("a\\b", False),
        ("a\0b", False),
        (3, False),
    ],
)
def test_plain_names(name: object, plain: bool) -> None:
    assert integrity.plain_name(name) is plain


@pytest.mark.parametrize("factory", ["Flat", "IVF8,Flat", "IVF8,PQ4", "HNSW8", "IVF8,SQ8"])
def test_unit_vectors_pass_in_every_index_type(factory: str) -> None:
    index = ann.build_index(factory, _unit(2000))
    integrity.check_index_vectors("x", index)
    index.search(_unit(2), 3)  # still searchable: the IVF scan's direct map is gone again


@pytest.mark.parametrize("factory", ["Flat", "IVF8,Flat", "HNSW8"])
@pytest.mark.parametrize(
    ("value", "says"),
    [(np.nan, "NaN or infinite values at row 123"), (3e38, "norm 1.2e\\+39 at row 123")],
)
def test_bad_vectors_are_found_in_every_index_type(factory: str, value: float, says: str) -> None:
    vecs = _unit(500)
    vecs[123] = value
    index = ann.make_index(factory, vecs.shape[1])
    index.train(_unit(500, seed=1))
    index.add(vecs)
    # an IVF index leaves a NaN vector out of its lists (and says so)
    says = "but its inverted lists hold 499" if "IVF" in factory and value != value else says
    with pytest.raises(IndexLoadError, match=says):
        integrity.check_index_vectors("x", index)


def test_torch_flat_vectors_are_checked() -> None:
    vecs = _unit(10)
    vecs[4] *= 2
    with pytest.raises(IndexLoadError, match="norm 2 at row 4"):
        integrity.check_index_vectors("x", ann.TorchFlat(vecs, "cpu"))


@pytest.mark.parametrize(
    "meta",
    ['{"a": NaN}', '{"a": 1e999}', '{"a": -Infinity}', "[1]", '{"a": ', "[" * 50_000, None, 7],
)
def test_meta_that_a_response_cannot_carry_is_refused(meta: object) -> None:
    with pytest.raises(ValueError):
        integrity.decode_meta(meta)


def _version(index_dir: Path, tmp_path: Path, damage: Callable[[Path], None]) -> IndexVersion:
    path = tmp_path / "v"
    shutil.copytree(resolve_current(index_dir), path)
    damage(path)
    return IndexVersion.open(path)


def _rehash(path: Path, name: str) -> None:
    manifest = json.loads((path / MANIFEST).read_text())
    manifest["files"][name] = file_sha256(path / name)
    (path / MANIFEST).write_text(json.dumps(manifest))


def _sql(sql: str) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        con = sqlite3.connect(path / ITEMS)
        con.execute(sql)
        con.commit()
        con.close()
        _rehash(path, ITEMS)

    return damage


def _huge_npy(path: Path) -> None:
    vecs = np.load(path / IMAGE_VECTORS)
    vecs[2] = 1e30
    np.save(path / IMAGE_VECTORS, vecs)
    _rehash(path, IMAGE_VECTORS)


def _link_out(path: Path) -> None:
    """items.sqlite made a link to a file outside the version (same bytes, same hash)."""
    outside = path.parent / "elsewhere.sqlite"
    shutil.copy(path / ITEMS, outside)
    (path / ITEMS).unlink()
    (path / ITEMS).symlink_to(outside)


@pytest.mark.parametrize(
    ("damage", "says"),
    [
        (_sql("UPDATE images SET meta = '{\"x\": NaN}' WHERE row = 5"), "images row 5 has unre"),
        (_sql("UPDATE texts SET meta = '[]' WHERE row = 9"), "texts row 9 has unreadable meta"),
        (_sql("UPDATE images SET id = x'3132' WHERE row = 3"), "images row 3 has a value of"),
        (_sql("UPDATE texts SET text = x'00' WHERE row = 1"), "texts row 1 has a value of the"),
        (_huge_npy, "image_vectors.npy holds a vector of norm 1.13e\\+31 at row 2"),
        (_link_out, "items.sqlite is not a regular file inside the version folder"),
    ],
)
def test_damage_with_matching_hashes_is_refused(
    index_dir: Path, tmp_path: Path, damage: Callable[[Path], None], says: str
) -> None:
    version = _version(index_dir, tmp_path, damage)
    try:
        with pytest.raises(IndexLoadError, match=says):
            version.verify()
    finally:
        version.close()


def test_a_file_that_fails_to_load_is_named_by_its_digest(index_dir: Path, tmp_path: Path) -> None:
    """A truncated FAISS file was refused in FAISS's own words (`read_xb_vector ... 155 !=
    773120`), though the manifest lists its sha256: now the file and its digest are named."""

    def truncate(path: Path) -> None:
        data = (path / TEXT_INDEX).read_bytes()
        (path / TEXT_INDEX).write_bytes(data[: len(data) // 2])

    with pytest.raises(IndexLoadError, match=f"{TEXT_INDEX} differs from what the build wrote"):
        _version(index_dir, tmp_path, truncate)


def test_names_are_refused_before_anything_is_hashed(
    index_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def edit(path: Path) -> None:
        manifest = json.loads((path / MANIFEST).read_text())
        manifest["files"] = {"../" * 16 + "dev/zero": "0" * 64, **manifest["files"]}
        (path / MANIFEST).write_text(json.dumps(manifest))

    version = _version(index_dir, tmp_path, edit)
    hashed: list[Path] = []

    def record(path: Path) -> str:
        hashed.append(path)
        return ""

    monkeypatch.setattr("store.integrity.file_sha256", record)
    try:
        with pytest.raises(IndexLoadError, match="not a plain file name"):
            version.verify()
    finally:
        version.close()
    assert hashed == []


def test_checks_run_at_once_and_the_first_failure_in_order_is_raised() -> None:
    """`run_checks` runs its checks on threads together (two that each wait for the other
    finish, where one after the other would not) and raises the failure that comes first in
    its list, not the one that came first in time."""
    met = threading.Barrier(2, timeout=5)
    integrity.run_checks([met.wait, met.wait], threads=2)
    late_failure = threading.Event()

    def slow_bad() -> None:
        late_failure.wait(5)
        raise IndexLoadError("first in order")

    def quick_bad() -> None:
        late_failure.set()
        raise IndexLoadError("first in time")

    with pytest.raises(IndexLoadError, match="first in order"):
        integrity.run_checks([slow_bad, quick_bad], threads=2)
    ran: list[int] = []
    integrity.run_checks([lambda: ran.append(1), lambda: ran.append(2)], threads=1)
    assert ran == [1, 2]


def test_every_row_is_read_where_captions_repeat_their_meta(tmp_path: Path) -> None:
    """The row check decodes a meta once for a run of equal ones (a caption's meta is its
    image's): a damaged row is still found, by its own number, wherever it sits in a run."""
    path = tmp_path / "items.sqlite"
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE images (row INTEGER PRIMARY KEY, id TEXT, path TEXT, meta TEXT)")
    con.execute(
        "CREATE TABLE texts (row INTEGER PRIMARY KEY, id TEXT, text TEXT, image_id TEXT, meta TEXT)"
    )
    metas = ['{"a": 1}'] * 3 + ['{"a": 1e999}'] + ['{"a": 1}'] * 3
    con.executemany(
        "INSERT INTO texts VALUES (?, ?, 'x', NULL, ?)",
        [(i, f"t{i}", m) for i, m in enumerate(metas)],
    )
    con.commit()
    with pytest.raises(IndexLoadError, match="texts row 3 has unreadable meta"):
        integrity.check_rows("items", con.execute)
    con.execute("UPDATE texts SET meta = '{\"a\": 1}'")
    con.execute("UPDATE texts SET meta = NULL WHERE row = 0")
    con.commit()
    with pytest.raises(IndexLoadError, match="texts row 0 has unreadable meta"):
        integrity.check_rows("items", con.execute)
    con.close()


def test_meta_damaged_after_verification_is_answered_per_item(
    index_dir: Path, tmp_path: Path
) -> None:
    """A row damaged in place while the version serves: that item comes back without its
    meta, the others whole, nothing raises."""
    path = tmp_path / "v"
    shutil.copytree(resolve_current(index_dir), path)
    store = ItemStore(path / ITEMS)
    con = sqlite3.connect(path / ITEMS)
    con.execute("UPDATE images SET meta = '{broken' WHERE row = 1")
    con.commit()
    con.close()
    rows = store.images([0, 1, 2])
    assert rows[1].meta == {} and rows[0].meta and rows[2].meta
    found = store.image_by_id(rows[1].id)
    assert found is not None and found.meta == {}
    store.close()


def test_hits_with_scores_json_cannot_carry_are_left_out() -> None:
    ranked = [
        (0, 0.5, 0.9, 0.9),
        (1, 0.5, float("inf"), float("inf")),
        (2, float("nan"), None, 0.3),
        (3, 0.5, None, 0.1),
    ]
    answer = Answer(ranked, [(f"i{r}", {}) for r in range(4)], {}, None, degraded=False)
    hits, dropped = hits_of(answer, "text", None, judged=False)
    resp = SearchResponse(hits=hits, timings_ms={}, index_version="v", cached=False)
    body = json.loads(resp.model_dump_json())
    assert dropped == 2
    assert [(h["id"], h["rank"]) for h in body["hits"]] == [("i0", 1), ("i3", 2)]


def test_a_version_tiled_for_the_start_up_benchmark_is_whole(
    index_dir: Path, tmp_path: Path
) -> None:
    """`benchmarks/startup_scale.py` times start-up on a version repeated N times: it must be
    one the service accepts, every row and id its own."""
    from benchmarks.startup_scale import tile

    source = resolve_current(index_dir)
    version = IndexVersion.open(resolve_current(tile(source, 3, tmp_path / "tiled")))
    try:
        version.verify()
        small = IndexVersion.open(source)
        assert version.image_index.ntotal == 3 * small.image_index.ntotal
        assert version.text_index.ntotal == 3 * small.text_index.ntotal
        last = version.image_index.ntotal - 1
        assert version.store.images([last])[0].id.endswith("~2")
        small.close()
    finally:
        version.close()
    # scale_serve's million row from a tiled version says so (Flat indexes, copies)
    from benchmarks.scale_serve import Row, table, tiled_from

    assert tiled_from(tmp_path / "tiled") == f"x3 of {source.name}"
    assert tiled_from(index_dir) == ""
    row = Row(
        n=6_000,
        start_s=1.0,
        rss_mb=1.0,
        gpu_mb=None,
        bytes_per_image={"vectors": 1.0, "tokens": 1.0, "items": 1.0},
        reranked_1=(1.0, 2.0),
        reranked_many=(1.0, 2.0),
        dot_1_p50=0.5,
        clients=2,
        tiled=tiled_from(tmp_path / "tiled"),
    )
    text = table([row], "cpu")
    assert "| 6,000 (tiled) |" in text and f"x3 of {source.name}" in text


def test_a_write_that_fails_leaves_neither_the_file_nor_its_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk fails the write (here its fsync, as a full disk would): no temp file is
    left behind to pile up with every retry, and the file it would replace stays as it was."""
    import errno
    import os

    from store.files import write_atomic

    target = tmp_path / "shard-000000.npy"
    target.write_bytes(b"old")

    def full(_fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        write_atomic(target, b"new bytes")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard-000000.npy"]
    assert target.read_bytes() == b"old"


def test_a_current_pointing_nowhere_says_so(tmp_path: Path) -> None:
    """It said "no index at .../current", of a folder holding versions and a lost link."""
    (tmp_path / "current").symlink_to("20260101T000000Z-gone")
    with pytest.raises(IndexLoadError, match="current points to 20260101T000000Z-gone, which"):
        resolve_current(tmp_path)
