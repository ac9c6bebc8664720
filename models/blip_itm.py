"""BLIP ITM's text encoder restructured for scoring pairs (same function, less work).

`BlipForImageTextRetrieval`'s ITM score runs its text encoder over each (sentence, image
states) pair: per layer self-attention over the sentence, cross-attention from the sentence
to the image's states, a feed-forward block. At BLIP base (577 states of 768 per image,
12 heads of 64) nearly all of the work is the cross-attention's keys and values: each pair
projects its 577 states through two 768 x 768 matrices in every layer, ~1.36 GFLOP a layer,
while the sentence has ~10-35 tokens. Two things are computed differently here:

* the keys and values are never made. With the states X, a head's query q and that head's
  rows of the key matrix W_k, q (X W_k^T + b_k)^T = (q W_k) X^T + q b_k, and the last term
  is the same for every key, so softmax drops it; likewise softmax(s) (X W_v^T + b_v) =
  (softmax(s) X) W_v^T + b_v, since each row of softmax(s) sums to one. So each head's
  query is carried into the states' space (q W_k, a sentence-sized product), attends over X
  itself, and the result goes through W_v afterwards: 2 x heads x tokens x 577 x 768
  multiply-adds a layer instead of 2 x 577 x 768 x 768, ~3x fewer for a 20-token sentence
  (used while the sentence has fewer tokens than a head has dimensions, where it pays);
* the last layer computes its queries, cross-attention and feed-forward for the first
  position only, the one the ITM head reads.

Equal to the module's forward up to floating-point rounding (`tests/test_blip_itm.py`).
Where the loaded model is not laid out as expected (another transformers version), `of`
returns None and the caller runs the module's forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from models.masked_cross import pin_attention

Pair = tuple[torch.Tensor, torch.Tensor]


def _wb(linear: Any) -> Pair:
    return linear.weight, linear.bias


@dataclass(frozen=True)
class _Norm:
    weight: torch.Tensor
    bias: torch.Tensor
    eps: float

    @staticmethod
    def of(module: Any) -> _Norm:
        return _Norm(module.weight, module.bias, float(module.eps))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


@dataclass(frozen=True)
class _Layer:
    """One BLIP text layer's weights (post-norm: self-attention, cross-attention, MLP)."""

    q: Pair
    k: Pair
    v: Pair
    out: Pair
    norm: _Norm
    xq: Pair
    xk: torch.Tensor  # (heads, head dim, state width): the cross keys' weight by head
    xv: torch.Tensor
    xv_bias: torch.Tensor  # (heads, 1, head dim)
    xout: Pair
    xnorm: _Norm
    ff1: Pair
    act: Any
    ff2: Pair
    fnorm: _Norm

    @staticmethod
    def of(layer: Any, heads: int) -> _Layer:
        att, cross = layer.attention, layer.crossattention
        xk, xv = cross.self.key, cross.self.value
        width = xk.weight.shape[1]
        return _Layer(
            q=_wb(att.self.query),
            k=_wb(att.self.key),
            v=_wb(att.self.value),
            out=_wb(att.output.dense),
            norm=_Norm.of(att.output.LayerNorm),
            xq=_wb(cross.self.query),
            xk=xk.weight.view(heads, -1, width),
            xv=xv.weight.view(heads, -1, width),
            xv_bias=xv.bias.view(heads, 1, -1),
            xout=_wb(cross.output.dense),
            xnorm=_Norm.of(cross.output.LayerNorm),
            ff1=_wb(layer.intermediate.dense),
            act=layer.intermediate.intermediate_act_fn,
            ff2=_wb(layer.output.dense),
            fnorm=_Norm.of(layer.output.LayerNorm),
        )


