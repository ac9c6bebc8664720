"""HAN: Heterogeneous Attention Network, a matching head trained by `duet train`.

Words and regions (image patches clustered into region features, see `models.late.
kmeans_regions`) are projected to one width, L2-normalised and attended over *jointly*:

    h        = [w_1 / |w_1|, ..., w_n / |w_n|, o_1 / |o_1|, ..., o_m / |o_m|]
    a_ij     = softmax_j(beta * q_i . k_j)              (q, k, v: linear maps of h)
    h_i     <- LayerNorm(fc(sum_j a_ij v_j) + q_i)      (one heterogeneous block)

then the words are aligned to the regions as SCAN does and the pair is scored:

    s_ij     = cos(w~_i, o^_j)
    a_ij     = softmax_j(beta * s_ij)
    o~_i     = sum_j a_ij o^_j
    S_AVG    = mean_i cos(w~_i, o~_i)

Padding is masked everywhere: padded words never count in the mean, padded regions never
receive attention. Trained with `models.losses.softmax_triplet_loss` (exponent p).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file
from torch import nn

from models.late import kmeans_regions
from models.protocols import TokenEncoder
from models.shipped import save_weights
from models.tokenizer import unique_texts

NEG = -1e9  # added to masked attention logits


def _masked_softmax(logits: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
    """Soft-max over the last axis, ignoring keys where `key_mask` is False."""
    return torch.softmax(logits.masked_fill(~key_mask[..., None, :], NEG), dim=-1)


def align_and_match(
    words: torch.Tensor,
    word_mask: torch.Tensor,
    regions: torch.Tensor,
    region_mask: torch.Tensor,
    beta: float,
) -> torch.Tensor:
    """S_AVG for B pairs: words (B, n, d) and regions (B, m, d) -> (B,)."""
    w = nn.functional.normalize(words, dim=-1)
    o = nn.functional.normalize(regions, dim=-1)
    attn = _masked_softmax(beta * w @ o.transpose(1, 2), region_mask)  # (B, n, m)
    aligned = attn @ regions  # o~_i, a combination of the (unnormalised) region features
    r = nn.functional.cosine_similarity(words, aligned, dim=-1)  # (B, n)
    keep = word_mask.to(r.dtype)
    return (r * keep).sum(dim=1) / keep.sum(dim=1).clamp(min=1.0)


class HeterogeneousBlock(nn.Module):
    """One self-attention block over the joint word + region set (HAN eq. 2-5)."""

    def __init__(self, dim: int, beta: float) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.fc = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.beta = beta

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q = self.q(h)
        attn = _masked_softmax(self.beta * q @ self.k(h).transpose(1, 2), mask)
        return self.norm(self.fc(attn @ self.v(h)) + q)


@dataclass(frozen=True)
class HANConfig:
    word_dim: int = 128
    region_dim: int = 128
    dim: int = 128
    layers: int = 1
    beta_attention: float = 1.0
    beta_alignment: float = 9.0  # SCAN's lambda_1 for text-side alignment


class HAN(nn.Module):
    """Scores (sentence, image) pairs from word features and region features."""

    def __init__(self, cfg: HANConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.word_proj = nn.Linear(cfg.word_dim, cfg.dim)
        self.region_proj = nn.Linear(cfg.region_dim, cfg.dim)
        self.blocks = nn.ModuleList(
            HeterogeneousBlock(cfg.dim, cfg.beta_attention) for _ in range(cfg.layers)
        )

    def forward(
        self,
        words: torch.Tensor,
        word_mask: torch.Tensor,
        regions: torch.Tensor,
        region_mask: torch.Tensor,
    ) -> torch.Tensor:
        """words (B, n, word_dim), regions (B, m, region_dim), masks True for real items
        -> S_AVG (B,)."""
        n = words.shape[1]
        h = torch.cat(
            [
                nn.functional.normalize(self.word_proj(words), dim=-1),
                nn.functional.normalize(self.region_proj(regions), dim=-1),
            ],
            dim=1,
        )
        mask = torch.cat([word_mask, region_mask], dim=1)
        for block in self.blocks:
            h = block(h, mask)
        return align_and_match(h[:, :n], word_mask, h[:, n:], region_mask, self.cfg.beta_alignment)


# The re-ranker's score is S_AVG blended with the candidate's dot product,
#     S = (1 - DOT_WEIGHT) * S_AVG + DOT_WEIGHT * dot
# as late interaction's S_gl is: the two err on different candidates. Chosen on two validation
# splits (world seeds 999,999 and 999,997) at M = 50 for the shipped head: mean R@1 t2i / i2t
# 85.58 / 86.25 at w = 0, 85.94 / 86.35 at 0.2, 85.92 / 86.55 at 0.4, 85.62 / 86.6 at 0.5,
# 82.89 / 82.85 at 0.8 (the dot product: 76.59 / 76.0); models/weights/README.md has the sweep.
DOT_WEIGHT = 0.4


def with_dot(dots: np.ndarray, s_avg: np.ndarray, weight: float = DOT_WEIGHT) -> np.ndarray:
    """HAN's re-ranking score: (1 - weight) * S_AVG + weight * dot, float32."""
    return np.asarray(
        (1.0 - weight) * np.asarray(s_avg, np.float64) + weight * np.asarray(dots, np.float64),
        np.float32,
    )


