"""Stage 3 of a build: the corpus items in encoding order, cut into shards under
`OUT/.shards/<key>/`, and which of those shards an interrupted run already wrote."""

from __future__ import annotations

import contextlib
import logging
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from index_builder.corpus import CorpusItem, CorpusSelection
from index_builder.encode import PlanItem, read_shard, shard_path
from index_builder.shard import shard_whole
from index_builder.sources import _Base, _shard_key
from models.builtin import BuiltinModel
from models.loading import Models

log = logging.getLogger("duet.build")

SHARDS_DIR = ".shards"


@dataclass(frozen=True)
class ShardPlan:
    """A build's shards: the items each encodes, where they go, which are already there."""

    items: list[PlanItem]
    directory: Path
    ranges: list[tuple[int, int, int]]  # (shard number, first item, end), in order
    done: set[int]  # the shards on disk already
    missing: list[tuple[int, int, int]]

    def paths(self) -> list[Path]:
        """Every shard's file, in order."""
        return [shard_path(self.directory, k) for k, _, _ in self.ranges]

    def image_items(self, k: int) -> list[PlanItem]:
        """Shard `k`'s items that have an image: one per row of its image arrays."""
        _, a, b = self.ranges[k]
        return [p for p in self.items[a:b] if p.image is not None]

    def arrays(self, name: str) -> Iterator[np.ndarray]:
        """Array `name` of every shard, in order, each read when it is needed."""
        for k, _, _ in self.ranges:
            yield read_shard(shard_path(self.directory, k), (name,))[name]

    def remove(self) -> None:
        """Delete the shards once the version is written."""
        shutil.rmtree(self.directory, ignore_errors=True)
        with contextlib.suppress(OSError):
            self.directory.parent.rmdir()  # only when no other build's shards wait there


def plan_shards(
    out: Path,
    corpus: Path | None,
    selection: CorpusSelection,
    items: Sequence[CorpusItem],
    model: BuiltinModel | Models,
    dev: Any,
    batch_size: int,
    shard_size: int,
    base: _Base | None,
    gpu_share: float = 0.0,
) -> ShardPlan:
    """`items` cut into shards of `shard_size`, in a folder named by everything that decides
    their bytes, with the ones an earlier run of the same build finished."""
    plan = [
        PlanItem(
            i,
            it.id,
            str(it.image) if it.image else None,
            it.image_rel,
            it.line,
            tuple(it.captions),
        )
        for i, it in enumerate(items)
    ]
    out.mkdir(parents=True, exist_ok=True)
    key = _shard_key(corpus, selection, plan, model, dev, batch_size, shard_size, base, gpu_share)
    directory = out / SHARDS_DIR / key
    n = len(plan)
    ranges = [(k, a, min(a + shard_size, n)) for k, a in enumerate(range(0, n, shard_size))]
    directory.mkdir(parents=True, exist_ok=True)
    done = {k for k, _, _ in ranges if _kept(shard_path(directory, k))}
    missing = [r for r in ranges if r[0] not in done]
    if done:
        log.info(
            "resuming: %d of %d shards already encoded in %s", len(done), len(ranges), directory
        )
    _tell_others(directory)
    return ShardPlan(plan, directory, ranges, done, missing)


def _kept(path: Path) -> bool:
    """Whether shard `path` is there to resume from: a file that is not whole (cut short by a
    full disk, damaged) is removed and encoded again, with a warning, rather than failing
    every later run's assembly."""
    if not path.is_file():
        return False
    if shard_whole(path):
        return True
    log.warning(
        "shard %s is damaged (cut short, or its headers overwritten): encoding it again", path
    )
    path.unlink(missing_ok=True)
    return False


def _tell_others(directory: Path) -> None:
    """Say what other builds' shards wait beside this build's (an interrupted build with
    another corpus or other arguments, or one from an older duet, whose shards a new key no
    longer finds): kept for a build that resumes them, but disk a user may want back."""
    shards = {
        d: list(d.glob("shard-*.npy"))
        for d in directory.parent.iterdir()
        if d.is_dir() and d != directory
    }
    # (a folder with no shard yet, from a build that stopped before its first, holds nothing)
    others = [d for d, files in shards.items() if files]
    if not others:
        return
    files = [f for d in others for f in shards[d]]
    size = sum(f.stat().st_size for f in files if f.is_file())
    log.warning(
        "%s holds %d other build(s)' shards (%d files, %.1f MB) that this build does not use "
        "(another corpus, other arguments, or an older duet); they are kept for the build "
        "that would resume them: delete them (rm -r %s) if none will",
        directory.parent,
        len(others),
        len(files),
        size / 1e6,
        " ".join(str(d) for d in others[:3]) + (" ..." if len(others) > 3 else ""),
    )
