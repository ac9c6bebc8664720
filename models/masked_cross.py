"""The joint model's cross-encoder at fixed shapes, as the device step runs it
(`models.device_step`): weights cast once to the serving precision, padded key positions
masked, the attention kernels pinned."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.joint import JointModel

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}


def sdpa_backends(device: torch.device) -> list[object]:
    """The attention kernels the step may use. On CUDA: memory-efficient attention (masks,
    fp16/bf16/fp32, no per-shape graph) then the math fallback; cuDNN's kernel is left out
    because it builds a graph for every new shape (on an H100 switching it off doubled to
    tripled fp16 serving throughput, issue 35). On the CPU torch's own choice."""
    from torch.nn.attention import SDPBackend

    if device.type == "cuda":
        return [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]


def pin_attention(device: torch.device) -> None:
    """On CUDA, limit attention to `sdpa_backends` for the whole process; elsewhere nothing
    changes. Called where a model that runs attention on the device is set up (the device
    step, the host path's runtime, the BLIP scorer). Process-wide on purpose: `sdpa_kernel`
    sets torch's global flags on entry and restores them on exit, so two workers entering
    and leaving it at different times could re-enable a kernel under each other; with the
    flags pinned first, what each restores is the pinned set. Without it the host path on
    a GPU, a new shape per length bucket, met cuDNN's kernel, which builds a graph for each:
    on an H100 it answered 1 request a second at 64 clients."""
    if device.type != "cuda":
        return
    from torch.nn.attention import SDPBackend

    chosen = sdpa_backends(device)
    torch.backends.cuda.enable_cudnn_sdp(SDPBackend.CUDNN_ATTENTION in chosen)
    torch.backends.cuda.enable_flash_sdp(SDPBackend.FLASH_ATTENTION in chosen)
    torch.backends.cuda.enable_mem_efficient_sdp(SDPBackend.EFFICIENT_ATTENTION in chosen)
    torch.backends.cuda.enable_math_sdp(SDPBackend.MATH in chosen)


class _Layer:
    """One pre-norm fusion layer's weights in the serving dtype, run with a key mask."""

    def __init__(self, layer: nn.TransformerEncoderLayer, heads: int, dtype: torch.dtype) -> None:
        def cast(t: torch.Tensor | None) -> torch.Tensor:
            assert t is not None
            return t.detach().to(dtype).contiguous()

        attn = layer.self_attn
        self.heads = heads
        self.d = attn.embed_dim
        self.eps = (layer.norm1.eps, layer.norm2.eps)
        self.n1 = (cast(layer.norm1.weight), cast(layer.norm1.bias))
        self.n2 = (cast(layer.norm2.weight), cast(layer.norm2.bias))
        self.qkv = (cast(attn.in_proj_weight), cast(attn.in_proj_bias))
        self.out = (cast(attn.out_proj.weight), cast(attn.out_proj.bias))
        self.ff1 = (cast(layer.linear1.weight), cast(layer.linear1.bias))
        self.ff2 = (cast(layer.linear2.weight), cast(layer.linear2.bias))

    def norm1(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (self.d,), *self.n1, eps=self.eps[0])

    def project(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, *self.qkv)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        n, s, d = x.shape
        return x.view(n, s, self.heads, d // self.heads).transpose(1, 2)

    def attend(
        self,
        x: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """x (the rows being updated) + masked attention + feed-forward for those rows."""
        a = F.scaled_dot_product_attention(
            self._heads(q), self._heads(k), self._heads(v), attn_mask=mask
        )
        x = x + F.linear(a.transpose(1, 2).reshape(x.shape), *self.out)
        h = F.layer_norm(x, (self.d,), *self.n2, eps=self.eps[1])
        return x + F.linear(F.gelu(F.linear(h, *self.ff1)), *self.ff2)

    def full(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self.project(self.norm1(x)).chunk(3, dim=-1)
        return self.attend(x, q, k, v, mask)

    def last(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Only the [ITM] row (the one the head reads) is updated: (n, 1, d)."""
        q, k, v = self.project(self.norm1(x)).chunk(3, dim=-1)
        return self.attend(x[:, :1], q[:, :1], k, v, mask)


class MaskedCrossEncoder:
    """The joint model's cross-encoder at fixed shapes: each query's [ITM] + text row is
    projected once for the first layer and shared by its candidates; padded text positions
    are masked out of every key; the last layer updates the [ITM] row alone. Equal to
    `JointModel.itm_logits` (fp32: to ~1e-5)."""

    def __init__(self, model: JointModel, dtype: torch.dtype) -> None:
        self.dtype = dtype
        heads = model.cfg.n_heads

        def cast(t: torch.Tensor) -> torch.Tensor:
            return t.detach().to(dtype).contiguous()

        self.layers = [_Layer(layer, heads, dtype) for layer in model.fusion.layers]
        self.itm = cast(model.itm_token)
        self.type_text = cast(model.type_embed[0])
        self.image_add = cast(model.type_embed[1] + model.fusion_pos)  # (1, T, d)
        norm = model.fusion_norm
        self.norm = (cast(norm.weight), cast(norm.bias), norm.eps)
        lin1, lin2 = model.itm_head[0], model.itm_head[2]
        assert isinstance(lin1, nn.Linear) and isinstance(lin2, nn.Linear)
        self.head1 = (cast(lin1.weight), cast(lin1.bias))
        self.head2 = (cast(lin2.weight), cast(lin2.bias))
        self.d = model.cfg.d_model

    def logits(
        self, text: torch.Tensor, keep: torch.Tensor, owner: torch.Tensor, img: torch.Tensor
    ) -> torch.Tensor:
        """(P,) float32 logits. `text` (B, L, d) text states, `keep` (B, L) True at real
        positions; pair p reads query `owner[p]` with image states `img[p]` (P, T, d)."""
        b = text.shape[0]
        pairs, n_img, _ = img.shape
        head = torch.cat([self.itm.expand(b, 1, -1), text.to(self.dtype) + self.type_text], 1)
        x_img = img.to(self.dtype) + self.image_add
        real = torch.ones(b, 1, dtype=torch.bool, device=text.device)
        head_keep = torch.cat([real, keep], 1)  # (B, 1 + L)
        img_keep = torch.ones(pairs, n_img, dtype=torch.bool, device=text.device)
        mask = torch.cat([head_keep[owner], img_keep], 1)[:, None, None, :]  # (P, 1, 1, S)
        first = self.layers[0]
        qkv = torch.cat(
            [first.project(first.norm1(head))[owner], first.project(first.norm1(x_img))], 1
        )
        q, k, v = qkv.chunk(3, dim=-1)
        x = torch.cat([head[owner], x_img], 1)
        if len(self.layers) == 1:
            x = first.attend(x[:, :1], q[:, :1], k, v, mask)
        else:
            x = first.attend(x, q, k, v, mask)
            for layer in self.layers[1:-1]:
                x = layer.full(x, mask)
            x = self.layers[-1].last(x, mask)
        h = F.layer_norm(x[:, 0], (self.d,), self.norm[0], self.norm[1], eps=self.norm[2])
        out = F.linear(F.gelu(F.linear(h, *self.head1)), *self.head2)
        return out.squeeze(-1).float()
