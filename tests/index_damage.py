"""Damage done to a copy of an index version, each with the manifest's hashes left as they
were unless said (issue 36 rows 5 to 8; `test_swap.py` makes a running service refuse each)."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable
from pathlib import Path

import faiss
import numpy as np

from store.indexio import IMAGE_INDEX, ITEMS, MANIFEST


def random_faiss(d: Path) -> None:
    """image.faiss replaced by a random index of the same size and dimension (unit vectors,
    so nothing but the file list can tell), and left out of the manifest's `files`."""
    old = faiss.read_index(str(d / IMAGE_INDEX))
    vecs = np.random.default_rng(0).standard_normal((old.ntotal, old.d)).astype(np.float32)
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    index = faiss.IndexFlatIP(old.d)
    index.add(vecs)
    faiss.write_index(index, str(d / IMAGE_INDEX))
    manifest = json.loads((d / MANIFEST).read_text())
    del manifest["files"][IMAGE_INDEX]
    (d / MANIFEST).write_text(json.dumps(manifest))


def faiss_vectors(value: float) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        index = faiss.read_index(str(d / IMAGE_INDEX))
        vecs = index.reconstruct_n(0, index.ntotal)
        vecs[3] = value
        fresh = faiss.IndexFlatIP(index.d)
        fresh.add(vecs)
        faiss.write_index(fresh, str(d / IMAGE_INDEX))

    return edit


def break_meta(d: Path) -> None:
    con = sqlite3.connect(d / ITEMS)
    con.execute("UPDATE images SET meta = '{\"image\": ' WHERE row = 7")
    con.commit()
    con.close()


def list_file(name: str) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        manifest = json.loads((d / MANIFEST).read_text())
        manifest["files"][name] = "0" * 64
        (d / MANIFEST).write_text(json.dumps(manifest))

    return edit
