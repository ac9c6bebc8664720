"""The encode step on CPU: whole shards in parallel, one per worker process.

The model is small, and its forward passes do not keep two cores busy (torch's intra-op
threads wait on each other at every small op, and worse on a busy machine), so cores are
used across shards instead: each worker (a DataLoader process, forked with the model) reads,
decodes, resizes and encodes one shard's images and captions on one thread, and hands the
shard's arrays back in order; this process writes them. `workers=0` does the same here.

Every shard is encoded on one torch thread whatever the number of workers, so its bytes do
not depend on how many workers made it, and a build resumed with other --workers writes the
same files (`IDENTICAL_FILES`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from index_builder.decode import DecodedBatch, PlanItem, decode, shard_batches
from index_builder.encode import Encoder, ShardBuilder, shard_bytes, shard_path
from index_builder.progress import EncodeProgress
from index_builder.stages import Stages
from models.builtin import BuiltinModel
from store import indexio

Encoded = tuple[int, dict[str, np.ndarray], dict[str, float]]  # shard, arrays, stage seconds


class ShardJobs(torch.utils.data.Dataset[Encoded]):
    """The missing shards by number in the list; item i is shard `missing[i]` encoded."""

    def __init__(
        self,
        plan: Sequence[PlanItem],
        missing: list[tuple[int, int, int]],
        model: BuiltinModel,
        batch_size: int,
    ) -> None:
        self.plan, self.missing, self.model, self.batch_size = plan, missing, model, batch_size
        self.encoder: Encoder | None = None  # made in the process that encodes

    def __len__(self) -> int:
        return len(self.missing)

    def __getitem__(self, i: int) -> Encoded:
        k, a, b = self.missing[i]
        if self.encoder is None:
            self.encoder = Encoder(self.model, torch.device("cpu"))
        stages = Stages()
        shard = ShardBuilder(self.plan[a:b], self.encoder, self.batch_size, stages)
        size = self.encoder.image_size
        for positions in shard_batches(self.plan, a, b, self.batch_size):
            with stages("decode"):
                batch = DecodedBatch.collate([decode(self.plan[p], size) for p in positions])
            shard.add(batch)
        arrays = shard.finish(self.model.dim, self.model.token_shape)
        return k, arrays, stages.seconds


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


def encoded_shards(jobs: ShardJobs, workers: int) -> Iterator[Encoded]:
    """The shards, encoded in `workers` processes (one torch thread each; DataLoader workers
    set that), never more than there are shards, or here on one thread when there is one
    shard or no worker, in order."""
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
        prefetch_factor=1,
        persistent_workers=False,
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
    jobs = ShardJobs(plan, missing, model, batch_size)
    with EncodeProgress(sum(b - a for _, a, b in missing), progress) as bar:
        for (k, a, b), (got, arrays, seconds) in zip(
            missing, encoded_shards(jobs, workers), strict=True
        ):
            assert got == k
            for name, secs in seconds.items():
                stages.add(name, secs)
            with stages("shards"):
                indexio.write_atomic(shard_path(shard_dir, k), shard_bytes(arrays))
                on_shard(k, arrays)
            bar.update(b - a)
