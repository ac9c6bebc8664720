"""duet's own joint image-text model (JOINT+COOP, Rerank-Smart).

An image tower turns the picture into patch tokens, a text tower turns words into tokens,
and one shared transformer contextualises each modality alone into token *states*. They
serve twice:

* bi-encoder: states -> masked mean pool -> projection -> L2-normalised vector;
* cross-encoder: [ITM] + text states + image states read together by fusion layers (as
  ALBEF fuses its unimodal encoders' outputs) -> ITM logit.

The image states are what the index stores for re-ranking (the cross-encoder, late
interaction and HAN read them), so the service never needs the corpus's image files and a
query never re-encodes a candidate.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.fastpath import run_layers


@dataclass(frozen=True)
class JointConfig:
    """Shape of the joint model; saved as config.json beside the weights."""

    vocab_size: int
    image_size: int = 64
    d_model: int = 128
    n_heads: int = 4
    tower_layers: int = 1
    shared_layers: int = 3
    embed_dim: int = 128
    max_text_len: int = 32
    grid: int = 4  # image tokens = grid * grid
    fusion_layers: int = 4  # cross-encoder layers over the joint text + image states
    # 1: batch norm after each stem convolution but the last. Measured (a linear probe on the
    # stored image states): the weights shipped before it told shapes apart 46 % of the time;
    # trained on the patch labels alone, the stem without it reached 28 % in 400 steps, with
    # it 47 % in 400 and 97 % in 1,500 (the shipped weights, which have it: 99.96 %)
    stem_norm: int = 0

    def to_json(self) -> dict[str, int]:
        return asdict(self)


def _encoder(cfg: JointConfig, layers: int) -> nn.TransformerEncoder:
    layer = nn.TransformerEncoderLayer(
        cfg.d_model,
        cfg.n_heads,
        4 * cfg.d_model,
        dropout=0.0,
        activation="gelu",
        batch_first=True,
        norm_first=True,
    )
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)


class ImageTower(nn.Module):
    """Conv stem over the picture -> grid x grid patch tokens with positions."""

    def __init__(self, cfg: JointConfig) -> None:
        super().__init__()
        d = cfg.d_model
        # (out channels, stride): 64 px -> 32 -> 16 -> 16 -> 8 -> 4; the stride-1 layer at
        # 16 px is what tells a small circle from a small diamond or square
        plan = [(32, 2), (64, 2), (64, 1), (96, 2), (d, 2)]
        stem: list[nn.Module] = []
        c_in = 3
        for c_out, stride in plan:
            stem.append(nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1))
            if cfg.stem_norm:
                stem.append(nn.BatchNorm2d(c_out))
            stem.append(nn.GELU())
            c_in = c_out
        # the last convolution feeds the layer norm directly
        self.stem = nn.Sequential(*stem[: -2 if cfg.stem_norm else -1])
        self.stem_norm = nn.LayerNorm(d)
        self.pos = nn.Parameter(torch.zeros(1, cfg.grid * cfg.grid, d))
        self.blocks = _encoder(cfg, cfg.tower_layers)
        self.kernels = False  # models.fastpath at inference (JointModel.serve_kernels)
        # positions on the same scale as the (normalised) patch features: a 0.02-scale
        # position code is drowned out and the model cannot tell left from right
        nn.init.normal_(self.pos, std=1.0)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels (B, 3, H, W) in [0, 1] -> tokens (B, grid*grid, d)."""
        x = self.stem(pixels * 2.0 - 1.0).flatten(2).transpose(1, 2)
        return run_layers(self.blocks, self.stem_norm(x) + self.pos, kernel=self.kernels)