HAN_WEIGHTS = "han.safetensors"
HAN_CONFIG = "han.json"
MAX_REGIONS = 32  # HAN's regions per image


def regions_of(image_tokens: np.ndarray, k: int = MAX_REGIONS) -> np.ndarray:
    """Region features (B, min(k, T), D): the patch tokens themselves when an image has at most
    k of them, else each image's tokens clustered to k centres (`kmeans_regions`)."""
    toks = np.asarray(image_tokens, dtype=np.float32)
    if toks.shape[1] <= k:
        return toks
    return np.stack([kmeans_regions(t, k) for t in toks])


class HANReranker:
    """A trained HAN head over a model's word features (text tower tokens) and the index's
    stored image tokens (as regions): `score(...)` is S_AVG per (sentence, image) pair."""

    def __init__(self, head: HAN, words: TokenEncoder, device: torch.device | None = None) -> None:
        self.device = device or torch.device("cpu")
        self.head = head.to(self.device).eval()
        self.words = words

    @classmethod
    def load(
        cls, directory: Path, words: TokenEncoder, device: torch.device | None = None
    ) -> HANReranker | None:
        """The HAN head saved beside a model's weights (`duet train` writes it), or None when
        that model directory has none."""
        d = Path(directory)
        if not (d / HAN_WEIGHTS).exists():
            return None
        cfg = HANConfig(**json.loads((d / HAN_CONFIG).read_text()))
        head = HAN(cfg)
        head.load_state_dict(load_file(str(d / HAN_WEIGHTS)))
        return cls(head, words, device)

    @torch.inference_mode()
    def score(
        self, words: np.ndarray, word_mask: np.ndarray, image_tokens: np.ndarray
    ) -> np.ndarray:
        """S_AVG (B,) for B pairs of word features (B, L, D) with mask and image tokens."""
        regions = torch.from_numpy(regions_of(image_tokens)).to(self.device)
        w = torch.from_numpy(np.asarray(words, dtype=np.float32)).to(self.device)
        wm = torch.from_numpy(np.asarray(word_mask, dtype=bool)).to(self.device)
        rm = torch.ones(regions.shape[:2], dtype=torch.bool, device=self.device)
        return self.head(w, wm, regions, rm).float().cpu().numpy()

    def score_pairs(self, texts: Sequence[str], image_tokens: np.ndarray) -> np.ndarray:
        """S_AVG for (text, image tokens) pairs; the words come from the model's text tower."""
        if len(texts) == 0:
            return np.zeros(0, dtype=np.float32)
        unique, rows = unique_texts(texts)
        words, mask = self.words.text_token_features(unique)
        return self.score(words[rows], mask[rows], image_tokens)


def save_han(head: HAN, out: Path) -> None:
    """Write the head beside the model's weights: han.safetensors + han.json."""
    state = {k: v.detach().contiguous() for k, v in head.state_dict().items()}
    save_weights(state, out / HAN_WEIGHTS)
    (out / HAN_CONFIG).write_text(json.dumps(asdict(head.cfg), indent=1) + "\n")
