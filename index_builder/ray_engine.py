"""`duet build --engine ray`: the encode step as a Ray Data pipeline.

One dataset row per missing shard; `map_batches` hands rows to a pool of encoding actors
(`ActorPoolStrategy(size=N)`, `num_gpus=1` each when the cluster has GPUs). An actor
decodes its shard's images, encodes them with the same batch boundaries and the same
`ShardBuilder` as the local engine, and returns the shard file's bytes; the driver writes each
shard (temp name, fsync, rename) as it arrives, so a killed Ray build resumes like a local one.

Cluster: `ray.init()` joins the cluster named by RAY_ADDRESS (e.g. `ray://head:10001` or
`auto` on a cluster node) and starts a local instance when it is unset. Workers must see the
corpus images at the same paths (shared storage); the model's weights travel with the actors.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from index_builder.encode import (
    Encoder,
    PlanItem,
    ShardBuilder,
    decode,
    read_shard_bytes,
    shard_batches,
    shard_bytes,
    shard_path,
)
from index_builder.progress import EncodeProgress
from models.builtin import BuiltinModel
from models.errors import UserError
from store import indexio

log = logging.getLogger("duet.build.ray")


class RayUnavailableError(UserError, RuntimeError):
    """Ray is not installed."""


class ShardEncoder:
    """A Ray actor: holds the model on its device, turns shard specs into shard bytes."""

    def __init__(self, parts: tuple[Any, Any, str], device: str, batch_size: int) -> None:
        net, tokenizer, fingerprint = parts
        self.model = BuiltinModel(net, tokenizer, fingerprint)
        self.encoder = Encoder(self.model, torch.device(device))
        self.batch_size = batch_size

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list[Any]]:
        shards: list[int] = []
        payloads: list[bytes] = []
        for k, spec in zip(batch["shard"].tolist(), batch["spec"].tolist(), strict=True):
            plan = [PlanItem(**{**d, "captions": tuple(d["captions"])}) for d in json.loads(spec)]
            first = plan[0].pos if plan else 0
            builder = ShardBuilder(plan, self.encoder, self.batch_size)
            for positions in shard_batches(plan, 0, len(plan), self.batch_size):
                builder.add([decode(plan[p - first], self.encoder.image_size) for p in positions])
            arrays = builder.finish(self.model.dim, self.model.token_shape)
            shards.append(int(k))
            payloads.append(shard_bytes(arrays))
        return {"shard": shards, "data": payloads}


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:  # pragma: no cover - the [ray] extra is in dev
        raise RayUnavailableError(
            "--engine ray needs Ray: pip install 'duet[ray]' (or use --engine local)"
        ) from exc
    return ray


def encode_ray(
    plan: Sequence[PlanItem],
    missing: list[tuple[int, int, int]],
    shard_dir: Path,
    model: BuiltinModel,
    dev: torch.device,
    batch_size: int,
    actors: int | None,
    progress: bool,
    on_shard: Callable[[int, dict[str, np.ndarray]], None],
) -> None:
    """Encode the `missing` shards (k, start, stop) of `plan` on Ray; write them to shard_dir."""
    ray = _ray()
    if not ray.is_initialized():
        ray.init(log_to_driver=False)  # RAY_ADDRESS, when set, names the cluster to join
    gpus = int(ray.cluster_resources().get("GPU", 0)) if dev.type == "cuda" else 0
    cpus = int(ray.cluster_resources().get("CPU", 1))
    if actors is None:
        actors = gpus if gpus else max(1, cpus // 2)
    actors = max(1, min(actors, len(missing)))
    rows = [{"shard": k, "spec": json.dumps([asdict(p) for p in plan[a:b]])} for k, a, b in missing]
    log.info(
        "ray: %d shards on %d actor(s) (%s)",
        len(rows),
        actors,
        f"{gpus} GPU(s)" if gpus else f"{cpus} CPU(s)",
    )
    ds = ray.data.from_items(rows, override_num_blocks=len(rows)).map_batches(
        ShardEncoder,
        batch_size=1,
        batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(size=actors),
        num_gpus=1 if gpus else 0,
        num_cpus=0 if gpus else max(1, cpus // actors),
        fn_constructor_kwargs={
            "parts": (model.model, model.tokenizer, model.fingerprint),
            "device": dev.type,
            "batch_size": batch_size,
        },
    )
    sizes = {k: b - a for k, a, b in missing}
    with EncodeProgress(sum(sizes.values()), progress, "encoding (ray)") as bar:
        for row in ds.iter_rows():
            k = int(row["shard"])
            data = bytes(row["data"])
            indexio.write_atomic(shard_path(shard_dir, k), data)
            bar.update(sizes[k])
            on_shard(k, read_shard_bytes(data, ("image_error",)))
