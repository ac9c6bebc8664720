"""A local Hugging Face checkpoint as duet loads it: its kind and fingerprint, the checks that
it is one duet can use, the model and processor, and its tokenizer's bounded calls
(`models.hf` builds the encoder and the re-ranker on these). Nothing is downloaded: every
load is `from_pretrained(directory, local_files_only=True)`."""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from models.builtin import ModelLoadError

DUAL_ENCODER_TYPES = ("clip", "siglip")
RERANKER_TYPES = ("blip",)
WEIGHT_SUFFIXES = (".safetensors", ".bin")


def spelled(kind: str) -> str:
    """A model type as its makers write it ("SigLIP", not "SIGLIP")."""
    return {"clip": "CLIP", "siglip": "SigLIP", "blip": "BLIP"}.get(kind, kind.upper())


def model_type(directory: Path) -> str:
    """`model_type` from a checkpoint's config.json ('' when there is none)."""
    try:
        return str(json.loads((Path(directory) / "config.json").read_text()).get("model_type", ""))
    except (OSError, ValueError):
        return ""


def fingerprint(kind: str, directory: Path) -> str:
    """`hf-<kind>:<first 16 hex of sha256 over the weight files>`: which weights built an index."""
    h = hashlib.sha256()
    files = sorted(p for p in Path(directory).iterdir() if p.suffix in WEIGHT_SUFFIXES)
    if not files:
        raise ModelLoadError(f"{directory} holds no weights (*.safetensors or *.bin)")
    for p in files:
        h.update(p.name.encode())
        with p.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return f"hf-{kind}:{h.hexdigest()[:16]}"


# what a checkpoint's tokenizer is saved as (one of them): without any, transformers builds an
# empty tokenizer without a word, and every text became the same vector
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "vocab.txt", "spiece.model")


def _checked_kind(d: Path, kind: str, role: str) -> None:
    """ModelLoadError for a directory of the right model type that is no checkpoint duet can
    use: no tokenizer files, or a BLIP that is not the image-text-matching model (a
    captioning checkpoint loaded with its matching head and text encoder random)."""
    if not any((d / name).is_file() for name in TOKENIZER_FILES):
        raise ModelLoadError(
            f"{d} has no tokenizer files ({', '.join(TOKENIZER_FILES)}: one of them); the "
            f"{role} needs the checkpoint's tokenizer saved beside its weights"
        )
    try:
        kinds = json.loads((d / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError):
        kinds = []
    if kind == "blip" and kinds and "BlipForImageTextRetrieval" not in kinds:
        raise ModelLoadError(
            f"{d} is a BLIP checkpoint for {', '.join(kinds)}, not image-text matching "
            "(BlipForImageTextRetrieval, such as Salesforce/blip-itm-base-coco): its matching "
            "head would be random"
        )


def _load(
    directory: Path, allowed: Sequence[str], role: str, device: torch.device
) -> tuple[Any, Any, str]:
    """(model, processor, model_type) from a local directory, on `device`, or a ModelLoadError
    that says why."""
    d = Path(directory)
    kind = model_type(d)
    if kind not in allowed:
        found = f"model_type {kind!r}" if kind else "no readable config.json"
        raise ModelLoadError(
            f"{d} is not a {' or '.join(spelled(a) for a in allowed)} checkpoint "
            f"({found}); the {role} needs a local Hugging Face directory with "
            "config.json, weights, tokenizer and processor files"
        )
    _checked_kind(d, kind, role)
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - transformers is a dependency
        raise ModelLoadError("Hugging Face checkpoints need `pip install transformers`") from exc
    transformers.utils.logging.disable_progress_bar()  # no "Loading weights" bars in logs
    try:
        processor = transformers.AutoProcessor.from_pretrained(d, local_files_only=True)
        cls = transformers.BlipForImageTextRetrieval if kind == "blip" else transformers.AutoModel
        model = cls.from_pretrained(d, local_files_only=True).eval().to(device)
        if device.type == "cpu" and model.dtype in (torch.float16, torch.bfloat16):
            model = model.float()  # half-precision checkpoints: CPU kernels want fp32
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot load the {kind} checkpoint in {d}: {exc}") from exc
    return model, processor, kind


def _tokenize(
    tokenizer: Any, lock: threading.Lock, texts: Sequence[str], padding: bool | str, most: int
) -> Any:
    """One tokenizer call at a time: the service encodes queries from several threads, and a
    Rust-backed tokenizer re-sets its padding / truncation state on every call, which PyO3
    refuses concurrently ("RuntimeError: Already borrowed", huggingface/tokenizers#537). At
    most `most` tokens (`max_tokens`): a tokenizer saved without `model_max_length` cut at
    none, and a long text failed in the model ("Sequence length must be less than ...")."""
    with lock:
        return tokenizer(
            list(texts), padding=padding, truncation=True, max_length=most, return_tensors="pt"
        )


def max_tokens(tokenizer: Any, text_config: Any) -> int:
    """The tokens a checkpoint's text model reads: its tokenizer's limit where it has one
    (transformers says 10**30 for none), at most the model's position embeddings."""
    limit = int(getattr(text_config, "max_position_embeddings", 0) or 512)
    said = getattr(tokenizer, "model_max_length", None)
    return min(int(said), limit) if isinstance(said, int) and said > 0 else limit


def too_long(tokenizer: Any, lock: threading.Lock, text: str, most: int) -> str | None:
    """Why the model would not read all of `text`, or None: a query is refused (422) rather
    than cut short unseen, as with the builtin model."""
    with lock:
        n = len(tokenizer(text, truncation=False)["input_ids"])
    if n <= most:
        return None
    return (
        f"the model reads at most {most} tokens and this query has {n}: shorten it (the "
        "rest would not be read)"
    )
