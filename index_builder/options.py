"""What a build is asked (`BuildOptions`: `build`'s keyword arguments, `duet build --help`)
and what it reports (`BuildReport`, for the CLI to print)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from store.manifest import Manifest

DEFAULT_SHARD_SIZE = 1024

# images per forward pass for the builtin model: a GPU launches a quarter of 64's kernels, and
# on the CPU batches of 256 took about 15 % fewer CPU seconds (docs/scale.md)
BUILTIN_BATCH = 256


def default_batch(model: object) -> int:
    """`--batch-size` left out: 256 for duet's builtin model (a `BuiltinModel`, or `Models`
    whose encoder and token source it is), 64 for Hugging Face models."""
    from models.builtin import BuiltinModel

    builtin = isinstance(model, BuiltinModel) or getattr(model, "joint", None) is not None
    return BUILTIN_BATCH if builtin else 64


@dataclass
class BuildReport:
    """What a build produced, for the CLI to print."""

    version: str
    path: Path
    images: int
    texts: int
    seconds: float
    manifest: Manifest
    skipped: list[str] = field(default_factory=list)
    # corpus items this run encoded into the version (not resumed from shards, nor skipped)
    encoded: int = 0
    resumed_shards: int = 0
    shards: int = 0
    encode_seconds: float = 0.0
    items_per_s: float = 0.0
    stages: dict[str, float] = field(default_factory=dict)  # `index_builder.stages`
    unread: str | None = None  # the model reads little of the captions (`vocabulary`)


@dataclass(frozen=True)
class BuildOptions:
    """How a build runs (`build`'s keyword arguments; `duet build --help`)."""

    batch_size: int = 64
    skip_bad: bool = False
    progress: bool = True
    factory: str | None = None
    shard_size: int = DEFAULT_SHARD_SIZE
    workers: int | None = None
    device: str = "auto"
    engine: str = "local"
    append: bool = False
    delete: Path | None = None
    ray_actors: int | None = None
    split: str | None = None
    images_root: Path | None = None
    # where a CUDA build decodes JPEGs: "cpu" (the decode workers, as the service decodes an
    # upload), "gpu" (nvJPEG through torchvision, when installed) or a share such as "0.4"
    # (that share on the GPU, the rest in the workers; `device_decode.gpu_share_of`)
    decode_jpeg: str = "cpu"
