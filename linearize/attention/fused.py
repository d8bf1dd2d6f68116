"""When and how Lizard-family attention (Lizard, Liger) runs on the fused Triton kernel."""

from __future__ import annotations

import os

import torch

from .. import kernels
from ..ops import gla_window


def kernels_enabled() -> bool:
    """LINEARIZE_KERNELS=0 keeps the PyTorch ops everywhere (for A/B timings and debugging)."""
    return os.environ.get("LINEARIZE_KERNELS", "1") != "0"


def kernel_applies(fq, fk, log_g, qw, kw, v, *, window, sinks, valid, start, can_continue) -> bool:
    """A multi-token pass from an empty state whose rows are each one run of tokens (left or right
    padding), or, with `can_continue` and no gradient needed, an unpadded pass continuing a state."""
    if not (kernels_enabled() and fq.shape[2] > 1):
        return False
    if start > 0 and not (can_continue and not torch.is_grad_enabled()):
        return False
    if kernels.unsupported_reason(fq, fk, log_g, qw, kw, v, window=window, sinks=sinks) is not None:
        return False
    return bool(valid.all()) if start > 0 else contiguous(valid)


def first_pass(operands, valid, *, caching: bool, state_inputs, **options):
    """`kernels.lizard_attention` over a pass from an empty state, padding handled: (y float32, new state
    or None). `state_inputs` = (fk, log_g, kw, v) in float32, for the state a cache keeps."""
    # Leading padding is rotated to the end of its row: every real token then sees only real tokens
    # before it (padding after them never reaches them), and the outputs are rotated back.
    lead = (~valid).int().argmin(1) * valid.any(1)
    if bool(lead.any()):
        L = valid.shape[1]
        shift = torch.remainder(torch.arange(L, device=valid.device) + lead[:, None], L)
        y = kernels.lizard_attention(*(rotate_rows(t, shift) for t in operands), **options)
        y = rotate_rows(y, torch.argsort(shift, dim=1))
    else:
        y = kernels.lizard_attention(*operands, **options)
    if not caching:
        return y.float(), None
    return y.float(), gla_window.state_after(*state_inputs, options["window"], valid)


def contiguous(valid: torch.Tensor) -> bool:
    """Whether each row's valid tokens form one run (left padding, right padding or none)."""
    starts = valid[:, :1].int() + (valid[:, 1:] & ~valid[:, :-1]).sum(1, keepdim=True)
    return bool((starts <= 1).all())


def rotate_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [B, H, L, ...] with each row's positions taken in the order `index` [B, L] gives."""
    return x.gather(2, index[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[-1]))
