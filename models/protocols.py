"""What the service and the builder call on a model; plain classes implement these."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np
from PIL import Image


class BiEncoder(Protocol):
    """Texts and images -> L2-normalised float32 vectors in one space."""

    name: str
    fingerprint: str  # name + weights hash; an index records the one that built it
    dim: int

    def encode_texts(self, texts: Sequence[str]) -> np.ndarray: ...

    def encode_images(self, images: Sequence[Image.Image]) -> tuple[np.ndarray, np.ndarray]:
        """(vectors (n, dim) float32, patch tokens (n, *token_shape) float16)."""
        ...


class PairReranker(Protocol):
    """A cross-encoder: scores (text, image tokens) pairs read together."""

    def score_pairs(self, texts: Sequence[str], image_tokens: np.ndarray) -> np.ndarray: ...


class JointEncoder(BiEncoder, PairReranker, Protocol):
    """One model in both roles (JOINT+COOP); the builder stores its image tokens."""

    token_shape: tuple[int, int]


@runtime_checkable
class TokenEncoder(Protocol):
    """Token-level text features for late interaction (TGDT), in the image tokens' width."""

    def text_token_features(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """(tokens (n, L, d) float32, mask (n, L) bool, True for real tokens)."""
        ...
