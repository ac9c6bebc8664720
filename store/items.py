"""A version's item store, items.sqlite: each image's and caption's id, path or text and meta,
one row per FAISS row, written by the builder (`write_items`) and read by the service
(`ItemStore`, which keeps its most recently answered rows decoded). Re-exported by
`store.indexio`, where the rest of the on-disk format lives."""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from store import integrity
from store.errors import IndexLoadError
from store.recent import Recent

log = logging.getLogger("duet.index")

ITEMS = "items.sqlite"  # its file name in a version folder

SCHEMA = """
CREATE TABLE images (row INTEGER PRIMARY KEY, id TEXT NOT NULL UNIQUE, path TEXT, meta TEXT);
CREATE TABLE texts (row INTEGER PRIMARY KEY, id TEXT NOT NULL UNIQUE, text TEXT NOT NULL,
                    image_id TEXT, meta TEXT);
"""


@dataclass(frozen=True)
class ImageRow:
    id: str
    path: str | None
    meta: dict[str, Any]


@dataclass(frozen=True)
class TextRow:
    id: str
    text: str
    image_id: str | None
    meta: dict[str, Any]


def write_items(path: Path, images: Iterable[ImageRow], texts: Iterable[TextRow]) -> None:
    """Write the item store; row numbers follow iteration order (= FAISS row order)."""
    con = sqlite3.connect(path)
    try:
        con.executescript(SCHEMA)
        con.executemany(
            "INSERT INTO images VALUES (?, ?, ?, ?)",
            ((i, r.id, r.path, json.dumps(r.meta)) for i, r in enumerate(images)),
        )
        con.executemany(
            "INSERT INTO texts VALUES (?, ?, ?, ?, ?)",
            ((i, r.id, r.text, r.image_id, json.dumps(r.meta)) for i, r in enumerate(texts)),
        )
        con.commit()
    finally:
        con.close()


# the captions of one image: a range of the texts' unique id index ("$" sorts right after "#")
_CAPTIONS_OF = "SELECT image_id, row, text FROM texts WHERE id >= ? AND id < ? AND image_id = ?"
CAPTION_RANGES = 100  # images' caption ranges in one statement (SQLite allows 500 terms)


