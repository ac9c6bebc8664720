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
import logging
import os
import sqlite3
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
from store.items import CAPTION_RANGES as CAPTION_RANGES
from store.items import ITEMS as ITEMS
from store.items import SCHEMA as SCHEMA
from store.items import ImageRow as ImageRow
from store.items import ItemStore as ItemStore
from store.items import TextRow as TextRow
from store.items import write_items as write_items
from store.manifest import MANIFEST as MANIFEST
from store.manifest import Manifest as Manifest

IMAGE_INDEX = "image.faiss"
TEXT_INDEX = "text.faiss"
IMAGE_TOKENS = "image_tokens.npy"
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
    if link.is_symlink() and not link.exists():  # said "no index at": there is one, lost
        raise IndexLoadError(
            f"{link} points to {os.readlink(link)}, which does not exist: point it at a "
            f"version in {index_dir} (ln -sfn VERSION {link}) or build one with `duet build`"
        )
    if not link.exists():
        raise IndexLoadError(f"no index at {link}: {_what_instead(Path(index_dir))}")
    return link.resolve()


def _what_instead(index_dir: Path) -> str:
    """What to do when `index_dir` has no `current`: it may be a version folder, a file (a
    manifest), or missing, each told as such (`--out MANIFEST` was suggested for a file)."""
    if (index_dir / MANIFEST).is_file():
        return (
            f"{index_dir} is one version of an index; give the folder that holds it and its "
            f"`current` link, {index_dir.resolve().parent}"
        )
    if index_dir.exists() and not index_dir.is_dir():
        return (
            f"{index_dir} is a file; give the folder `duet build --out` wrote the index into "
            "(it holds a `current` link)"
        )
    return (
        f"build one with `duet build --corpus MANIFEST --out {index_dir}` (or `make serve`, "
        "which builds the demo index)"
    )


def version_dir(path: Path) -> Path:
    """A version directory, given either itself or an index directory (then its `current`)."""
    path = Path(path)
    return path if (path / MANIFEST).is_file() else resolve_current(path)


def images_root_of(manifest: Manifest) -> Path | None:
    """The folder a version's image paths are relative to: its corpus's images root (a
    Karpathy file's --images-root; after an append from another folder, the two folders'
    common one, `index_builder.roots`) or the corpus file's folder; None if unrecorded."""
    selection = manifest.corpus_selection
    if selection is not None and selection.images_root:
        return Path(selection.images_root)
    return Path(manifest.corpus).parent if manifest.corpus else None


def point_current(index_dir: Path, version: str) -> None:
    """Atomically make `DIR/current` point at `DIR/<version>` (rename over the old link)."""
    tmp = Path(index_dir) / f".{CURRENT}.{os.getpid()}.tmp"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(version, tmp)
    os.replace(tmp, Path(index_dir) / CURRENT)


def file_checks(path: Path, files: Any) -> tuple[list[functools.partial[None]], list[str]]:
    """The version at `path` as its manifest's `files` lists it: IndexLoadError now unless it
    lists every file the version reads (`integrity.check_listing`); then each file's sha256
    check, the largest first (its hash is the longest single check), and the vector files it
    keeps. `IndexVersion.verify` runs them with its other checks; an append's base, alone."""
    vectors = [name for name in VECTOR_FILES if (path / name).exists()]
    integrity.check_listing(path, files, [*SERVED_FILES, *vectors])
    names = sorted(files, key=lambda name: -(path / name).stat().st_size)
    digests = [functools.partial(integrity.check_digest, path, n, files[n]) for n in names]
    return digests, vectors


def _tell_damage(path: Path, files: Any) -> None:
    """IndexLoadError naming a file the version failed to load from that cannot be read or
    differs from its sha256 in the manifest (a truncated .faiss was FAISS's `read_xb_vector
    ... 155 != 773120`, an unreadable item store SQLite's "unable to open database file")."""
    for name in (IMAGE_INDEX, TEXT_INDEX, IMAGE_TOKENS, ITEMS):
        if isinstance(files, dict) and isinstance(files.get(name), str):
            integrity.check_digest(path, name, files[name])


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
        """The folder the item store's image paths are relative to (`images_root_of`)."""
        return images_root_of(self.manifest)

    def verify(self) -> None:
        """Prove the version whole before it serves, or raise IndexLoadError saying what is
        wrong: every file it reads listed in the manifest's `files` by a plain name inside the
        version folder (checked before anything is read), each file's sha256, the item store
        sound with one row per FAISS row and every row readable, and the stored vectors finite
        and of unit norm (tokens finite). The checks after the listing run at once, on
        threads (`integrity.run_checks`); the first failure in the order written is raised."""
        digests, vectors = file_checks(self.path, self.manifest.files)
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
                f"index {path} was built by model {built_by!r}{built_with} but the models "
                f"loaded here are {expect_fingerprint!r}; rebuild the index with these "
                "(`duet build --encoder E --reranker R`, the same choices as DUET_ENCODER and "
                "DUET_RERANKER) or load the ones that built it (DUET_ENCODER, DUET_RERANKER, "
                "DUET_MODEL_DIR; duet eval and duet build also take --encoder, --reranker and "
                "--model-dir)"
            )
        try:
            image_index = faiss.read_index(str(path / IMAGE_INDEX))
            text_index = faiss.read_index(str(path / TEXT_INDEX))
            table = np.load(path / IMAGE_TOKENS, mmap_mode="r")
            store = ItemStore(path / ITEMS)
        except (OSError, RuntimeError, ValueError, sqlite3.Error) as exc:
            _tell_damage(path, manifest.files)  # FAISS's or SQLite's own words otherwise
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
