"""One GEMM where a decoder layer runs several on the same input: q, k and v of a linearized attention
(with its method's own projections of that input: Lizard's gate), gate_proj and up_proj of the MLP.

A batch-1 decode step reads every weight once; at the Llama-3-8B shape k_proj and v_proj are 8 MB
each, too little to keep the GPU's memory system busy (they ran at ~1.6 TB/s against ~4 TB/s for the
MLP's, docs/benchmarks.md), and each projection is its own launch. Fused, each layer reads one
[q; k; v] and one [gate; up] weight. The original weights become views into the fused ones, so fusing
costs no memory; `undo` gives them their own storage back. While fused, the model is for inference:
undo before training, moving or saving it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .attention.base import LinearizedAttention


class FusedProjection:
    """[W_1; W_2; ...] (and biases) of plain Linear layers on one input; `split(x)` gives each one's output."""

    def __init__(self, linears: list[nn.Linear]):
        self.linears = linears
        self.sizes = [m.out_features for m in linears]
        self.weight = torch.cat([m.weight.detach() for m in linears])
        has_bias = any(m.bias is not None for m in linears)
        self.bias = torch.cat([m.bias.detach() if m.bias is not None else self.weight.new_zeros(m.out_features)
                               for m in linears]) if has_bias else None
        for m, weight, bias in zip(linears, self.weight.split(self.sizes), self._bias_parts(), strict=True):
            m.weight.data = weight
            if m.bias is not None:
                m.bias.data = bias

    def _bias_parts(self) -> list[torch.Tensor | None]:
        return list(self.bias.split(self.sizes)) if self.bias is not None else [None] * len(self.sizes)

    def split(self, x: torch.Tensor, head: int | None = None) -> tuple:
        """Each layer's output; with `head`, the first `head` of them, then a tuple of the rest."""
        outputs = nn.functional.linear(x, self.weight, self.bias).split(self.sizes, dim=-1)
        return outputs if head is None else (*outputs[:head], outputs[head:])

    def undo(self) -> None:
        for m in self.linears:
            m.weight.data = m.weight.data.clone()
            if m.bias is not None:
                m.bias.data = m.bias.data.clone()


class FusedGatedMLP(nn.Module):
    """Llama/Mistral/Qwen2's MLP, down(act(gate x) * up x), with gate and up in one GEMM. It keeps the
    MLP's modules under their names, so the model's parameters and state dict read as before."""

    def __init__(self, mlp: nn.Module):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj, self.act_fn = mlp.gate_proj, mlp.up_proj, mlp.down_proj, mlp.act_fn
        self.gate_up = FusedProjection([mlp.gate_proj, mlp.up_proj])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up.split(x)
        return self.down_proj(self.act_fn(gate) * up)


def fusable(linears: list[nn.Module | None]) -> bool:
    """Plain Linear layers (not peft's LoRA layers, not quantized ones, none that accelerate offloads
    or hooks) on one device, in one dtype."""
    if not all(type(m) is nn.Linear and not hasattr(m, "_hf_hook") and not m._forward_pre_hooks
               and not m._forward_hooks for m in linears):
        return False
    return len({(m.weight.device, m.weight.dtype) for m in linears}) == 1


def fuse_projections(model) -> Callable[[], None] | None:
    """Fuse each decoder layer's q/k/v (linearized attention layers) and gate/up (MLP) in place;
    returns the function that undoes it, or None where nothing was fused. Layers already fused, or
    whose projections are not plain Linear layers, are left as they are."""
    undos: list[Callable[[], None]] = []
    for layer in model.get_decoder().layers:
        attention = layer.self_attn
        qkv = [attention.q_proj, attention.k_proj, attention.v_proj]
        if isinstance(attention, LinearizedAttention) and attention.fused_qkv is None and fusable(qkv):
            # The method's own input projections join where they can (not in another dtype, say).
            extra = attention.input_projections()
            attention.fused_qkv = FusedProjection(qkv + extra if fusable(qkv + extra) else qkv)

            def unfuse_attention(attention=attention):
                attention.fused_qkv.undo()
                attention.fused_qkv = None

            undos.append(unfuse_attention)
        mlp = layer.mlp
        gated = all(hasattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj", "act_fn"))
        if gated and not isinstance(mlp, FusedGatedMLP) and fusable([mlp.gate_proj, mlp.up_proj]):
            layer.mlp = FusedGatedMLP(mlp)

            def unfuse_mlp(layer=layer, original=mlp):
                layer.mlp.gate_up.undo()
                layer.mlp = original

            undos.append(unfuse_mlp)

    def undo() -> None:
        for step in reversed(undos):
            step()
        undos.clear()

    return undo if undos else None


def projections_fused(model) -> bool:
    """Whether any decoder layer of `model` runs fused projections."""
    return any(getattr(layer.self_attn, "fused_qkv", None) is not None or isinstance(layer.mlp, FusedGatedMLP)
               for layer in model.get_decoder().layers)
