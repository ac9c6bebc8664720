"""store.tokens: a re-rank's rows of the memory-mapped image-state table, their pages
announced to the kernel before they are read."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from store import tokens
from store.indexio import IndexVersion, resolve_current
from tests.conftest import free_port


def _table(tmp_path: Path, n: int = 64) -> tuple[Path, np.memmap]:
    path = tmp_path / "image_tokens.npy"
    rng = np.random.default_rng(3)
    np.save(path, rng.standard_normal((n, 16, 128)).astype(np.float16))
    table = np.load(path, mmap_mode="r")
    assert isinstance(table, np.memmap)  # as the service loads it
    return path, table


def test_the_announced_ranges_are_the_rows_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, table = _table(tmp_path)
    fd = tokens.open_hints(path)
    assert fd is not None
    calls: list[tuple[int, int, int]] = []
    real = os.posix_fadvise

    def spy(f: int, offset: int, length: int, advice: int) -> None:
        calls.append((offset, length, advice))
        real(f, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", spy)
    rows = np.array([5, 0, 63, 17])
    got = tokens.gather(table, rows, fd)
    np.testing.assert_array_equal(got, np.asarray(table)[rows])
    assert not isinstance(got, np.memmap)  # a copy in memory, not a view of the map
    raw = path.read_bytes()
    assert [c[2] for c in calls] == [os.POSIX_FADV_WILLNEED] * len(rows)
    for (offset, length, _), r in zip(calls, rows, strict=True):
        assert raw[offset : offset + length] == table[r].tobytes()  # exactly row r's bytes
    calls.clear()
    tokens.announce(table, np.array([-1, 64, 2]), fd)  # rows outside the table: not announced
    assert [c[0] for c in calls] == [table.offset + 2 * table.strides[0]]
    tokens.close_hints(fd)


def test_without_a_descriptor_or_a_map_it_is_a_plain_gather(tmp_path: Path) -> None:
    _, table = _table(tmp_path)
    rows = np.array([3, 3, 9])
    np.testing.assert_array_equal(tokens.gather(table, rows, None), np.asarray(table)[rows])
    in_memory = np.asarray(table).copy()  # no file offset: nothing to announce
    np.testing.assert_array_equal(tokens.gather(in_memory, rows, 0), in_memory[rows])


def test_a_version_reads_its_rows_and_closes_the_descriptor(index_dir: Path) -> None:
    version = IndexVersion.open(resolve_current(index_dir))
    fd = version.tokens_fd
    assert fd is not None
    rows = np.array([1, 0, len(version.image_tokens) - 1])
    np.testing.assert_array_equal(version.token_rows(rows), version.image_tokens[rows])
    version.close()
    assert version.tokens_fd is None
    with pytest.raises(OSError):
        os.fstat(fd)


def test_the_benchmark_reads_both_ways_in_both_cache_states(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchmarks.token_reads import main, measure

    path, _ = _table(tmp_path)
    got = measure(path, rows=8, trials=2)
    assert set(got) == {"plain cached", "plain dropped", "announced cached", "announced dropped"}
    assert all(v["p50_ms"] > 0 for v in got.values())
    assert main([str(tmp_path), "--rows", "8", "--trials", "2"]) == 0
    out = capsys.readouterr().out
    assert "| announced | dropped |" in out and "plain / announced" in out


@pytest.mark.slow
def test_the_pressure_benchmark_serves_in_a_memory_cgroup(
    index_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """benchmarks/token_pressure.py end to end: a real `duet serve` answering re-ranked
    searches, inside a memory cgroup where this machine lets one be made (root, a memory
    controller), else without one."""
    from benchmarks import token_pressure

    try:
        token_pressure.make_cgroup("duet-token-pressure", 2**31).rmdir()
        limit = "2048"
    except OSError:
        limit = "0"
    argv = ["--index-dir", str(index_dir), "--requests", "5", "--limit-mb", limit]
    assert token_pressure.main([*argv, "--port", str(free_port())]) == 0
    out = capsys.readouterr().out
    assert "re-ranked at 1 client, 5 requests: p50" in out
    assert ("2048 MB cgroup" if limit != "0" else "no limit") in out
