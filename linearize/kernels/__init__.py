"""Fused GPU kernels (Triton). Optional: everything here imports and runs without triton or a GPU.

`lizard_attention` runs the fused Lizard kernel when it can (triton importable, CUDA tensors, or CPU
tensors under TRITON_INTERPRET=1; supported shapes and dtypes) and the chunked PyTorch op otherwise,
with the same results. Design and limits: docs/kernels.md.
"""

from __future__ import annotations

import functools
import os

import torch

from ..ops import gla_window
from ..ops.gla_window_chunked import gla_window_chunked


@functools.cache
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _interpreting() -> bool:
    """TRITON_INTERPRET=1: Triton kernels run on CPU tensors through numpy (slow; for tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def available() -> bool:
    """Whether the Triton kernels can run here: triton importable and a CUDA device or interpreter mode."""
    return _triton_importable() and (torch.cuda.is_available() or _interpreting())


def unsupported_reason(fq, fk, log_g, qw, kw, v, *, window, sinks) -> str | None:
    """None when `lizard_attention` would take the kernel path for these inputs, else why not."""
    if not available():
        return "triton or a CUDA device (or TRITON_INTERPRET=1) missing"
    from .lizard_triton import supports

    return supports(fq, fk, log_g, qw, kw, v, window=window, sinks=sinks)


def lizard_attention(fq, fk, log_g, qw, kw, v, *, window, scale, sinks, alpha, eps=1e-6):
    """Lizard attention from scratch (no carried state, no padding), y [B, H, L, d] in the inputs' dtype.

    y_i = phi_q_i^T S_i / (phi_q_i^T z_i + eps) + alpha_h * softmax window over (i - w, i] with sinks,
    i.e. `gla_window_parallel` with an empty state, all tokens valid, beta = 1, normalize=True,
    shared=False. fq, fk [B,H,L,F]; log_g [B,H,L,1] or [B,H,L,F]; qw [B,H,L,d]; kw, v [B,H_kv,L,d];
    sinks [H, M] or None; alpha [H]. Differentiable in all tensors.
    """
    if unsupported_reason(fq, fk, log_g, qw, kw, v, window=window, sinks=sinks) is None:
        from .lizard_triton import lizard_attention_triton

        return lizard_attention_triton(fq, fk, log_g, qw, kw, v, window=window, scale=scale, sinks=sinks,
                                       alpha=alpha, eps=eps)
    return _chunked(fq, fk, log_g, qw, kw, v, window=window, scale=scale, sinks=sinks, alpha=alpha, eps=eps)


def _chunked(fq, fk, log_g, qw, kw, v, *, window, scale, sinks, alpha, eps):
    # The chunked op mixes its float32 state with the inputs: compute in at least float32.
    dtype = torch.promote_types(qw.dtype, torch.float32)
    B, H, L, F = fq.shape
    state = gla_window.init_state(B, H, kw.shape[1], F, qw.shape[-1], window, device=fq.device, dtype=dtype)
    valid = torch.ones(B, L, dtype=torch.bool, device=fq.device)
    y, _ = gla_window_chunked(*(t.to(dtype) for t in (fq, fk, log_g, qw, kw, v)), valid, state, window=window,
                              scale=scale, sinks=None if sinks is None else sinks.to(dtype), alpha=alpha.to(dtype),
                              beta=1.0, normalize=True, shared=False, eps=eps)
    return y.to(qw.dtype)
