"""Loading and running duet's own joint model as a bi-encoder and a cross-encoder."""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from safetensors.torch import load_file

from models.caption_states import CaptionStates
from models.device import resolve_device
from models.errors import UserError
from models.images import side_for
from models.inference import CrossEncoderRuntime, Precision, PrecisionChoice
from models.joint import JointConfig, JointModel
from models.masked_cross import DTYPES, MaskedCrossEncoder
from models.shipped import DEFAULT_WEIGHTS, save_weights
from models.tokenizer import WordTokenizer, unique_texts

WEIGHTS_FILE = "model.safetensors"
# `score_pairs` runs the runtime (`models.inference`: one call per sentence length, no
# padding) unless the pairs average fewer than this per length, as an image query's 50
# candidate captions do (8-9 lengths): then one padded, masked call. On the 2-core CPU, 50
# captions of a real upload: 32.6 ms by lengths, 27.9 in one call; with the service's
# oneDNN cache of 8 primitives (duet serve), 50.2 against 31.2. A text batch of 8 sentences
# x 50 images (4 lengths, 100 pairs each) stays with the runtime: 127 against 165 ms.
FEW_PAIRS_PER_LENGTH = 16

NAME = "duet-joint"


class ModelLoadError(UserError, RuntimeError):
    """The model directory is missing a file or holds something unreadable."""


def pixel_bytes(images: Sequence[Image.Image], size: int) -> torch.Tensor:
    """PIL images -> uint8 tensor (B, 3, size, size), resized (bilinear) where needed."""
    arrs = []
    for img in images:
        rgb = img if img.mode == "RGB" else img.convert("RGB")  # not copied when it is
        if rgb.size != (size, size):
            rgb = rgb.resize((size, size), Image.Resampling.BILINEAR)
        arrs.append(np.asarray(rgb, dtype=np.uint8))
    return torch.from_numpy(np.stack(arrs)).permute(0, 3, 1, 2)


def pixels(images: Sequence[Image.Image], size: int) -> torch.Tensor:
    """PIL images -> float tensor (B, 3, size, size) in [0, 1]."""
    return pixel_bytes(images, size).float() / 255.0


def _autocast(device: torch.device, dtype: torch.dtype | None) -> AbstractContextManager[Any]:
    return nullcontext() if dtype is None else torch.autocast(device_type=device.type, dtype=dtype)


# The one encode path: the service's queries (`BuiltinModel`) and the builder's index
# (`index_builder.encode.Encoder`, on any device, under autocast there) both call these, so an
# index's vectors and a query's are the same function of their input.
@torch.inference_mode()
def encode_pixels(
    net: JointModel, x: torch.Tensor, dtype: torch.dtype | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Pixels (B, 3, S, S) in [0, 1] on `net`'s device -> ((B, dim) float32 unit vectors,
    (B, T, d) float16 image states); under autocast to `dtype` when given, the vectors
    re-normalised in float32 after it."""
    with _autocast(x.device, dtype):
        toks = net.image_tokens(x)
        vec = net.embed_images(toks)
    return F.normalize(vec.float(), dim=-1).cpu().numpy(), toks.half().cpu().numpy()


@torch.inference_mode()
def encode_ids(
    net: JointModel, ids: torch.Tensor, pad: torch.Tensor, dtype: torch.dtype | None = None
) -> np.ndarray:
    """Token ids and padding mask (`WordTokenizer.batch`) on `net`'s device -> (n, dim)
    float32 unit vectors; under autocast to `dtype` when given."""
    with _autocast(ids.device, dtype):
        vec = net.embed_texts(net.text_tokens(ids, pad), pad)
    return F.normalize(vec.float(), dim=-1).cpu().numpy()


def save_model(model: JointModel, tokenizer: WordTokenizer, out: Path) -> None:
    """Write weights (safetensors), config and vocabulary into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_weights(state, out / WEIGHTS_FILE)
    (out / "config.json").write_text(json.dumps(model.cfg.to_json(), indent=1) + "\n")
    tokenizer.save(out / "vocab.json")