class BlipItmScorer:
    """ITM logits (match minus no-match) of a loaded `BlipForImageTextRetrieval`, computed
    as above from the module's own weights (no copies)."""

    def __init__(self, model: Any) -> None:
        enc = model.text_encoder
        cfg = enc.config
        self.heads = int(cfg.num_attention_heads)
        self.head_dim = int(cfg.hidden_size) // self.heads
        self.words = enc.embeddings.word_embeddings.weight
        self.positions = enc.embeddings.position_embeddings.weight
        self.embed_norm = _Norm.of(enc.embeddings.LayerNorm)
        self.layers = [_Layer.of(layer, self.heads) for layer in enc.encoder.layer]
        self.itm = _wb(model.itm_head)
        pin_attention(self.words.device)

    @staticmethod
    def of(model: Any) -> BlipItmScorer | None:
        """The scorer, or None where the model's modules are not BLIP's as read here."""
        try:
            cfg = model.text_encoder.config
            if getattr(cfg, "position_embedding_type", "absolute") != "absolute":
                return None
            scorer = BlipItmScorer(model)
        except (AttributeError, RuntimeError, TypeError):
            return None
        return scorer if scorer.layers else None

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        n, s, d = x.shape
        return x.view(n, s, self.heads, d // self.heads).transpose(1, 2)

    def _merge(self, x: torch.Tensor) -> torch.Tensor:
        n, h, s, d = x.shape
        return x.transpose(1, 2).reshape(n, s, h * d)

    def _self(self, w: _Layer, x: torch.Tensor, keep: torch.Tensor, first: bool) -> torch.Tensor:
        """Self-attention and its residual norm; for the first position only when `first`."""
        rows = x[:, :1] if first else x
        q = self._heads(F.linear(rows, *w.q))
        k, v = self._heads(F.linear(x, *w.k)), self._heads(F.linear(x, *w.v))
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return w.norm(F.linear(self._merge(a), *w.out) + rows)

    def _cross(self, w: _Layer, x: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        """Cross-attention to every state (BLIP's ITM masks none) and its residual norm."""
        q = self._heads(F.linear(x, *w.xq))  # (n, heads, tokens, head dim)
        n, h, s, _ = q.shape
        if s < self.head_dim:  # the query carried to the states, no keys or values made
            # per head one product over every pair's tokens (einsum: a batch of heads, not
            # of pairs x heads, and no copy of the weights per pair)
            wide = torch.einsum("nhsd,hde->nhse", q, w.xk).reshape(n, h * s, -1)
            scores = torch.bmm(wide, states.transpose(1, 2)) * self.head_dim**-0.5
            mixed = torch.bmm(scores.softmax(dim=-1), states).view(n, h, s, -1)
            a = torch.einsum("nhse,hde->nhsd", mixed, w.xv) + w.xv_bias
        else:  # the key bias cancels, as above
            k = self._heads(F.linear(states, w.xk.flatten(0, 1)))
            v = self._heads(F.linear(states, w.xv.flatten(0, 1))) + w.xv_bias
            a = F.scaled_dot_product_attention(q, k, v)
        return w.xnorm(F.linear(self._merge(a), *w.xout) + x)

    def _mlp(self, w: _Layer, x: torch.Tensor) -> torch.Tensor:
        return w.fnorm(F.linear(w.act(F.linear(x, *w.ff1)), *w.ff2) + x)

    @torch.inference_mode()
    def logits(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, states: torch.Tensor
    ) -> torch.Tensor:
        """(n,) float32 logits for n pairs: token ids and mask (n, tokens), states (n, T, w)
        in the model's dtype, all on its device."""
        length = input_ids.shape[1]
        x = F.embedding(input_ids, self.words) + self.positions[:length]
        x = self.embed_norm(x)
        keep = attention_mask.bool()[:, None, None, :]
        for i, w in enumerate(self.layers):
            x = self._self(w, x, keep, first=i == len(self.layers) - 1)
            x = self._mlp(w, self._cross(w, x, states))
        out = F.linear(x[:, 0], *self.itm).float()
        return out[:, 1] - out[:, 0]