class ItemStore:
    """Read-only access to items.sqlite, safe to share between threads. The rows and captions
    of the `recent` most recently answered items are kept decoded: a text search's ten hits
    cost two SQLite round trips and ten JSON decodes otherwise (~0.45 ms of a 4 ms dot-only
    answer on the 2-core CPU)."""

    def __init__(self, path: Path, recent: int = 8192) -> None:
        # immutable: a published version's file is never written again (a change is a new
        # version), so SQLite takes no file locks and checks no journal for each statement:
        # ten uncached hits 146 -> 130 us, six system calls fewer. A file changed in place
        # under a running service (no duet command does) may be read stale
        self._con = sqlite3.connect(
            f"file:{path}?mode=ro&immutable=1", uri=True, check_same_thread=False
        )
        self._lock = threading.Lock()
        self._images: Recent[int, ImageRow] = Recent(recent)
        self._texts: Recent[int, TextRow] = Recent(recent)
        self._captions: Recent[str, tuple[str, ...]] = Recent(recent)

    def _rows(self, sql: str, rows: Sequence[int]) -> dict[int, tuple[Any, ...]]:
        """Under the lock: row -> the row's other columns."""
        if not rows:
            return {}
        marks = ",".join("?" * len(rows))
        cur = self._con.execute(sql.format(marks=marks), [int(r) for r in rows])
        return {r[0]: r[1:] for r in cur.fetchall()}

    @staticmethod
    def _meta(item_id: object, text: object) -> dict[str, Any]:
        """The item's meta; {} (and a warning) if it is unreadable. `check_rows` refuses such
        a version before it serves: this answers a file damaged in place afterwards per item,
        not with a 500 for every search that meets it."""
        try:
            return integrity.decode_meta(text)
        except ValueError as exc:
            log.warning("item %r: unreadable meta (%s); answered without it", item_id, exc)
            return {}

    def _fetch_images(self, rows: list[int]) -> dict[int, ImageRow]:
        got = self._rows("SELECT row, id, path, meta FROM images WHERE row IN ({marks})", rows)
        return {r: ImageRow(v[0], v[1], self._meta(v[0], v[2])) for r, v in got.items()}

    def images(self, rows: Sequence[int]) -> list[ImageRow]:
        """The image rows `rows`, in order (KeyError for a row the store lacks). Their `meta`
        dicts may be shared with other answers: copy before changing one."""
        with self._lock:
            got = self._images.get_many([int(r) for r in rows], self._fetch_images)
        return [got[int(r)] for r in rows]

    def image_by_id(self, item_id: str) -> ImageRow | None:
        """The image row named `item_id`, or None."""
        with self._lock:
            row = self._con.execute(
                "SELECT id, path, meta FROM images WHERE id = ?", (item_id,)
            ).fetchone()
        return None if row is None else ImageRow(row[0], row[1], self._meta(row[0], row[2]))

    def _fetch_texts(self, rows: list[int]) -> dict[int, TextRow]:
        got = self._rows(
            "SELECT row, id, text, image_id, meta FROM texts WHERE row IN ({marks})", rows
        )
        return {r: TextRow(v[0], v[1], v[2], self._meta(v[0], v[3])) for r, v in got.items()}

    def texts(self, rows: Sequence[int]) -> list[TextRow]:
        """The text rows `rows`, in order (as `images`)."""
        with self._lock:
            got = self._texts.get_many([int(r) for r in rows], self._fetch_texts)
        return [got[int(r)] for r in rows]

    def _fetch_captions(self, image_ids: list[str]) -> dict[str, tuple[str, ...]]:
        # tuples of strings: kept, they are nothing the collector walks (app.heap)
        found: dict[str, list[str]] = {image_id: [] for image_id in image_ids}
        distinct = list(found)  # an id asked twice is read once
        for lo in range(0, len(distinct), CAPTION_RANGES):
            part = distinct[lo : lo + CAPTION_RANGES]
            # one range of the unique id index per image (a scan otherwise), all in one
            # statement: ten hits' captions 138 -> 64 us against a statement each
            sql = " UNION ALL ".join([_CAPTIONS_OF] * len(part))
            args = [a for image_id in part for a in (f"{image_id}#", f"{image_id}$", image_id)]
            got = self._con.execute(sql, args).fetchall()
            got.sort(key=lambda r: r[1])  # in row order (SQL's ORDER BY: 27 us more)
            for image_id, _, text in got:
                found[image_id].append(str(text))
        return {k: tuple(v) for k, v in found.items()}

    def captions(self, image_ids: Sequence[str]) -> dict[str, list[str]]:
        """Each image's captions, in order (an image without any is left out). The builder
        names an image's captions `<image id>#<n>`, so each image is one range of the texts'
        unique id index."""
        with self._lock:
            got = self._captions.get_many(list(image_ids), self._fetch_captions)
        return {k: list(v) for k, v in got.items() if v}

    def holds(self, kind: str, rows: Sequence[int]) -> bool:
        """Whether what `app.work.items_of` reads for these hits is all kept decoded already
        (no SQLite read): text rows for an image query's hits (`kind` "image"), image rows
        and their captions for a text query's."""
        with self._lock:
            if kind == "image":
                return self._texts.holds([int(r) for r in rows])
            ids = []
            for r in rows:
                image = self._images.peek(int(r))
                if image is None:
                    return False
                ids.append(image.id)
            return self._captions.holds(ids)

    def all_texts(self, batch: int = 65536) -> Iterator[str]:
        """Every text's caption in row order, read in batches (the device step's caption
        table is made from them)."""
        last = -1
        while True:
            with self._lock:
                got = self._con.execute(
                    "SELECT row, text FROM texts WHERE row > ? ORDER BY row LIMIT ?", (last, batch)
                ).fetchall()
            if not got:
                return
            for _, text in got:
                yield str(text)
            last = int(got[-1][0])

    def check(self, images: int, texts: int) -> None:
        """IndexLoadError unless SQLite finds the file sound and each table holds exactly rows
        0 .. n-1 (one per FAISS row)."""
        with self._lock:
            try:
                problems = [r[0] for r in self._con.execute("PRAGMA quick_check").fetchall()]
                spans = {
                    t: self._con.execute(f"SELECT COUNT(*), MIN(row), MAX(row) FROM {t}").fetchone()
                    for t in ("images", "texts")
                }
            except sqlite3.Error as exc:
                raise IndexLoadError(f"{ITEMS} is unreadable: {exc}") from exc
        if problems != ["ok"]:
            raise IndexLoadError(f"{ITEMS} is damaged: {'; '.join(map(str, problems[:3]))}")
        for table, n in (("images", images), ("texts", texts)):
            want = (n, 0, n - 1) if n else (0, None, None)
            if tuple(spans[table]) != want:
                count, lo, hi = spans[table]
                raise IndexLoadError(
                    f"{ITEMS}: table {table} has {count} rows ({lo}..{hi}); "
                    f"the index has {n} (rows 0..{n - 1})"
                )

    def check_rows(self) -> None:
        """IndexLoadError unless every row of both tables reads as a response needs it
        (`integrity.check_rows`: value types, meta a JSON object of finite numbers)."""
        with self._lock:
            integrity.check_rows(ITEMS, self._con.execute)

    def close(self) -> None:
        """Close the file and drop the rows kept (their memory goes back with the version)."""
        with self._lock:
            for kept in (self._images, self._texts, self._captions):
                kept.clear()
            self._con.close()
