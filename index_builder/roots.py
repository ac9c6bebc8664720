"""Where a version's image paths are relative to (its images root), across appends and deletes.

A fresh build's image paths are relative to its corpus's images root: the manifest's folder,
or a Karpathy file's --images-root. A --delete keeps its base's record, and with it the root
its paths are relative to (it recorded no corpus before: the service then served none of the
version's images). An --append from the base's own folder keeps that root too; from another
folder, the version's root is the two folders' deepest common folder, recorded in
`corpus_selection.images_root`, and every path is rewritten relative to it, the base's and the
new items' alike. Before, the base's paths were read against the appended corpus's folder: a
wrong picture for an id, or a 404. A path inside either folder stays inside the root, so
`GET /images/{id}`'s rule (a file inside the version's root, under DUET_IMAGES_DIR) holds for
both folders. Two folders that share only the file system's root are refused (serving them
would take DUET_IMAGES_DIR=/), and a base whose folder is not on this host keeps its paths as
they are, read against the new folder, as before (right for a corpus moved there)."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from index_builder.corpus import CorpusItem, CorpusSelection
from index_builder.errors import BuildError
from store import indexio
from store.manifest import CorpusRecord, Manifest

log = logging.getLogger("duet.build")

Rewrite = Callable[[str], str]


@dataclass(frozen=True)
class Roots:
    """What the version records of its corpus, and how paths are rewritten (None: as read)."""

    corpus: str | None
    record: CorpusRecord | None
    base_path: Rewrite | None = None
    new_path: Rewrite | None = None

    def kept(
        self, rows: Sequence[tuple[int, indexio.ImageRow]]
    ) -> list[tuple[int, indexio.ImageRow]]:
        """The base's kept image rows, their paths relative to the version's root."""
        return [(n, _moved(row, self.base_path)) for n, row in rows]

    def place_new(self, rows: list[indexio.ImageRow], first: int) -> None:
        """The new items' rows (from `first` on) rewritten in place, relative to the root."""
        rows[first:] = [_moved(row, self.new_path) for row in rows[first:]]


def _moved(row: indexio.ImageRow, rewrite: Rewrite | None) -> indexio.ImageRow:
    if rewrite is None or row.path is None:
        return row
    return dataclasses.replace(row, path=rewrite(row.path))


def rooted(
    base: Manifest | None,
    corpus: Path | None,
    selection: CorpusSelection,
    items: Sequence[CorpusItem] = (),
) -> Roots:
    """The version's corpus record and path rewrites, for a build of `corpus`' `items`
    (None: a delete) on `base` (None: a fresh build). BuildError for an append whose folder
    shares no folder but the file system's root with the base's."""
    if corpus is None:
        return Roots(base.corpus, base.corpus_selection) if base else Roots(None, None)
    record = CorpusRecord(**selection.as_json())
    written = str(Path(corpus).resolve())
    new_root = Path(selection.images_root or Path(corpus).resolve().parent).resolve()
    _warn_leaving(items, new_root)
    if base is None:
        return Roots(written, record)
    old_root = indexio.images_root_of(base)
    if old_root is None or not old_root.is_dir():
        log.warning(
            "the base version's corpus folder (%s) is not on this host: its images' paths are "
            "kept as they are, now relative to %s (right where that folder holds them)",
            old_root or "unrecorded",
            new_root,
        )
        return Roots(written, record)
    old_root = old_root.resolve()
    if old_root == new_root:
        return Roots(written, record)
    common = Path(os.path.commonpath([old_root, new_root]))
    if common == Path(common.anchor):
        raise BuildError(
            f"the base's images are under {old_root} and this corpus's under {new_root}: "
            f"they share no folder but {common}, and serving the images of both would take "
            f"DUET_IMAGES_DIR={common}; put the new corpus (its manifest and images) in a "
            f"folder beside {old_root}, e.g. {old_root.parent / 'more'}, and append from there"
        )
    if common != old_root:  # a corpus in a folder under the base's: nothing moved
        log.warning(
            "the version's images now lie under %s (the base's under %s): serve them with "
            "DUET_IMAGES_DIR at or above %s",
            common,
            old_root,
            common,
        )
    return Roots(
        written,
        dataclasses.replace(record, images_root=str(common)),
        _relative(old_root, common),
        _relative(new_root, common),
    )


def _warn_leaving(items: Sequence[CorpusItem], root: Path) -> None:
    """A warning for images whose path leads out of the corpus folder ("..", an absolute
    path): indexed and searched, but never served by `GET /images/{id}`."""
    out = [
        it.image_rel
        for it in items
        if it.image_rel is not None
        and not Path(os.path.normpath(root / it.image_rel)).is_relative_to(root)
    ]
    if out:
        # an absolute path stays one wherever the corpus file is: moving the file is no fix
        how = (
            "write each image's path relative to the corpus file, kept in a folder that "
            "holds them all"
            if any(os.path.isabs(p) for p in out)
            else "move the corpus file up to a folder that holds them all, its paths "
            "written from there"
        )
        log.warning(
            "%d image path(s) lead out of the corpus folder %s (e.g. %r): they are indexed and "
            "searched, but GET /images/{id} serves only files inside it: %s",
            len(out),
            root,
            out[0],
            how,
        )


def _relative(root: Path, common: Path) -> Rewrite:
    def rewrite(path: str) -> str:
        return os.path.relpath(os.path.normpath(root / path), common)

    return rewrite
