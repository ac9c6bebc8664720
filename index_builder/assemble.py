"""Stage 5 of a build: the new version's rows and arrays, the base's kept rows first, then
the new items in corpus order."""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from index_builder.corpus import CorpusItem
from index_builder.errors import BuildError
from index_builder.plan import ShardPlan
from index_builder.sources import _Base, _kept_items
from index_builder.write import _concat
from store import indexio
from store.errors import IndexLoadError
from store.integrity import MAX_NORM, check_array


@dataclass
class Assembled:
    """What a version is written from."""

    kept: list[CorpusItem]  # the new items whose image decoded, or that have none
    digest: str  # the content hash
    image_rows: list[indexio.ImageRow]
    text_rows: list[indexio.TextRow]
    ivecs: np.ndarray
    tvecs: np.ndarray
    # tokens (4 KiB per image) are streamed into the version, never held whole in memory
    token_chunks: Iterator[np.ndarray]


def assemble(
    items: Sequence[CorpusItem],
    shards: ShardPlan,
    base: _Base | None,
    kept_images: Sequence[tuple[int, indexio.ImageRow]],
    kept_texts: Sequence[tuple[int, indexio.TextRow]],
    deleted: set[str],
    dim: int,
    bad: Callable[[int, str], None],
) -> Assembled:
    """The base's kept rows and the new items' rows, with their vectors and tokens from the
    base and the shards; `bad(line, error)` hears of each image that did not decode."""
    kept, digest = _kept_items(items, shards.items, shards.paths(), bad)
    if base is not None:
        digest = hashlib.sha256(
            json.dumps([base.manifest.content_hash, sorted(deleted), digest]).encode()
        ).hexdigest()
    new_images = [indexio.ImageRow(it.id, it.image_rel, it.meta) for it in kept if it.image]
    new_texts = [
        indexio.TextRow(f"{it.id}#{n}", cap, it.id if it.image else None, it.meta)
        for it in kept
        for n, cap in enumerate(it.captions)
    ]
    image_rows = [r for _, r in kept_images] + new_images
    text_rows = [r for _, r in kept_texts] + new_texts
    img_rows = [r for r, _ in kept_images]
    txt_rows = [r for r, _ in kept_texts]
    ivecs = _concat(
        [*_base_rows(base, "image_vectors", img_rows), *shards.arrays("image_vectors")],
        (0, dim),
        np.float32,
    )
    tvecs = _concat(
        [*_base_rows(base, "text_vectors", txt_rows), *shards.arrays("text_vectors")],
        (0, dim),
        np.float32,
    )
    if len(ivecs) != len(image_rows) or len(tvecs) != len(text_rows):
        raise RuntimeError("encoded vectors do not match the item rows (stale shards?)")
    # checked as the service will check them (finite; vectors of unit norm), so a damaged
    # shard stops the build before `current` moves, not the service after it
    _sound("the image vectors", ivecs, MAX_NORM, shards)
    _sound("the text vectors", tvecs, MAX_NORM, shards)
    token_chunks = itertools.chain(
        _base_rows(base, "image_tokens", img_rows), shards.arrays("image_tokens")
    )
    checked = (_sound("the image tokens", c, None, shards) for c in token_chunks)
    return Assembled(kept, digest, image_rows, text_rows, ivecs, tvecs, checked)


def _sound(what: str, arr: np.ndarray, limit: float | None, shards: ShardPlan) -> np.ndarray:
    """`arr`, or a BuildError naming the shards to delete when it holds values the service
    would refuse (`store.integrity.check_array`)."""
    try:
        check_array(what, arr, limit)
    except IndexLoadError as exc:
        raise BuildError(
            f"{str(exc).split('; rebuild')[0]}: a shard in {shards.directory} is damaged (or "
            f"the model gave that value). Delete that folder (rm -r {shards.directory}) and "
            "build again; nothing was published"
        ) from exc
    return arr


def _base_rows(base: _Base | None, name: str, rows: list[int]) -> Iterator[np.ndarray]:
    """The base's array `name` at `rows`, 4096 rows at a time."""
    if base is not None and rows:
        src = getattr(base, name)
        for i in range(0, len(rows), 4096):
            yield np.asarray(src[rows[i : i + 4096]])
