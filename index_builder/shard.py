"""One shard: its encoded batches and captions put together (`ShardBuilder`), and its file:
the arrays as consecutive .npy records, read back field by field."""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from index_builder.decode import CaptionIds, Decoded, DecodedBatch, PlanItem, Tokenizer
from index_builder.stages import Stages
from store import indexio

TEXT_BATCH_MIN = 1024


class ImageEncoder(Protocol):
    """What a `ShardBuilder` calls: a batch of decoded images, then the shard's captions."""

    def images(self, decoded: Sequence[Any]) -> tuple[np.ndarray, np.ndarray]: ...

    def texts(self, texts: Sequence[str]) -> np.ndarray: ...


class IdsEncoder(ImageEncoder, Protocol):
    """An encoder that also takes captions already tokenised (`CaptionIds.padded` rows)."""

    tokenizer: Tokenizer

    def token_ids(self, ids: np.ndarray) -> np.ndarray: ...


SHARD_FIELDS = (
    "image_ok",
    "image_sha",
    "image_error",
    "image_vectors",
    "image_tokens",
    "text_vectors",
)


class ShardBuilder:
    """Collects one shard's encoded image batches, then encodes its captions (all of them,
    keeping those of the items whose image decoded or that have none)."""

    def __init__(
        self,
        items: Sequence[PlanItem],
        encoder: ImageEncoder,
        batch_size: int,
        stages: Stages | None = None,
    ) -> None:
        self.items = list(items)
        self.by_pos = {it.pos: it for it in self.items}
        self.encoder = encoder
        self.batch_size = batch_size
        self.stages = stages or Stages()
        self.decoded: list[Decoded] = []
        self.vecs: list[np.ndarray] = []
        self.toks: list[np.ndarray] = []
        # each item's captions as its batch brought them tokenised, by plan position
        self.caption_ids: dict[int, CaptionIds] = {}

    def add(self, batch: list[Decoded] | DecodedBatch) -> None:
        """Encode the decodable images of one batch (a `DecodedBatch` with none deferred), and
        keep its items' captions if it brings them tokenised (`DecodedBatch.captions`)."""
        good: Any
        if isinstance(batch, DecodedBatch):
            if batch.deferred:
                raise ValueError("decode the deferred JPEGs first (device_decode.resolve)")
            items, good = batch.items, batch.pixels
        else:
            items, good = batch, [d.pixels for d in batch if d.pixels is not None]
        if isinstance(batch, DecodedBatch) and batch.captions is not None:
            counts = [len(self.by_pos[d.pos].captions) for d in items]
            self.caption_ids.update(
                zip((d.pos for d in items), batch.captions.split(counts), strict=True)
            )
        self.add_encoded(items, *encode_images(self.encoder, items, good, self.stages))

    def add_encoded(
        self, items: Sequence[Decoded], vec: np.ndarray | None, tok: np.ndarray | None
    ) -> None:
        """A batch's outcomes, its decoded images already encoded (by a worker)."""
        self.decoded.extend(items)
        if vec is not None and tok is not None:
            self.vecs.append(vec)
            self.toks.append(tok)

    def finish(
        self, dim: int, token_shape: tuple[int, int], text_vectors: np.ndarray | None = None
    ) -> dict[str, np.ndarray]:
        """The shard's arrays. Its captions are all encoded (`caption_chunks`), unless
        `text_vectors` holds them already (encoded elsewhere, as the CPU build's workers do);
        then those of items whose image did not decode are dropped. So a caption's vector
        never depends on another item's image failing, whoever encoded it."""
        texts = shard_captions(self.items)
        ok = {d.pos: not d.error for d in self.decoded}
        keep = [it.image is None or ok[it.pos] for it in self.items for _ in it.captions]
        if text_vectors is None:
            with self.stages("encode_texts"):
                text_vectors = self._texts(texts)
        if len(text_vectors) != len(texts):
            raise ValueError(f"{len(text_vectors)} caption vectors for {len(texts)} captions")
        return {
            "image_ok": np.array([not d.error for d in self.decoded], dtype=bool),
            "image_sha": np.array(
                [np.frombuffer(d.sha256, np.uint8) for d in self.decoded], dtype=np.uint8
            ).reshape(-1, 32),
            "image_error": np.array([d.error for d in self.decoded], dtype=np.str_),
            "image_vectors": (
                np.concatenate(self.vecs) if self.vecs else np.zeros((0, dim), np.float32)
            ),
            "image_tokens": (
                np.concatenate(self.toks).astype(np.float16)
                if self.toks
                else np.zeros((0, *token_shape), np.float16)
            ),
            "text_vectors": (
                text_vectors[np.array(keep, dtype=bool)]
                if any(keep)
                else np.zeros((0, dim), np.float32)
            ),
        }

    def _texts(self, texts: list[str]) -> np.ndarray:
        """The captions' vectors in order, encoded in large batches of similar length (less
        padding to compute; a caption's vector does not depend on its batch's padding)."""
        if not texts:
            return np.zeros((0, 0), np.float32)
        order, chunks = caption_chunks(texts, self.batch_size)
        if not self.caption_ids or not hasattr(self.encoder, "token_ids"):
            return in_order(order, [self.encoder.texts([texts[j] for j in c]) for c in chunks])
        encoder: IdsEncoder = self.encoder  # type: ignore[assignment]
        ids = self._tokenised(encoder.tokenizer)
        return in_order(order, [encoder.token_ids(ids.padded(c)) for c in chunks])

    def _tokenised(self, tokenizer: Tokenizer) -> CaptionIds:
        """Every caption of the shard, in item order, tokenised: as the batches brought them,
        those of items without an image (in no batch) tokenised here."""
        got = self.caption_ids
        return CaptionIds.joined(
            [
                got[it.pos] if it.pos in got else CaptionIds.of(it.captions, tokenizer)
                for it in self.items
            ]
        )


