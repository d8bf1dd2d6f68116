"""Lizard's Hedgehog features phi_q(q), phi_k(k) and the window's q, k (RoPE'd or not): the one dispatch point.

Forms: `naive.lizard_features_naive` (PyTorch, float32, the reference) and `triton.lizard_features`
(one kernel for all four outputs, with `triton.LizardFeaturesFunction` as its differentiable form),
tested against each other in values and gradients (tests/kernels/test_features.py).
"""

from __future__ import annotations

import torch

from .. import backend
from .naive import lizard_features_naive


def lizard_features(q, k, w_q, w_k, position_embeddings=None, dtype=torch.float32):
    """(fq, fk for every query head, qw, kw) for q [B, H, L, d], k [B, H_kv, L, d], weights [H, d, f]
    and RoPE's (cos, sin) or None. Through the kernel where the backend allows it and it takes the
    inputs: multi-token passes in `dtype` (the projections'), single-token steps in float32, as the
    step kernels take them, differentiable where a gradient is needed (training). Elsewhere the
    PyTorch reference, in float32."""
    if backend.use_kernels():
        training = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, w_q, w_k))
        kernel = features_with_grad if training else features_without_grad
        out = kernel(q, k, w_q, w_k, position_embeddings, dtype)
        if out is not None:
            return out
    return lizard_features_naive(q, k, w_q, w_k, position_embeddings)


def features_with_grad(q, k, w_q, w_k, position_embeddings, dtype):
    """The kernel's differentiable form (`triton.LizardFeaturesFunction`), or None where it does not apply."""
    from .triton import LizardFeaturesFunction, features_unsupported

    if features_unsupported(q, k, w_q) or min(q.shape[-1], w_q.shape[-1]) < 16:  # the backward's tiles
        return None
    cos, sin = position_embeddings if position_embeddings is not None else (None, None)
    out = LizardFeaturesFunction.apply(q, k, w_q, w_k, cos, sin, dtype)
    return out if cos is not None else (*out, q.to(dtype), k.to(dtype))


@torch.no_grad()
def features_without_grad(q, k, w_q, w_k, position_embeddings, dtype):
    """The kernel for inference (`triton.lizard_features`), or None where it does not apply."""
    from .triton import features_unsupported
    from .triton import lizard_features as kernel

    if features_unsupported(q, k, w_q):
        return None
    return kernel(q, k, w_q, w_k, position_embeddings, torch.float32 if q.shape[2] == 1 else dtype)
