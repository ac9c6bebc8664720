"""A transformer stack at inference without nn.TransformerEncoder's per-call Python checks.

At inference `nn.TransformerEncoderLayer` already runs each layer as one fused kernel
(`torch._transformer_encoder_layer_fwd`), but decides so anew on every call: about twenty
attribute and tensor checks per layer, and as many again in `nn.TransformerEncoder`. For
one short query that bookkeeping is a third of the text tower's time (measured on the 2-core
CPU: one sentence through the text tower and the shared layers in 2.18 ms by the modules,
1.45 ms calling the kernel directly; the same output to the bit). `run_layers` checks once
per stack that the kernel is what the modules would run, then calls it per layer; anywhere
else (training, autograd on, autocast, a layer it cannot take) it calls the modules.

The serving runtime switches it on (`JointModel.serve_kernels`, called by `BuiltinModel`); a
model made for training, and the plain script the benchmarks compare with, run the modules.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

_KERNEL = getattr(torch, "_transformer_encoder_layer_fwd", None)


def _autocast_on(device: torch.device) -> bool:
    try:
        return bool(torch.is_autocast_enabled(device.type))
    except TypeError:  # torch < 2.4: one switch per device kind
        if device.type == "cpu":
            return bool(torch.is_autocast_cpu_enabled())
        return bool(torch.is_autocast_enabled())


def _layer_ok(layer: nn.Module) -> bool:
    """A layer the fused kernel computes exactly as the module would (the conditions
    `nn.TransformerEncoderLayer.forward` checks that do not depend on the input)."""
    if not isinstance(layer, nn.TransformerEncoderLayer):
        return False
    attn = layer.self_attn
    return bool(
        attn.batch_first
        and attn._qkv_same_embed_dim
        and attn.in_proj_bias is not None
        and attn.num_heads % 2 == 0
        and layer.activation_relu_or_gelu in (1, 2)
        and layer.norm1.eps == layer.norm2.eps
        and not any(m._forward_hooks or m._forward_pre_hooks for m in layer.modules())
    )


# stack -> whether each of its layers suits the kernel, judged once (the layers' kind, shape
# and hooks: a hook registered on a layer after the stack's first inference call goes unseen;
# the training switches are read on every call)
_LAYERS_OK: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()


def direct(stack: nn.TransformerEncoder, x: torch.Tensor) -> bool:
    """Whether `run_layers` may call the kernel for `stack` on `x`."""
    if (
        _KERNEL is None
        or torch.is_grad_enabled()
        or stack.training
        or x.dim() != 3
        or x.device.type not in ("cpu", "cuda")
        or stack._forward_hooks
        or stack._forward_pre_hooks
        or not torch.backends.mha.get_fastpath_enabled()
        or torch.is_autocast_enabled()
        or _autocast_on(x.device)
    ):
        return False
    ok = _LAYERS_OK.get(stack)
    if ok is None:
        ok = _LAYERS_OK[stack] = all(_layer_ok(layer) for layer in stack.layers)
    return ok and not any(layer.training for layer in stack.layers)


def run_layers(
    stack: nn.TransformerEncoder,
    x: torch.Tensor,
    pad: torch.Tensor | None = None,
    *,
    kernel: bool = True,
) -> torch.Tensor:
    """`stack(x, src_key_padding_mask=pad)`: the same result, the fused kernel called
    directly at inference when `kernel`. `pad` (B, L) is True at padded positions; no
    host-device sync."""
    if not (kernel and direct(stack, x)):
        return stack(x, src_key_padding_mask=pad)
    assert _KERNEL is not None
    mask = None
    if pad is not None:  # what nn.TransformerEncoder makes of a boolean padding mask
        mask = torch.zeros(pad.shape, dtype=x.dtype, device=x.device).masked_fill_(
            pad, float("-inf")
        )
    for layer in stack.layers:
        a = layer.self_attn
        x = _KERNEL(
            x,
            a.embed_dim,
            a.num_heads,
            a.in_proj_weight,
            a.in_proj_bias,
            a.out_proj.weight,
            a.out_proj.bias,
            layer.activation_relu_or_gelu == 2,
            layer.norm_first,
            layer.norm1.eps,
            layer.norm1.weight,
            layer.norm1.bias,
            layer.norm2.weight,
            layer.norm2.bias,
            layer.linear1.weight,
            layer.linear1.bias,
            layer.linear2.weight,
            layer.linear2.bias,
            mask,
            None if mask is None else 1,  # 1: a key padding mask
        )
    return x if stack.norm is None else stack.norm(x)
