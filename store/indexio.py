"""The on-disk index format, shared by the builder (writes) and the service (reads).

DIR/<version>/manifest.json   what was built, by which model, counts, hashes
DIR/<version>/image.faiss     image vectors (row i = images table row i)
DIR/<version>/text.faiss      caption vectors (row i = texts table row i)
DIR/<version>/image_tokens.npy  float16 patch tokens per image, for re-ranking
DIR/<version>/items.sqlite    ids, paths, captions and meta per row
DIR/<version>/image_vectors.npy, text_vectors.npy  float32 vectors (row i = row i), kept
                              so `duet build --append/--delete` need not re-encode
DIR/current -> <version>      symlink, replaced atomically
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sqlite3
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from store import ann, integrity, tokens

# re-exported (`X as X`): the builder, the service and the tests reach them through indexio
from store.errors import IndexLoadError as IndexLoadError
from store.errors import ModelMismatchError as ModelMismatchError
from store.files import file_sha256 as file_sha256
from store.files import fsync_path as fsync_path
from store.files import write_atomic as write_atomic
from store.manifest import MANIFEST as MANIFEST
from store.manifest import Manifest as Manifest
from store.recent import Recent

IMAGE_INDEX = "image.faiss"
TEXT_INDEX = "text.faiss"
IMAGE_TOKENS = "image_tokens.npy"
ITEMS = "items.sqlite"
IMAGE_VECTORS = "image_vectors.npy"
TEXT_VECTORS = "text_vectors.npy"
CURRENT = "current"
# what the service reads of a version (each must be listed in manifest.json's `files`); the
# vectors kept for --append / --delete are checked too when the version has them
SERVED_FILES = (IMAGE_INDEX, TEXT_INDEX, IMAGE_TOKENS, ITEMS)
VECTOR_FILES = (IMAGE_VECTORS, TEXT_VECTORS)

log = logging.getLogger("duet.index")


def resolve_current(index_dir: Path) -> Path:
    """The version directory `DIR/current` points at."""
    link = Path(index_dir) / CURRENT
    if not link.exists():
        raise IndexLoadError(
            f"no index at {link}: build one with `duet build --corpus MANIFEST --out {index_dir}` "
            "(or `make serve`, which builds the demo index)"
        )
    return link.resolve()


def version_dir(path: Path) -> Path:
    """A version directory, given either itself or an index directory (then its `current`)."""
    path = Path(path)
    return path if (path / MANIFEST).is_file() else resolve_current(path)


def point_current(index_dir: Path, version: str) -> None:
    """Atomically make `DIR/current` point at `DIR/<version>` (rename over the old link)."""
    tmp = Path(index_dir) / f".{CURRENT}.{os.getpid()}.tmp"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(version, tmp)
    os.replace(tmp, Path(index_dir) / CURRENT)


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
        self._con = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False)
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
        for lo in range(0, len(image_ids), CAPTION_RANGES):
            part = image_ids[lo : lo + CAPTION_RANGES]
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


@dataclass
class IndexVersion:
    """One loaded, immutable index version."""

    path: Path
    manifest: Manifest
    image_index: faiss.Index
    text_index: faiss.Index
    image_tokens: np.ndarray  # (n_images, T, d) float16, memory-mapped
    store: ItemStore
    # the serving device's copy of the vectors and image states (the GPU layout's resident
    # tables, `models.device_step.ResidentTables`), released with the version; None: none
    resident: Any = None
    # a descriptor of image_tokens.npy to announce each re-rank's reads on (store.tokens)
    tokens_fd: int | None = None

    @property
    def version(self) -> str:
        return self.manifest.version

    @property
    def fingerprint(self) -> str:
        return str(self.manifest.model.fingerprint)

    def close(self) -> None:
        """Release the version now: close the item store, free the vectors, unmap the tokens.

        The service calls this once no request holds the version any more (after a swap).
        Releasing explicitly, rather than when the object is collected, returns the memory
        even while something else still references the object (`duet serve` keeps the
        version it started with referenced for the life of the process).
        """
        self.store.close()
        # empty stand-ins: the loaded indexes are freed with their last reference (this one)
        self.image_index = faiss.IndexFlat(self.image_index.d, self.image_index.metric_type)
        self.text_index = faiss.IndexFlat(self.text_index.d, self.text_index.metric_type)
        self.image_tokens = np.zeros((0, *self.image_tokens.shape[1:]), self.image_tokens.dtype)
        if self.resident is not None:
            self.resident.release()  # the device memory goes back now, not at collection
            self.resident = None
        tokens.close_hints(self.tokens_fd)
        self.tokens_fd = None

    def token_rows(self, rows: np.ndarray) -> np.ndarray:
        """The image states of `rows`, read as one request's re-rank reads them: the rows'
        pages announced to the kernel, then copied (store.tokens)."""
        return tokens.gather(self.image_tokens, rows, self.tokens_fd)

    @property
    def images_root(self) -> Path | None:
        """The folder the item store's image paths are relative to: the corpus's images root
        (a Karpathy file's --images-root) or the corpus file's folder; None if unrecorded."""
        selection = self.manifest.corpus_selection
        if selection is not None and selection.images_root:
            return Path(selection.images_root)
        corpus = self.manifest.corpus
        return Path(corpus).parent if corpus else None

    def verify(self) -> None:
        """Prove the version whole before it serves, or raise IndexLoadError saying what is
        wrong: every file it reads listed in the manifest's `files` by a plain name inside the
        version folder (checked before anything is read), each file's sha256, the item store
        sound with one row per FAISS row and every row readable, and the stored vectors finite
        and of unit norm (tokens finite). The checks after the listing run at once, on
        threads (`integrity.run_checks`); the first failure in the order written is raised."""
        vectors = [name for name in VECTOR_FILES if (self.path / name).exists()]
        files = self.manifest.files
        integrity.check_listing(self.path, files, [*SERVED_FILES, *vectors])
        where = f"index {self.path}:"

        def store() -> None:
            self.store.check(self.image_index.ntotal, self.text_index.ntotal)
            self.store.check_rows()

        def kept(name: str) -> None:
            arr = np.load(self.path / name, mmap_mode="r")
            integrity.check_array(f"{where} {name}", arr, integrity.MAX_NORM)

        partial = functools.partial
        arrays = [
            partial(integrity.check_array, f"{where} {IMAGE_TOKENS}", self.image_tokens, None),
            *(partial(kept, name) for name in vectors),
            partial(integrity.check_index_vectors, f"{where} {IMAGE_INDEX}", self.image_index),
            partial(integrity.check_index_vectors, f"{where} {TEXT_INDEX}", self.text_index),
        ]
        # the largest file first: its hash is the longest single check
        names = sorted(files, key=lambda name: -(self.path / name).stat().st_size)
        digests = [partial(integrity.check_digest, self.path, n, files[n]) for n in names]
        integrity.run_checks([*digests, store, *arrays])

    @classmethod
    def open(
        cls, path: Path, expect_fingerprint: str | None = None, device: str = "cpu"
    ) -> IndexVersion:
        """Load a version directory; refuse it if another model built it. On a CUDA `device`
        Flat indexes search on the GPU (`ann.place`)."""
        path = Path(path)
        manifest = Manifest.read(path)
        built_by, built_with = manifest.model.fingerprint, manifest.model.built_with()
        if expect_fingerprint is not None and built_by != expect_fingerprint:
            raise ModelMismatchError(
                f"index {path} was built by model {built_by!r}{built_with} but the "
                f"service loaded {expect_fingerprint!r}; rebuild the index with these models "
                "(`duet build --encoder E --reranker R`, the same choices as DUET_ENCODER and "
                "DUET_RERANKER) or start the service with the ones that built it (DUET_ENCODER, "
                "DUET_RERANKER, DUET_MODEL_DIR)"
            )
        try:
            image_index = faiss.read_index(str(path / IMAGE_INDEX))
            text_index = faiss.read_index(str(path / TEXT_INDEX))
            table = np.load(path / IMAGE_TOKENS, mmap_mode="r")
            store = ItemStore(path / ITEMS)
        except (OSError, RuntimeError, ValueError, sqlite3.Error) as exc:
            raise IndexLoadError(f"index {path} is incomplete or corrupt: {exc}") from exc
        counts = manifest.counts
        if (
            image_index.ntotal != counts.images
            or text_index.ntotal != counts.texts
            or table.shape[0] != image_index.ntotal
        ):
            raise IndexLoadError(f"index {path}: counts in {MANIFEST} do not match the files")
        return cls(
            path,
            manifest,
            ann.place(image_index, device),
            ann.place(text_index, device),
            table,
            store,
            tokens_fd=tokens.open_hints(path / IMAGE_TOKENS),
        )