def encode_images(
    encoder: ImageEncoder, items: Sequence[Decoded], good: Any, stages: Stages
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """A batch's decoded images (`good`) encoded, (None, None) when none decoded; the seconds
    its images took to decode counted as `decode_busy`."""
    stages.add("decode_busy", sum(d.seconds for d in items))
    if good is None or not len(good):
        return None, None
    with stages("encode_images"):
        return encoder.images(good)


def shard_captions(items: Sequence[PlanItem]) -> list[str]:
    """Every caption of a shard's items, in item order: what the shard encodes."""
    return [c for it in items for c in it.captions]


def caption_step(batch_size: int) -> int:
    """Captions per chunk (`caption_chunks`): at least TEXT_BATCH_MIN."""
    return max(batch_size, TEXT_BATCH_MIN)


def caption_chunks(texts: Sequence[str], batch_size: int) -> tuple[list[int], list[list[int]]]:
    """A shard's captions as it encodes them: sorted by length (then position), cut into
    chunks of `caption_step(batch_size)`, each chunk the captions' places in `texts`; with
    the sort order (the chunks end to end), for `in_order`."""
    step = caption_step(batch_size)
    order = sorted(range(len(texts)), key=lambda i: (len(texts[i]), i))
    return order, [order[i : i + step] for i in range(0, len(order), step)]


def in_order(order: list[int], chunks: Sequence[np.ndarray]) -> np.ndarray:
    """The chunks' vectors (`caption_chunks`) back in the captions' own order."""
    vecs = np.concatenate(chunks)
    out = np.empty_like(vecs)
    out[order] = vecs
    return out


def shard_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    """A shard file: its arrays as consecutive .npy records (no zip, so no timestamps)."""
    buf = io.BytesIO()
    for name in SHARD_FIELDS:
        np.save(buf, arrays[name], allow_pickle=False)
    return buf.getvalue()


def shard_path(shard_dir: Path, k: int) -> Path:
    return shard_dir / f"shard-{k:06d}.npy"


def write_shard(
    shard_dir: Path,
    k: int,
    arrays: dict[str, np.ndarray],
    on_shard: Callable[[int, dict[str, np.ndarray]], None],
    stages: Stages,
) -> None:
    """Shard `k`'s file, written atomically, then `on_shard` (the build's check for unreadable
    images), both timed as the `shards` stage."""
    with stages("shards"):
        indexio.write_atomic(shard_path(shard_dir, k), shard_bytes(arrays))
        on_shard(k, arrays)


def shard_whole(path: Path) -> bool:
    """Whether the shard file at `path` holds its every record whole: each .npy header
    readable and its data all there, nothing after the last (headers read, data skipped: a
    resumed build checks every shard it keeps, so a file cut short or overwritten in its
    headers is encoded again rather than failing every later run's assembly)."""
    fmt = np.lib.format
    try:
        with path.open("rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            for _ in SHARD_FIELDS:
                version = fmt.read_magic(fh)
                if version not in ((1, 0), (2, 0)):
                    return False
                header = (
                    fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
                )
                shape, _, dtype = header(fh)
                if dtype.hasobject:
                    return False
                fh.seek(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize, os.SEEK_CUR)
                if fh.tell() > size:
                    return False
            return fh.tell() == size
    except (OSError, ValueError, TypeError):
        return False


def read_shard(path: Path, fields: Sequence[str] = SHARD_FIELDS) -> dict[str, np.ndarray]:
    """A shard's arrays (only `fields`; reading stops after the last one asked for)."""
    with path.open("rb") as fh:
        return _read_fields(fh, fields)


def read_shard_bytes(data: bytes, fields: Sequence[str] = SHARD_FIELDS) -> dict[str, np.ndarray]:
    return _read_fields(io.BytesIO(data), fields)


def _read_fields(fh: Any, fields: Sequence[str]) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for name in SHARD_FIELDS:
        if len(out) == len(fields):
            break
        arr = np.load(fh, allow_pickle=False)
        if name in fields:
            out[name] = arr
    return out
