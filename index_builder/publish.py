"""Stage 6 of a build: write the version in a temporary folder, describe it in manifest.json,
then rename it into place and point `current` at it."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from index_builder.assemble import Assembled
from index_builder.errors import BuildError
from index_builder.stages import Stages
from index_builder.write import _new_version, _write_indexes, _write_npy
from store import indexio
from store.manifest import IndexStats, Manifest

# (the temporary folder, the version name, the indexes' measurements) -> manifest.json
Describe = Callable[[Path, str, dict[str, IndexStats]], Manifest]
BUILDING = ".building-"
log = logging.getLogger("duet.build")


def _try_lock(path: Path) -> int | None:
    """An open descriptor of `path` (created if absent) holding an exclusive flock, or None
    while another process holds it. The kernel drops a lock with its process, however that
    process ends: a lock nobody holds means nobody is building there."""
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def remove_abandoned(out: Path) -> None:
    """Remove the `.building-*` folders of builds that died before they could (SIGKILL, the
    OOM killer, a power cut): those whose sibling `.lock` file no live build holds."""
    for folder in sorted(out.glob(f"{BUILDING}*")):
        if not folder.is_dir():
            continue
        lock = folder.with_name(folder.name + ".lock")
        fd = _try_lock(lock)
        if fd is None:
            continue  # a build in progress
        try:
            shutil.rmtree(folder, ignore_errors=True)
            lock.unlink(missing_ok=True)
            log.info("removed %s, left by a build that did not finish", folder.name)
        finally:
            os.close(fd)


@contextlib.contextmanager
def _building(out: Path, version: str) -> Iterator[Path]:
    """A fresh `out/.building-<version>/`, held (its `.lock` flocked) until the block ends,
    after the folders of dead builds are removed."""
    tmp = out / f"{BUILDING}{version}"
    lock = tmp.with_name(tmp.name + ".lock")
    fd = _try_lock(lock)
    if fd is None:
        raise BuildError(f"another build is writing {tmp}; wait for it to finish")
    try:
        remove_abandoned(out)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        yield tmp
    finally:
        lock.unlink(missing_ok=True)
        os.close(fd)


def publish(
    out: Path,
    contents: Assembled,
    factories: tuple[str, str],
    token_shape: tuple[int, ...],
    describe: Describe,
    stages: Stages | None = None,
    device: str = "cpu",
) -> Manifest:
    """Write `contents` as a new version of `out`, make it `current`; its manifest. An IVF's
    k-means runs on the GPU where `device` is cuda (`index_builder.kmeans`)."""
    version = _new_version(out, contents.digest)
    with _building(out, version) as tmp:
        manifest = _write_version(
            out,
            version,
            tmp,
            contents,
            factories,
            token_shape,
            describe,
            stages or Stages(),
            device,
        )
    indexio.point_current(out, version)
    return manifest


def _write_version(
    out: Path,
    version: str,
    tmp: Path,
    contents: Assembled,
    factories: tuple[str, str],
    token_shape: tuple[int, ...],
    describe: Describe,
    stages: Stages,
    device: str,
) -> Manifest:
    """Every file of the version into `tmp`, fsynced, then `tmp` renamed to `out/version`
    (`tmp` removed if anything fails); the manifest written. The data files are fsynced
    before `describe` runs, so the manifest's `write` stage includes their fsync."""
    try:
        indexes = _write_indexes(tmp, factories, contents.ivecs, contents.tvecs, stages, device)
        with stages("write"):
            _write_npy(
                tmp / indexio.IMAGE_TOKENS,
                contents.token_chunks,
                (len(contents.image_rows), *token_shape),
                np.float16,
            )
            np.save(tmp / indexio.IMAGE_VECTORS, contents.ivecs)
            np.save(tmp / indexio.TEXT_VECTORS, contents.tvecs)
            indexio.write_items(tmp / indexio.ITEMS, contents.image_rows, contents.text_rows)
            for f in tmp.iterdir():
                indexio.fsync_path(f)
        manifest = describe(tmp, version, indexes)
        manifest.write(tmp)
        indexio.fsync_path(tmp / indexio.MANIFEST)
        indexio.fsync_path(tmp)
        tmp.rename(out / version)
        indexio.fsync_path(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest
