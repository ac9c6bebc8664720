"""A version's manifest.json as a typed `Manifest`: read (`Manifest.read`) and written
(`Manifest.write`) here only, by the builder, the service and the tools alike.

The JSON keeps the shape every version on disk has; a version written before some key was
recorded reads with that field at its default (None, empty), and keys this code does not know
are kept in `extra` and written back unchanged.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from store.errors import IndexLoadError
from store.files import write_atomic

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

MANIFEST = "manifest.json"
FORMAT_VERSION = 1

_D = TypeVar("_D", bound="DataclassInstance")


def _object(obj: Any) -> dict[str, Any]:
    """`obj` if it is a JSON object, else a TypeError saying what it is."""
    if not isinstance(obj, dict):
        raise TypeError(f"expected a JSON object, found {type(obj).__name__}")
    return obj


def _load(cls: type[_D], obj: Any) -> _D:
    """A flat dataclass from its JSON object; keys it lacks take their defaults."""
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in _object(obj).items() if k in names})


@dataclass(frozen=True)
class ModelPart:
    """One model (the encoder, or the token source the re-ranker reads) as recorded."""

    name: str | None = None
    fingerprint: str | None = None
    dir: str | None = None  # a Hugging Face directory or DUET_MODEL_DIR; informative

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "fingerprint": self.fingerprint}
        if self.dir is not None:
            out["dir"] = self.dir
        return out


@dataclass(frozen=True)
class ManifestModel:
    """`model`: the models that built the version; the service checks `fingerprint`."""

    name: str | None = None
    fingerprint: str | None = None
    encoder: ModelPart | None = None  # None for a version built before the two were recorded
    reranker: ModelPart | None = None

    @classmethod
    def from_json(cls, obj: Any) -> ManifestModel:
        obj = _object(obj)
        parts = {k: _load(ModelPart, obj[k]) for k in ("encoder", "reranker") if k in obj}
        return cls(obj.get("name"), obj.get("fingerprint"), **parts)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "fingerprint": self.fingerprint}
        for key, part in (("encoder", self.encoder), ("reranker", self.reranker)):
            if part is not None:
                out[key] = part.to_json()
        return out

    def built_with(self) -> str:
        """` (encoder X from DIR, image tokens for Y from DIR)`; '' when neither is recorded."""
        parts = []
        for part, label in ((self.encoder, "encoder"), (self.reranker, "image tokens for")):
            if part is not None and part.fingerprint:
                where = f" from {part.dir}" if part.dir else ""
                parts.append(f"{label} {part.fingerprint}{where}")
        return f" ({', '.join(parts)})" if parts else ""


@dataclass(frozen=True)
class IndexStats:
    """`indexes.image` / `indexes.text`: one FAISS index as built and measured."""

    factory: str | None = None
    count: int = 0
    bytes_per_vector: float = 0.0
    recall_at_10: float = 0.0  # recall@10 against exact search
    recall_queries: int = 0
    search_params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Counts:
    images: int | None = None
    texts: int | None = None


@dataclass(frozen=True)
class ImageTokens:
    shape: list[int] = field(default_factory=list)
    dtype: str = "float16"


@dataclass(frozen=True)
class CorpusRecord:
    """`corpus_selection`: how the corpus file was read (`index_builder.corpus`)."""

    format: str = "manifest"  # or "karpathy", which records the other three
    dataset: str | None = None
    split: str | None = None  # comma-separated
    images_root: str | None = None

    def to_json(self) -> dict[str, Any]:
        if self.format != "karpathy":  # a root of its own only after an append from elsewhere
            return {
                "format": self.format,
                **({"images_root": self.images_root} if self.images_root else {}),
            }
        return asdict(self)


@dataclass(frozen=True)
class BuildSettings:
    """`build`: how the version was built, and how fast."""

    engine: str = "local"
    device: str = "cpu"
    autocast: str | None = None
    workers: int = 0
    batch_size: int = 0
    shard_size: int = 0
    factory_arg: str | None = None  # --factory as given (None: chosen by size)
    shards: int = 0
    resumed_shards: int = 0
    encoded_items: int = 0
    encode_seconds: float = 0.0
    items_per_s: float = 0.0
    # wall seconds per build stage (`index_builder.stages`); empty in older manifests
    stages: dict[str, float] = field(default_factory=dict)
    # the image decode that built its vectors (`models.images.DECODE`); 0 in older manifests
    decode: int = 0
    # where a CUDA build decoded its JPEGs (`--decode-jpeg`): "cpu", "gpu" or "gpu 0.5" (that
    # share on the GPU); None for a CPU build and in older manifests
    jpeg: str | None = None


@dataclass(frozen=True)
class BaseRecord:
    """`base`: the version an append / delete started from."""

    version: str | None = None
    appended: int = 0
    deleted: int = 0


# the fields read as one flat dataclass each (None when absent)
_NESTED = {"image_tokens": ImageTokens, "build": BuildSettings, "base": BaseRecord}
_TYPED = {*_NESTED, "model", "indexes", "counts", "corpus_selection", "extra"}


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """What was built, by which models, from what, how; the files' sha256s. The fields run in
    the order the builder has always written the keys."""

    format: int = FORMAT_VERSION
    version: str
    model: ManifestModel = field(default_factory=ManifestModel)
    dim: int | None = None
    metric: str = "inner_product"
    index_type: str | None = None
    indexes: dict[str, IndexStats] = field(default_factory=dict)
    counts: Counts = field(default_factory=Counts)
    image_tokens: ImageTokens | None = None
    content_hash: str | None = None
    corpus: str | None = None  # the corpus file, resolved (a --delete keeps its base's)
    corpus_selection: CorpusRecord | None = None
    built_at: str | None = None
    build_seconds: float = 0.0
    skipped: int = 0
    build: BuildSettings | None = None
    files: dict[str, str] = field(default_factory=dict)  # name -> sha256
    bytes_per_item: dict[str, float] = field(default_factory=dict)
    base: BaseRecord | None = None  # written only for an append / delete
    extra: dict[str, Any] = field(default_factory=dict)  # keys this code does not know

    @classmethod
    def read(cls, version: Path) -> Manifest:
        """A version's manifest.json, or IndexLoadError naming the file."""
        path = Path(version) / MANIFEST
        try:
            return cls.from_json(json.loads(path.read_text()))
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
            raise IndexLoadError(f"cannot read {path}: {exc}") from exc

    @classmethod
    def from_json(cls, obj: Any) -> Manifest:
        """A manifest from its JSON object (TypeError / KeyError / ValueError if malformed)."""
        obj = _object(obj)
        known = {f.name for f in fields(cls)}
        selection = obj.get("corpus_selection")
        nested: dict[str, Any] = {
            k: None if obj.get(k) is None else _load(sub, obj[k]) for k, sub in _NESTED.items()
        }
        return cls(
            **{k: v for k, v in obj.items() if k in known and k not in _TYPED},
            **nested,
            model=ManifestModel.from_json(obj.get("model") or {}),
            indexes={k: _load(IndexStats, v) for k, v in _object(obj.get("indexes") or {}).items()},
            counts=_load(Counts, obj.get("counts") or {}),
            corpus_selection=None if selection is None else _load(CorpusRecord, selection),
            extra={k: v for k, v in obj.items() if k not in known},
        )

    def to_json(self) -> dict[str, Any]:
        """The JSON object manifest.json holds."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        out.update({k: None if out[k] is None else asdict(out[k]) for k in _NESTED})
        out["model"] = self.model.to_json()
        out["indexes"] = {k: asdict(v) for k, v in self.indexes.items()}
        out["counts"] = asdict(self.counts)
        if self.corpus_selection is not None:
            out["corpus_selection"] = self.corpus_selection.to_json()
        if self.base is None:
            del out["base"]
        return {**out, **self.extra}

    def write(self, version: Path) -> None:
        """Write manifest.json into the version directory, atomically."""
        text = json.dumps(self.to_json(), indent=1) + "\n"
        write_atomic(Path(version) / MANIFEST, text.encode())
