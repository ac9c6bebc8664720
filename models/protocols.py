"""What the service and the builder call on a model; plain classes implement these."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

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
