"""The teacher's RMSNorm as one fused op.

HF's Llama/Mistral/Qwen2 RMSNorm is five elementwise kernels and a float32 copy of its input: at a
decode step that is ~7 launches for each of a model's 2L + 1 norms, in a prefill ~2 GB of memory
traffic per norm per 16K tokens at the Llama-3-8B shape. `torch.nn.functional.rms_norm` is one fused
kernel on CUDA. It computes the same function, rounding once where HF rounds to the input's dtype
before the weight and again after.
"""

from __future__ import annotations

import torch
from torch import nn

# The teachers' norms: weight * x / rms(x), weight initialised to ones, rounded to x's dtype before the
# weight (Gemma's 1 + weight is not one, OLMo-2's rounds after the weight).
RMSNORM_CLASSES = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "Phi3RMSNorm")


class FusedRMSNorm(nn.Module):
    """A drop-in for the teacher's norm, holding its weight (same state-dict key) and epsilon."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.weight = norm.weight
        self.variance_epsilon = norm.variance_epsilon

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.weight.dtype:  # HF's mixed-dtype result: rounded to x's dtype, then scaled and promoted
            xf = x.float()
            return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)).to(x.dtype)
        # As HF's norm, whatever autocast would do with the op: the input's own precision.
        with torch.autocast(device_type=x.device.type, enabled=False):
            return nn.functional.rms_norm(x, self.weight.shape, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


def fuse_norms(model: nn.Module) -> None:
    """Replace every teacher RMSNorm in `model` by `FusedRMSNorm`, in place."""
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if type(child).__name__ in RMSNORM_CLASSES:
                setattr(parent, name, FusedRMSNorm(child))
