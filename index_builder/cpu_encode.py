"""The encode step on CPU: pieces of shards in parallel, one per worker process at a time.

The model is small, and its forward passes do not keep two cores busy (torch's intra-op
threads wait on each other at every small op, and worse on a busy machine), so cores are
used across pieces of work instead: each worker (a DataLoader process, forked with the
model) takes a unit (`Units`) on one thread, either one batch of a shard's images (read, decode,
resize, encode) or one chunk of its captions (`shard.caption_chunks`: sorted by length,
max(batch size, 1024) at a time), and hands the arrays back in order; this process puts
each shard together (`ShardBuilder.add_encoded`, `finish`) and writes it. `workers=0` does
the same here.

Pieces smaller than a shard keep every core busy to the end: 20 shards on 16 workers would
leave 12 of them idle for the second half of the step. A shard is encoded in the same
batches and caption chunks as a whole-shard encoder's (every caption is encoded; those of an
image that failed to decode are dropped after, by any engine), on one torch thread whatever
the number of workers, so its bytes do not depend on how many workers made it, and a build
resumed with other --workers writes the same files (`IDENTICAL_FILES`).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from index_builder.decode import Decoded, DecodedBatch, PlanItem, decode, shard_batches
from index_builder.encode import Encoder
from index_builder.outdir import let_go
from index_builder.progress import EncodeProgress
from index_builder.shard import (
    ShardBuilder,
    caption_chunks,
    caption_step,
    encode_images,
    in_order,
    shard_captions,
    write_shard,
)
from index_builder.stages import Stages
from models.builtin import BuiltinModel

# what a unit gives back: its number, its images' outcomes (pixels dropped), their vectors
# and tokens (None without any decoded), or its captions' vectors, and its stage seconds
Done = tuple[int, list[Decoded], np.ndarray | None, np.ndarray | None, dict[str, float]]


@dataclass(frozen=True)
class Units:
    """The missing shards' units, numbered shard by shard, each shard's image batches first,
    then its caption chunks; only their counts are held (a million items' batches and
    caption lists made up front would be hundreds of MB, copied into every worker), each
    unit's work is made where it runs."""

    plan: Sequence[PlanItem]
    missing: list[tuple[int, int, int]]
    batch_size: int
    images: list[int]  # image batches per shard
    counts: list[int]  # units per shard
    starts: list[int]  # each shard's first unit number

    @classmethod
    def of(
        cls, plan: Sequence[PlanItem], missing: list[tuple[int, int, int]], batch_size: int
    ) -> Units:
        step = caption_step(batch_size)
        images = [len(shard_batches(plan, a, b, batch_size)) for _, a, b in missing]
        texts = [sum(len(it.captions) for it in plan[a:b]) for _, a, b in missing]
        counts = [i + -(-t // step) for i, t in zip(images, texts, strict=True)]
        starts = [0, *itertools.accumulate(counts[:-1])]
        return cls(plan, missing, batch_size, images, counts, starts)

    def __len__(self) -> int:
        return sum(self.counts)

    def where(self, i: int) -> tuple[int, int]:
        """Unit i's shard (its place in the missing list) and its place in that shard."""
        s = bisect.bisect_right(self.starts, i) - 1
        return s, i - self.starts[s]

    def is_captions(self, i: int) -> bool:
        s, j = self.where(i)
        return j >= self.images[s]


class UnitJobs(torch.utils.data.Dataset[Done]):
    """The units by number; item i is unit i encoded (in the process that asks)."""

    def __init__(self, units: Units, model: BuiltinModel) -> None:
        self.units, self.model = units, model
        self.encoder: Encoder | None = None  # made in the process that encodes
        # the last shard's number, captions and their chunks (`caption_chunks`)
        self._chunks: tuple[int, list[str], list[list[int]]] = (-1, [], [])

    def __len__(self) -> int:
        return len(self.units)

    def __getitem__(self, i: int) -> Done:
        if self.encoder is None:
            self.encoder = Encoder(self.model, torch.device("cpu"))
        u, stages = self.units, Stages()
        s, j = u.where(i)
        _, a, b = u.missing[s]
        if j >= u.images[s]:  # a chunk of the shard's captions
            if self._chunks[0] != s:
                texts = shard_captions(u.plan[a:b])
                self._chunks = (s, texts, caption_chunks(texts, u.batch_size)[1])
            _, texts, chunks = self._chunks
            with stages("encode_texts"):
                vecs = self.encoder.texts([texts[k] for k in chunks[j - u.images[s]]])
            return i, [], vecs, None, stages.seconds
        positions = shard_batches(u.plan, a, b, u.batch_size)[j]
        with stages("decode"):
            size = self.encoder.image_size
            batch = DecodedBatch.collate([decode(u.plan[p], size) for p in positions])
        vec, tok = encode_images(self.encoder, batch.items, batch.pixels, stages)
        return i, batch.items, vec, tok, stages.seconds


def _same(x: Any) -> Any:
    return x


def _one_thread() -> Any:
    """A context that runs torch on one intra-op thread (workers=0, this process)."""

    class OneThread:
        def __enter__(self) -> None:
            self.threads = torch.get_num_threads()
            torch.set_num_threads(1)

        def __exit__(self, *exc: object) -> None:
            torch.set_num_threads(self.threads)

    return OneThread()


def encoded_units(jobs: UnitJobs, workers: int) -> Iterator[Done]:
    """The units, encoded in `workers` processes (one torch thread each; DataLoader workers
    set that), never more than there are units, or here on one thread when there is one
    unit or no worker, in order."""
    workers = min(workers, len(jobs))
    if workers <= 1:
        with _one_thread():
            for i in range(len(jobs)):
                yield jobs[i]
        return
    loader = torch.utils.data.DataLoader(
        jobs,
        batch_size=None,
        num_workers=workers,
        collate_fn=_same,
        prefetch_factor=2,
        persistent_workers=False,
        worker_init_fn=let_go,  # the --out lock is the build's, not its workers'
    )
    yield from loader


def encode_cpu_shards(
    plan: Sequence[PlanItem],
    missing: list[tuple[int, int, int]],
    shard_dir: Path,
    model: BuiltinModel,
    batch_size: int,
    workers: int,
    progress: bool,
    on_shard: Any,
    stages: Stages,
) -> None:
    """Encode the `missing` shards on the CPU in `workers` processes, write each in order.
    Stage times are the workers' summed: with several workers they exceed the wall time."""
    units = Units.of(plan, missing, batch_size)
    here = Encoder(model, torch.device("cpu"))  # a ShardBuilder's; the workers did the encoding
    done = encoded_units(UnitJobs(units, model), workers)
    with EncodeProgress(sum(b - a for _, a, b in missing), progress) as bar:
        for s, (k, a, b) in enumerate(missing):
            shard = ShardBuilder(plan[a:b], here, batch_size, stages)
            chunks: list[np.ndarray] = []
            for _ in range(units.counts[s]):
                i, items, vec, tok, seconds = next(done)
                assert units.where(i)[0] == s
                for name, secs in seconds.items():
                    stages.add(name, secs)
                if units.is_captions(i):
                    assert vec is not None
                    chunks.append(vec)
                else:
                    shard.add_encoded(items, vec, tok)
            if chunks:
                order, _ = caption_chunks(shard_captions(plan[a:b]), batch_size)
                texts = in_order(order, chunks)
            else:
                texts = np.zeros((0, model.dim), np.float32)
            arrays = shard.finish(model.dim, model.token_shape, texts)
            write_shard(shard_dir, k, arrays, on_shard, stages)
            bar.update(b - a)
