"""Stage 6 of a build: write the version in a temporary folder, describe it in manifest.json,
then rename it into place and point `current` at it."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np

from index_builder.assemble import Assembled
from index_builder.write import _new_version, _write_indexes, _write_npy
from store import indexio
from store.manifest import IndexStats, Manifest

# (the temporary folder, the version name, the indexes' measurements) -> manifest.json
Describe = Callable[[Path, str, dict[str, IndexStats]], Manifest]


def publish(
    out: Path,
    contents: Assembled,
    factories: tuple[str, str],
    token_shape: tuple[int, ...],
    describe: Describe,
) -> Manifest:
    """Write `contents` as a new version of `out`, make it `current`; its manifest."""
    version = _new_version(out, contents.digest)
    tmp = out / f".building-{version}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        indexes = _write_indexes(tmp, factories, contents.ivecs, contents.tvecs)
        _write_npy(
            tmp / indexio.IMAGE_TOKENS,
            contents.token_chunks,
            (len(contents.image_rows), *token_shape),
            np.float16,
        )
        np.save(tmp / indexio.IMAGE_VECTORS, contents.ivecs)
        np.save(tmp / indexio.TEXT_VECTORS, contents.tvecs)
        indexio.write_items(tmp / indexio.ITEMS, contents.image_rows, contents.text_rows)
        manifest = describe(tmp, version, indexes)
        manifest.write(tmp)
        for f in tmp.iterdir():
            indexio.fsync_path(f)
        indexio.fsync_path(tmp)
        tmp.rename(out / version)
        indexio.fsync_path(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    indexio.point_current(out, version)
    return manifest
