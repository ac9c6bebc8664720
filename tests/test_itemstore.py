"""The item store's bounded map of recently read rows (store.recent) and what it answers."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from store.indexio import ImageRow, ItemStore, TextRow, write_items
from store.recent import Recent


def test_recent_keeps_the_most_recently_used_and_fetches_the_rest_once() -> None:
    fetched: list[list[int]] = []

    def fetch(keys: list[int]) -> dict[int, str]:
        fetched.append(keys)
        return {k: f"v{k}" for k in keys if k != 99}

    r: Recent[int, str] = Recent(3)
    assert r.get_many([1, 2, 2, 3], fetch) == {1: "v1", 2: "v2", 3: "v3"}
    assert fetched == [[1, 2, 3]]  # a key asked twice is fetched once
    assert r.get_many([1, 4], fetch) == {1: "v1", 4: "v4"}  # 1 used again: 2 is now oldest
    assert fetched[-1] == [4] and len(r) == 3
    r.get_many([2, 3], fetch)
    assert fetched[-1] == [2]  # 2 was dropped, 3 kept
    assert r.get_many([99], fetch) == {}  # not found: not remembered either
    assert r.get_many([99], fetch) == {} and fetched[-1] == [99]
    with pytest.raises(ValueError):
        Recent(-1)


@pytest.fixture
def store_path(tmp_path: Path) -> Path:
    path = tmp_path / "items.sqlite"
    images = [ImageRow(f"img-{i}", f"images/{i}.png", {"n": i}) for i in range(6)]
    texts = [
        TextRow(f"img-{i}#{j}", f"caption {j} of {i}", f"img-{i}", {})
        for i in range(6)
        for j in range(2)
    ]
    write_items(path, images, texts)
    return path


@pytest.mark.parametrize("recent", [0, 2, 100])
def test_store_answers_the_same_whatever_it_keeps(store_path: Path, recent: int) -> None:
    store = ItemStore(store_path, recent=recent)
    for _ in range(2):  # the second round from what it kept
        assert [r.id for r in store.images([3, 0, 5, 3])] == ["img-3", "img-0", "img-5", "img-3"]
        assert store.images([4])[0] == ImageRow("img-4", "images/4.png", {"n": 4})
        assert [t.text for t in store.texts([1, 10])] == ["caption 1 of 0", "caption 0 of 5"]
        assert store.captions(["img-2", "img-9", "img-2"]) == {
            "img-2": ["caption 0 of 2", "caption 1 of 2"]
        }
    with pytest.raises(KeyError):
        store.images([42])


def test_store_reads_a_kept_row_without_sqlite(store_path: Path) -> None:
    store = ItemStore(store_path, recent=8)
    store.images([1])
    store.captions(["img-1"])
    store._con.close()  # any further query would raise ProgrammingError
    assert store.images([1])[0].id == "img-1"
    assert store.captions(["img-1"])["img-1"] == ["caption 0 of 1", "caption 1 of 1"]
    with pytest.raises(sqlite3.ProgrammingError):
        store.images([2])


def test_many_images_captions_come_in_row_order_from_one_read_per_hundred(
    tmp_path: Path,
) -> None:
    """`captions` reads a hundred images' caption ranges in one statement: each image's
    captions in row order (not their ids' order: "#10" sorts before "#2"), none of another
    image whose id starts the same ("img-1" and "img-10"), and an image without any left out."""
    path = tmp_path / "items.sqlite"
    n = 250
    images = [ImageRow(f"img-{i}", f"images/{i}.png", {}) for i in range(n)]
    # captions written round by round: image i's j-th caption in round j, so rows interleave
    texts = [
        TextRow(f"img-{i}#{j}", f"caption {j} of {i}", f"img-{i}", {})
        for j in range(13)
        for i in range(n)
        if j < i % 13
    ]
    write_items(path, images, texts)
    store = ItemStore(path, recent=0)
    calls: list[str] = []
    store._con.set_trace_callback(calls.append)
    got = store.captions([f"img-{i}" for i in range(n)])
    assert len([c for c in calls if c.startswith("SELECT")]) == 3
    want = {f"img-{i}": [f"caption {j} of {i}" for j in range(i % 13)] for i in range(n) if i % 13}
    assert got == want