class TextTower(nn.Module):
    """Word embeddings with positions and one transformer block."""

    def __init__(self, cfg: JointConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model, padding_idx=0)
        self.pos = nn.Parameter(torch.zeros(1, cfg.max_text_len, cfg.d_model))
        self.blocks = _encoder(cfg, cfg.tower_layers)
        self.kernels = False  # models.fastpath at inference (JointModel.serve_kernels)
        # same scale as the N(0, 1) word embeddings, else word order is lost (measured: with
        # 0.02 the text side was a bag of words, swapped captions at cosine 1.0)
        nn.init.normal_(self.pos, std=1.0)

    def forward(self, ids: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.pos[:, : ids.shape[1]]
        return run_layers(self.blocks, x, pad, kernel=self.kernels)


CROSS_ENCODER = ("fusion.", "fusion_norm.", "fusion_pos", "itm_token", "itm_head.")


class JointModel(nn.Module):
    """Image tower + text tower + one shared transformer for both modalities; fusion layers
    on top of both for re-ranking (the parameters named in `CROSS_ENCODER`)."""

    def __init__(self, cfg: JointConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.d_model
        self.image_tower = ImageTower(cfg)
        self.text_tower = TextTower(cfg)
        self.type_embed = nn.Parameter(torch.zeros(2, d))  # 0 = text, 1 = image
        self.itm_token = nn.Parameter(torch.zeros(1, 1, d))
        self.shared = _encoder(cfg, cfg.shared_layers)
        self.norm = nn.LayerNorm(d)
        self.fusion = _encoder(cfg, cfg.fusion_layers)
        self.fusion_norm = nn.LayerNorm(d)
        # where each image state sits, told to the fusion layers directly (the papers' region
        # features carry their box coordinates): relations compare these positions
        self.fusion_pos = nn.Parameter(torch.randn(1, cfg.grid * cfg.grid, d))
        self.text_proj = nn.Linear(d, cfg.embed_dim)
        self.image_proj = nn.Linear(d, cfg.embed_dim)
        self.itm_head = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, 1))
        self.logit_scale = nn.Parameter(torch.tensor(2.996))  # log(1 / 0.05)
        nn.init.normal_(self.type_embed, std=1.0)
        nn.init.normal_(self.itm_token, std=0.02)
        self.kernels = False

    def serve_kernels(self, on: bool = True) -> JointModel:
        """At inference, run the towers' and the shared layers' transformer stacks through
        the fused kernel directly (`models.fastpath`): the same states, less Python per call.
        Off for a model made to train (autograd would skip it anyway)."""
        for m in (self, self.image_tower, self.text_tower):
            m.kernels = on
        return self

    def reset_cross_encoder(self) -> None:
        """Fresh fusion layers, [ITM] token and ITM head (what `models.train_ce` trains)."""
        d = self.cfg.d_model
        self.fusion = _encoder(self.cfg, self.cfg.fusion_layers)
        self.fusion_norm = nn.LayerNorm(d)
        self.itm_head = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, 1))
        with torch.no_grad():
            self.fusion_pos.normal_(std=1.0)
            self.itm_token.normal_(std=0.02)

    # -- token states (what the index stores for images) ---------------------------
    def image_tokens(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels -> image states (B, grid*grid, d): the tower's patches through the shared
        transformer. What the index stores and every re-ranker reads."""
        x = self.image_tower(pixels) + self.type_embed[1]
        return self.norm(run_layers(self.shared, x, kernel=self.kernels))

    def text_tokens(self, ids: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        """ids -> text states (B, L, d); padded positions are meaningless (mask with `pad`)."""
        x = self.text_tower(ids, pad) + self.type_embed[0]
        return self.norm(run_layers(self.shared, x, pad, kernel=self.kernels))

    # -- bi-encoder ---------------------------------------------------------
    def embed_images(self, img_tokens: torch.Tensor) -> torch.Tensor:
        """Image states -> L2-normalised global vectors."""
        return F.normalize(self.image_proj(img_tokens.mean(dim=1)), dim=-1)

    def embed_texts(self, txt_tokens: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        """Text states -> L2-normalised global vectors (mean over real tokens)."""
        keep = (~pad).unsqueeze(-1).to(txt_tokens.dtype)
        pooled = (txt_tokens * keep).sum(dim=1) / keep.sum(dim=1).clamp(min=1.0)
        return F.normalize(self.text_proj(pooled), dim=-1)

    # -- cross-encoder ------------------------------------------------------
    def itm_logits(
        self, txt_tokens: torch.Tensor, pad: torch.Tensor, img_tokens: torch.Tensor
    ) -> torch.Tensor:
        """ITM logit for each (text states, image states) row pair: (B,), higher = a match."""
        return self.itm_head(self.fused(txt_tokens, pad, img_tokens)[:, 0]).squeeze(-1)

    def fused(
        self, txt_tokens: torch.Tensor, pad: torch.Tensor, img_tokens: torch.Tensor
    ) -> torch.Tensor:
        """The fusion layers' output over [ITM] + text + image: (B, 1 + L + T, d)."""
        return self.fused_tap(txt_tokens, pad, img_tokens, 0)[0]

    def fused_tap(
        self, txt_tokens: torch.Tensor, pad: torch.Tensor, img_tokens: torch.Tensor, tap: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(`fused`, the sequence after the first `tap` fusion layers). Training supervises
        grounding at the tap, so the layers above it are left to compare what was grounded."""
        b = txt_tokens.shape[0]
        itm = self.itm_token.expand(b, -1, -1)
        img = img_tokens.to(txt_tokens.dtype) + self.type_embed[1] + self.fusion_pos
        x = torch.cat([itm, txt_tokens + self.type_embed[0], img], dim=1)
        no_pad = torch.zeros(b, 1, dtype=torch.bool, device=pad.device)
        img_pad = torch.zeros(b, img_tokens.shape[1], dtype=torch.bool, device=pad.device)
        mask = torch.cat([no_pad, pad, img_pad], dim=1)
        tapped = x
        for i, layer in enumerate(self.fusion.layers):
            x = layer(x, src_key_padding_mask=mask)
            if i + 1 == tap:
                tapped = x
        return self.fusion_norm(x), tapped