class BuiltinModel:
    """duet's joint model behind the bi-encoder and re-ranker protocols.

    Thread-safe for concurrent callers: torch modules in eval mode hold no
    per-call state, and inference runs under `torch.inference_mode`. On a CUDA device the
    weights live on the GPU; inputs go there and results come back as numpy arrays.
    """

    def __init__(
        self,
        model: JointModel,
        tokenizer: WordTokenizer,
        fingerprint: str,
        device: torch.device | None = None,
        precision: Precision = "fp32",
    ) -> None:
        self.device = device or torch.device("cpu")
        self.model = model.to(self.device).eval().serve_kernels()  # models.fastpath
        self.cross = CrossEncoderRuntime(self.model, precision)
        # score_pairs' calls with few pairs per sentence length (the device step's encoder)
        self.masked = MaskedCrossEncoder(self.model, DTYPES[precision])
        self.caption_states = CaptionStates(self._tower)  # score_captions' kept states
        self.tokenizer = tokenizer
        self.fingerprint = fingerprint
        self.name = NAME
        self.dim = model.cfg.embed_dim
        self.token_shape = (model.cfg.grid * model.cfg.grid, model.cfg.d_model)
        # the side a picture keeps when decoded for this model (`models.images.open_rgb`)
        self.decode_side = side_for(model.cfg.image_size)
        self._lock = threading.Lock()

    @classmethod
    def load(
        cls,
        directory: Path | None = None,
        device: str = "cpu",
        precision: PrecisionChoice | None = None,
    ) -> BuiltinModel:
        """Load from a directory holding model.safetensors, config.json and vocab.json, onto
        `device` (auto, cpu or cuda); the cross-encoder runs in `precision` (None or auto: fp16
        on a GPU, fp32 on the CPU)."""
        d = Path(directory) if directory is not None else DEFAULT_WEIGHTS
        try:
            cfg = JointConfig(**json.loads((d / "config.json").read_text()))
            tok = WordTokenizer.load(d / "vocab.json")
            weights = (d / WEIGHTS_FILE).read_bytes()
            state = load_file(str(d / WEIGHTS_FILE))
        except (OSError, ValueError, TypeError) as exc:
            raise ModelLoadError(
                f"cannot load duet's model from {d}: {exc}. Run `duet train --out {d}` to make one."
            ) from exc
        model = JointModel(cfg)
        model.load_state_dict(state)
        digest = hashlib.sha256(weights).hexdigest()[:16]
        dev = resolve_device(device)
        prec: Precision = (
            ("fp16" if dev.type == "cuda" else "fp32")
            if precision in (None, "auto")
            else cast(Precision, precision)
        )
        return cls(model, tok, f"{NAME}:{digest}", dev, prec)

    def text_ids(self, text: str) -> list[int]:
        """The text's token ids (what the device step reads; `models.device_step`)."""
        return self.tokenizer.ids(text)

    def unknown_words(self, text: str) -> list[str]:
        """The words of `text` outside the vocabulary (each read as [UNK])."""
        return self.tokenizer.unknown_words(text)

    def too_long(self, text: str) -> str | None:
        """Why the model would not read all of `text` (`WordTokenizer.too_long`), or None."""
        return self.tokenizer.too_long(text)

    def content_words(self, text: str) -> list[str]:
        """The words of `text` the model knows that name something (not articles,
        prepositions or "and"): empty when it understood nothing of the text."""
        return self.tokenizer.content_words(text)

    def query_identity(self, text: str) -> str:
        """What this model reads of a text: its word tokenizer sees only its words, each alias
        read as its word (`WordTokenizer.reading`), so texts equal after it are encoded and
        re-ranked identically (the cache's key; "a and b" and "a with b" share an entry)."""
        return self.tokenizer.reading(text)

    # -- bi-encoder -----------------------------------------------------------
    def encode_texts(self, texts: Sequence[str]) -> np.ndarray:
        """Texts -> (n, dim) float32, L2-normalised."""
        return encode_ids(self.model, *self._batch(texts))

    def encode_images(self, images: Sequence[Image.Image]) -> tuple[np.ndarray, np.ndarray]:
        """Images -> ((n, dim) float32 L2-normalised vectors, (n, T, d) float16 image states)."""
        return encode_pixels(self.model, pixels(images, self.model.cfg.image_size).to(self.device))

    @torch.inference_mode()
    def text_token_features(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """Texts -> (text states (n, L, d) float32, mask (n, L) True for real tokens): the
        word side of late interaction and HAN, in the same space as the stored image states."""
        ids, pad = self._batch(texts)
        toks = self.model.text_tokens(ids, pad)
        return toks.float().cpu().numpy(), (~pad).cpu().numpy()

    # -- cross-encoder --------------------------------------------------------
    @torch.inference_mode()
    def score_pairs(self, texts: Sequence[str], image_tokens: np.ndarray) -> np.ndarray:
        """ITM logits (n,) for n (text, image-tokens) pairs; higher means a better match.
        Each distinct sentence's text states are computed once (`models.inference`)."""
        if len(texts) == 0:
            return np.zeros(0, dtype=np.float32)
        unique, rows = unique_texts(texts)
        states, real = self._tower(unique)
        return self._logits(states, real, rows, image_tokens)

    @torch.inference_mode()
    def score_captions(self, texts: Sequence[str], image_tokens: np.ndarray) -> np.ndarray:
        """`score_pairs` for an image query's candidates, the index's own captions: their
        text states are kept between requests (`models.caption_states`), the same logits."""
        if len(texts) == 0:
            return np.zeros(0, dtype=np.float32)
        unique, rows = unique_texts(texts)
        states, real = self.caption_states.states(unique)
        return self._logits(states, real, rows, image_tokens)

    def _tower(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Texts -> their text states (n, L, d) and True at real positions (n, L)."""
        ids, pad = self._batch(texts)
        return self.model.text_tokens(ids, pad), ~pad

    def _logits(
        self, states: torch.Tensor, real: torch.Tensor, rows: list[int], image_tokens: np.ndarray
    ) -> np.ndarray:
        """Pair i: sentence `rows[i]` (its states and real positions) with `image_tokens[i]`."""
        lengths = real.sum(dim=1).tolist()
        img = torch.from_numpy(np.array(image_tokens, dtype=np.float32)).to(self.device)
        if len(rows) < FEW_PAIRS_PER_LENGTH * len(set(lengths)):  # an image query's captions
            return self.masked.logits(states, real, torch.tensor(rows), img).cpu().numpy()
        return self.cross.logits(states, lengths, torch.tensor(rows), img).cpu().numpy()

    def _batch(self, texts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        ids, pad = self.tokenizer.batch(list(texts))
        return ids.to(self.device), pad.to(self.device)
