"""DUET_ENCODER + DUET_RERANKER -> the models that `duet serve`, `duet build` and `duet eval` run.

- encoder: `builtin` (duet's joint model from DUET_MODEL_DIR, else the shipped weights) or a
  local Hugging Face CLIP / SigLIP directory (`models.hf.HFDualEncoder`).
- reranker: `builtin` (the joint model's cross-encoder), `late` (late interaction over the
  joint model's tokens; with the builtin encoder only), `han` (the HAN head `duet train`
  saves beside the joint model's weights; with the builtin encoder only), `none` (no
  re-ranking), or a local BLIP image-text-matching directory (`models.hf.HFBlipReranker`).

`load_models` checks the choices (names, directories, checkpoint kinds, combinations) before
loading anything and returns one `Models`: the service's model in the `JointEncoder` shape.
Its image tokens are the ones its re-ranker reads, so that is what an index built with it
stores; its fingerprint names both parts (`Models.fingerprint`), so an index built with
other models is refused. Nothing is downloaded."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from models import hf
from models.builtin import BuiltinModel, ModelLoadError
from models.han import HANReranker
from models.hf_load import DUAL_ENCODER_TYPES, RERANKER_TYPES, model_type, spelled
from models.inference import PrecisionChoice
from models.protocols import BiEncoder, PairReranker, TokenEncoder
from models.rerankers import NONE, Menu, menu
from models.shipped import DEFAULT_WEIGHTS

BUILTIN = "builtin"
# `ce` is duet's own cross-encoder, as a request names it; `builtin` is its older name
RERANKER_NAMES = ("ce", "builtin", "late", "han", "none")
ENCODER_LABEL = "DUET_ENCODER"
RERANKER_LABEL = "DUET_RERANKER"
ENCODER_CHOICES = "builtin or a local Hugging Face CLIP / SigLIP directory"
RERANKER_CHOICES = (
    "ce (or builtin), late, han, none or a local Hugging Face BLIP image-text-matching directory"
)


class ChoiceError(ModelLoadError):
    """A DUET_ENCODER / DUET_RERANKER value (or --encoder / --reranker) that cannot be used."""


@dataclass(frozen=True)
class Part:
    """One model as an index manifest records it."""

    name: str
    fingerprint: str
    directory: str | None = None  # a Hugging Face directory or DUET_MODEL_DIR; informative

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "fingerprint": self.fingerprint}
        if self.directory is not None:
            out["dir"] = self.directory
        return out


NO_TOKENS = Part("none", "none")


class Models:
    """The configured encoder and re-ranker behind the service's `JointEncoder` protocol.

    `encode_images` returns the encoder's vectors with the image tokens the re-ranker reads
    (the builtin model's patch tokens, the BLIP vision encoder's output, or zero-width tokens
    when nothing re-ranks); `score_pairs` is the configured cross-encoder (the `ce` option).
    """

    def __init__(
        self,
        encoder: BiEncoder,
        encoder_part: Part,
        *,
        cross: PairReranker | None,
        tokens: Callable[[Sequence[Image.Image]], np.ndarray] | None,
        token_part: Part,
        token_shape: tuple[int, int],
        default_reranker: str,
        why: dict[str, str],
        joint: BuiltinModel | None,
        late: TokenEncoder | None,
        han: HANReranker | None = None,
    ) -> None:
        self.encoder = encoder
        self.encoder_part = encoder_part
        self.cross = cross
        self._tokens = tokens
        self.token_part = token_part
        self.token_shape = token_shape
        # what `models.rerankers.menu` reads: the configured default request re-ranker and
        # why the configuration rules some out (the registry finds the rest by building them)
        self.default_reranker = default_reranker
        self.why = why
        self.joint = joint  # the builtin model when it is both encoder and token source
        self._late = late
        self.han = han  # HAN's head over the joint model's words and stored tokens
        self.dim = encoder.dim
        same = token_part.fingerprint == encoder_part.fingerprint
        self.name = encoder_part.name if same else f"{encoder_part.name}+{token_part.name}"
        # what an index built with these models records and the service checks: the encoder's
        # fingerprint, joined with the token source's when that is another model
        self.fingerprint = encoder_part.fingerprint
        if not same:
            self.fingerprint += f"+{token_part.fingerprint}"
        self.device = getattr(encoder, "device", "cpu")
        # what else decides a score besides the weights: the device kind and the builtin
        # cross-encoder's precision (fp16 on a GPU gives other scores than fp32 on a CPU), so
        # replicas that differ in either never answer from each other's cache entries
        precision = getattr(getattr(cross, "cross", None), "precision", None)
        self.numerics = torch.device(str(self.device)).type + (f"/{precision}" if precision else "")

    def parts(self) -> dict[str, Any]:
        """The manifest's `model` entry."""
        return {
            "name": self.name,
            "fingerprint": self.fingerprint,
            "encoder": self.encoder_part.as_json(),
            "reranker": self.token_part.as_json(),
        }

    @property
    def menu(self) -> Menu:
        """The request re-rankers these models offer (`models.rerankers.menu`)."""
        return menu(self)

    @property
    def has_text_tokens(self) -> bool:
        """Whether `text_token_features` works (what late interaction reads)."""
        return self._late is not None

    def encode_texts(self, texts: Sequence[str]) -> np.ndarray:
        return self.encoder.encode_texts(texts)

    def unknown_words(self, text: str) -> list[str]:  # read as [UNK]
        return list(self._words("unknown_words", text) or [])

    def too_long(self, text: str) -> str | None:  # `WordTokenizer.too_long`
        return self._words("too_long", text)

    def content_words(self, text: str) -> list[str] | None:  # None: it cannot tell
        return self._words("content_words", text)

    def _words(self, method: str, text: str) -> Any:
        """The builtin encoder's word tokenizer's view of a query (its unknown words, why it
        is too long, its content words); a Hugging Face sub-word tokenizer reads every word
        and cuts a text at its own limit, so None there."""
        said = getattr(self.encoder, method, None)
        return said(text) if callable(said) else None

    def query_identity(self, text: str) -> str:
        """What the cache keys a text query by: its words (aliases read as their word) when
        every model that reads the text is the builtin one (its word tokenizer sees nothing
        else), else the text exactly as given (a sub-word tokenizer tells "c++" from "c#" and
        reads any script)."""
        return self.joint.query_identity(text) if self.joint is not None else text

    def encode_images(self, images: Sequence[Image.Image]) -> tuple[np.ndarray, np.ndarray]:
        """(encoder vectors (n, dim) float32, the re-ranker's image tokens float16)."""
        if self.joint is not None:
            return self.joint.encode_images(images)
        vecs, _ = self.encoder.encode_images(images)
        return vecs, self.image_tokens(images)

    def image_tokens(self, images: Sequence[Image.Image]) -> np.ndarray:
        """What the builder stores per image: the tokens the configured re-ranker reads."""
        if self.joint is not None:
            return self.joint.encode_images(images)[1]
        if self._tokens is None:
            return np.zeros((len(images), *self.token_shape), np.float16)
        return self._tokens(images)

    def score_pairs(self, texts: Sequence[str], image_tokens: np.ndarray) -> np.ndarray:
        if self.cross is None:
            raise RuntimeError("no cross-encoder is configured (DUET_RERANKER=none)")
        return self.cross.score_pairs(texts, image_tokens)

    def score_captions(self, texts: Sequence[str], image_tokens: np.ndarray) -> np.ndarray:
        kept = getattr(self.cross, "score_captions", None)  # the builtin model keeps states
        return kept(texts, image_tokens) if kept else self.score_pairs(texts, image_tokens)

    def text_token_features(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        if self._late is None:
            raise RuntimeError("late interaction is not available with these models")
        return self._late.text_token_features(texts)


def manifest_model(model: object) -> dict[str, Any]:
    """The manifest's `model` entry for a `Models` or a bare model (encoder = token source)."""
    if isinstance(model, Models):
        return model.parts()
    name, fp = str(getattr(model, "name")), str(getattr(model, "fingerprint"))  # noqa: B009
    return {
        "name": name,
        "fingerprint": fp,
        "encoder": {"name": name, "fingerprint": fp},
        "reranker": {"name": name, "fingerprint": fp},
    }


def _hf_dir(value: str, label: str, allowed: Sequence[str], choices: str) -> Path:
    """A Hugging Face checkpoint directory of one of the `allowed` kinds, or a ChoiceError."""
    path = Path(value).expanduser()
    if not path.is_dir():
        raise ChoiceError(f"{label}={value}: no such directory; {label} is {choices}")
    kind = model_type(path)
    if kind not in allowed:
        found = (
            f"its config.json says model_type {kind!r}"
            if kind
            else "it has no readable config.json"
        )
        raise ChoiceError(
            f"{label}={value}: not a {' or '.join(spelled(a) for a in allowed)} "
            f"checkpoint ({found}); {label} is {choices}"
        )
    return path


def check_choices(
    encoder: str, reranker: str, *, labels: tuple[str, str] = (ENCODER_LABEL, RERANKER_LABEL)
) -> tuple[Path | None, Path | None]:
    """(encoder directory, re-ranker directory), None for the named choices; a ChoiceError
    for a wrong kind, a missing directory or an impossible combination. Loads nothing."""
    el, rl = labels
    enc_dir = (
        None if encoder == BUILTIN else _hf_dir(encoder, el, DUAL_ENCODER_TYPES, ENCODER_CHOICES)
    )
    if reranker in ("late", "han") and enc_dir is not None:
        raise ChoiceError(
            f"{rl}={reranker} needs token-level text features in the space of the stored image "
            f"tokens; {el}={encoder} (a {spelled(model_type(enc_dir))} checkpoint) gives "
            f"pooled vectors only. Use {rl}=ce, none or a BLIP directory with it, or "
            f"{el}=builtin"
        )
    rr_dir = (
        None
        if reranker in RERANKER_NAMES
        else _hf_dir(reranker, rl, RERANKER_TYPES, RERANKER_CHOICES)
    )
    return enc_dir, rr_dir


# -- loading ----------------------------------------------------------------------------------


class _Loader:
    """Loads the models of one `load_models` call: the builtin model once, on `device`."""

    def __init__(
        self, model_dir: Path | None, device: str, precision: PrecisionChoice = "auto"
    ) -> None:
        self.model_dir = model_dir
        self.device = device
        self.precision = precision
        self._builtin: BuiltinModel | None = None

    def joint(self) -> BuiltinModel:
        """The builtin model from `model_dir` (None: the shipped weights), loaded once."""
        if self._builtin is None:
            self._builtin = BuiltinModel.load(self.model_dir, self.device, self.precision)
        return self._builtin

    def builtin_part(self, model: BuiltinModel) -> Part:
        """The builtin model as the manifest records it."""
        return Part(
            model.name,
            model.fingerprint,
            str(Path(self.model_dir).resolve()) if self.model_dir is not None else None,
        )

    def hf(self, cls: Callable[..., Any], path: Path, label: str, value: str) -> Any:
        """A Hugging Face model; its load error names the choice that asked for it."""
        try:
            return cls(path, self.device)
        except ModelLoadError as exc:
            raise ModelLoadError(f"{label}={value}: {exc}") from exc


def _lacks(encoder: str) -> str:
    return f"needs token-level text features, which the {encoder} encoder lacks"


def _with_blip(enc: BiEncoder, enc_part: Part, blip: Any, rr_dir: Path, choice: str) -> Models:
    """The encoder with a BLIP re-ranker: its cross-encoder, its vision encoder's tokens."""
    stored = (
        f"needs duet's own image tokens; this deployment stores the BLIP re-ranker's ({choice})"
    )
    why = dict.fromkeys(("late", "han"), stored)
    return Models(
        enc,
        enc_part,
        cross=blip,
        tokens=blip.image_tokens,
        token_part=Part(blip.name, blip.fingerprint, str(rr_dir.resolve())),
        token_shape=blip.token_shape,
        default_reranker="ce",
        why=why,
        joint=None,
        late=None,
    )


def _with_joint_tokens(
    enc: BiEncoder, enc_part: Part, loader: _Loader, reranker: str, *, same: bool, rl: str
) -> Models:
    """The encoder with the builtin model's re-rankers and tokens; `same`: the builtin model
    is the encoder too (then late interaction and HAN work)."""
    model = loader.joint()
    token_part = loader.builtin_part(model)
    weights = loader.model_dir or DEFAULT_WEIGHTS
    han = HANReranker.load(weights, model, model.device) if same else None
    if reranker == "han" and han is None:
        raise ChoiceError(
            f"{rl}=han: {weights} has no trained HAN head "
            "(han.safetensors, han.json); `duet train --out DIR` trains the model "
            f"with one. {rl} is {RERANKER_CHOICES}"
        )
    why: dict[str, str]
    if reranker == "none":
        why = {"*": f"is not configured ({rl}=none)"}  # every re-ranker
        default = NONE
    elif same:
        why = {}  # the registry builds each from the joint model (han: if it has a head)
        default = reranker if reranker in ("late", "han") else "ce"
    else:
        why = dict.fromkeys(("late", "han"), _lacks(enc_part.name))
        default = "ce"
    return Models(
        enc,
        enc_part,
        cross=None if reranker == "none" else model,
        tokens=lambda images: model.encode_images(images)[1],
        token_part=token_part,
        token_shape=model.token_shape,
        default_reranker=default,
        why=why,
        joint=model if same else None,
        late=model if same and reranker != "none" else None,
        han=han if reranker != "none" else None,
    )


def load_models(
    encoder: str = BUILTIN,
    reranker: str = "ce",
    model_dir: Path | None = None,
    device: str = "cpu",
    *,
    labels: tuple[str, str] = (ENCODER_LABEL, RERANKER_LABEL),
    precision: PrecisionChoice = "auto",
) -> Models:
    """The models for (encoder, reranker) on `device` (auto, cpu, cuda). `model_dir` holds the
    builtin model's weights (None: the shipped ones). `labels` name the two choices in errors
    (the settings, or a command's --encoder / --reranker). `precision` is the builtin
    cross-encoder's (auto: fp16 on a GPU, fp32 on the CPU)."""
    el, rl = labels
    encoder = encoder.strip() or BUILTIN
    reranker = reranker.strip() or "ce"
    enc_dir, rr_dir = check_choices(encoder, reranker, labels=labels)
    loader = _Loader(model_dir, device, precision)
    enc: BiEncoder
    if enc_dir is None:
        enc = loader.joint()
        enc_part = loader.builtin_part(loader.joint())
    else:
        enc = loader.hf(hf.HFDualEncoder, enc_dir, el, encoder)
        enc_part = Part(enc.name, enc.fingerprint, str(enc_dir.resolve()))
    if rr_dir is not None:  # BLIP: its cross-encoder, its vision encoder's tokens
        blip = loader.hf(hf.HFBlipReranker, rr_dir, rl, reranker)
        return _with_blip(enc, enc_part, blip, rr_dir, f"{rl}={reranker}")
    if reranker == "none" and enc_dir is not None:  # nothing to store: zero-width tokens
        return Models(
            enc,
            enc_part,
            cross=None,
            tokens=None,
            token_part=NO_TOKENS,
            token_shape=(0, 0),
            default_reranker=NONE,
            why={  # ce: not configured; late and han: not possible with this encoder at all
                "*": f"is not configured ({rl}=none)",
                **dict.fromkeys(("late", "han"), _lacks(enc_part.name)),
            },
            joint=None,
            late=None,
        )
    # builtin / late / han, or none with the builtin encoder: the joint model's tokens
    return _with_joint_tokens(enc, enc_part, loader, reranker, same=enc_dir is None, rl=rl)
