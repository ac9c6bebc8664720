"""The joint model's cross-encoder, restructured for serving (same function, less work).

`JointModel.itm_logits` is the training-time forward: every (text, image) pair runs every
fusion layer over the whole padded sequence [ITM] + text + image. Serving scores one query
against M candidates, so three things repeat and are computed once or not at all here:

* padding: pairs are grouped by their text's real length, so no pair carries padded
  positions and attention needs no mask (the masked-softmax kernel cost ~10 % alone);
* the query side of the first layer: [ITM] and the text enter layer 1 identically for every
  candidate of a sentence, so their layer norm and q/k/v projections run once per sentence;
* the last layer's unused rows: only the [ITM] position's output is read, so the last layer
  computes keys and values for every position but the query, attention output and
  feed-forward for [ITM] alone.

Measured on the 2-core CPU, one thread, 50 pairs: 57.6 ms -> 38.7 ms (1.5x), logits equal
to 3e-6. On a GPU, `precision` fp16 / bf16 autocasts the same code; measured once on an H200
(docs/gpu.md), that ran 50 pairs at 14k pairs/s against the plain forward's 50k (not like for
like, but duet's served latency trails there too). Tried on this CPU and
dropped: int8 (fbgemm dynamic quantisation of every linear layer; 38.1 ms, no faster at these
sizes, logits off by up to 0.68, and torch deprecates its quantised tensors) and bf16
autocast (no AMX or AVX-512 BF16 here: 7x slower).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from models.joint import JointModel
from models.masked_cross import pin_attention

Precision = Literal["fp32", "fp16", "bf16"]
# what a setting may ask for: auto = fp16 on a GPU, fp32 on the CPU (`BuiltinModel.load`)
PrecisionChoice = Literal["auto", "fp32", "fp16", "bf16"]
PRECISIONS: tuple[str, ...] = ("fp32", "fp16", "bf16")


class _Linear:
    """y = x W^T + b with a fixed (possibly sliced) weight."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class _Block:
    """One pre-norm fusion layer (nn.TransformerEncoderLayer, norm_first, gelu)."""

    def __init__(self, layer: nn.TransformerEncoderLayer, heads: int) -> None:
        self.layer = layer
        attn = layer.self_attn
        d = attn.embed_dim
        w, b = attn.in_proj_weight, attn.in_proj_bias
        assert w is not None and b is not None
        self.heads = heads
        self.norm1, self.norm2 = layer.norm1, layer.norm2
        self.qkv = _Linear(w, b)
        self.q = _Linear(w[:d], b[:d])
        self.kv = _Linear(w[d:], b[d:])
        self.out = _Linear(attn.out_proj.weight, attn.out_proj.bias)
        self.ff1 = _Linear(layer.linear1.weight, layer.linear1.bias)
        self.ff2 = _Linear(layer.linear2.weight, layer.linear2.bias)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        n, s, d = x.shape
        return x.view(n, s, self.heads, d // self.heads).transpose(1, 2)

    def _attend(
        self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """x (rows being updated) + attention output + feed-forward, for those rows."""
        a = F.scaled_dot_product_attention(self._heads(q), self._heads(k), self._heads(v))
        x = x + self.out(a.transpose(1, 2).reshape(x.shape))
        return x + self.ff2(F.gelu(self.ff1(self.norm2(x))))

    def full(self, x: torch.Tensor) -> torch.Tensor:
        """The whole layer. With no mask the module takes torch's fused inference kernel
        (`_transformer_encoder_layer_fwd`), which parallelises better than the ops above."""
        return self.layer(x)

    def first(self, head: torch.Tensor, owner: torch.Tensor, img: torch.Tensor) -> torch.Tensor:
        """The first layer with [ITM] + text (`head`, one row per sentence) projected once
        per sentence and gathered to the pairs that share it."""
        qkv = torch.cat([self.qkv(self.norm1(head))[owner], self.qkv(self.norm1(img))], dim=1)
        q, k, v = qkv.chunk(3, dim=-1)
        return self._attend(torch.cat([head[owner], img], dim=1), q, k, v)

    def last(self, x: torch.Tensor) -> torch.Tensor:
        """The last layer for the [ITM] row only (the one the head reads): (n, 1, d)."""
        h = self.norm1(x)
        k, v = self.kv(h).chunk(2, dim=-1)
        return self._attend(x[:, :1], self.q(h[:, :1]), k, v)


class CrossEncoderRuntime:
    """ITM logits of a `JointModel` for (sentence, image states) pairs, computed as above."""

    def __init__(self, model: JointModel, precision: Precision = "fp32") -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"unknown precision {precision!r}: use one of {PRECISIONS}")
        self.model = model
        self.precision = precision
        self.device = next(model.parameters()).device
        pin_attention(self.device)  # the host path on a GPU: no cuDNN attention (masked_cross)
        heads = model.cfg.n_heads
        layers = list(model.fusion.layers)
        self.blocks = [_Block(layer, heads) for layer in layers]

    @torch.inference_mode()
    def logits(
        self,
        text_states: torch.Tensor,
        lengths: Sequence[int],
        owner: torch.Tensor,
        img: torch.Tensor,
    ) -> torch.Tensor:
        """(n,) logits: pair i reads sentence `owner[i]` (its states `text_states[owner[i]]`,
        the first `lengths[owner[i]]` of them real) with image states `img[i]`."""
        out = torch.empty(img.shape[0], device=img.device)
        if img.shape[0] == 0:
            return out
        owner = owner.to(img.device)
        lens = torch.as_tensor(list(lengths), device=img.device)
        img = img.to(text_states.dtype)
        for length in torch.unique(lens).tolist():
            sentences = torch.nonzero(lens == length).squeeze(1)
            pairs = torch.nonzero(lens[owner] == length).squeeze(1)
            if len(pairs) == 0:
                continue
            # renumber the pairs' sentences within this length bucket
            local = torch.full((len(lens),), -1, dtype=torch.long, device=img.device)
            local[sentences] = torch.arange(len(sentences), device=img.device)
            out[pairs] = self._bucket(
                text_states[sentences, :length], local[owner[pairs]], img[pairs]
            ).float()
        return out

    def _bucket(self, txt: torch.Tensor, owner: torch.Tensor, img: torch.Tensor) -> torch.Tensor:
        m = self.model
        with self._autocast():
            itm = m.itm_token.expand(txt.shape[0], -1, -1)
            head = torch.cat([itm, txt + m.type_embed[0]], dim=1)
            x_img = img + m.type_embed[1] + m.fusion_pos
            x = self.blocks[0].first(head, owner, x_img)
            if len(self.blocks) == 1:  # the first layer was also the last: read [ITM]
                return m.itm_head(m.fusion_norm(x[:, 0])).squeeze(-1)
            for block in self.blocks[1:-1]:
                x = block.full(x)
            x = self.blocks[-1].last(x)
            return m.itm_head(m.fusion_norm(x[:, 0])).squeeze(-1)

    def _autocast(self) -> Any:
        if self.precision in ("fp16", "bf16"):
            dtype = torch.float16 if self.precision == "fp16" else torch.bfloat16
            return torch.autocast(self.device.type, dtype=dtype)
        return torch.autocast(self.device.type, enabled=False)
