"""Lizard's Hedgehog features phi_q(q), phi_k(k) and the window's q, k (RoPE'd or not), in one form.

`lizard_features` lists its implementations in order of preference (`linearize.ops.backend`):
  triton-differentiable  `triton.LizardFeaturesFunction`, where a gradient is needed (training)
  triton                 `triton.lizard_features`, one kernel for all four outputs (inference)
  torch                  `naive.lizard_features_naive`, PyTorch in float32, the reference
tested against each other in values and gradients (tests/kernels/test_features.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import backend
from ..backend import Form, Implementation
from .naive import lizard_features_naive

__all__ = ["FORMS", "lizard_features"]


def lizard_features(q, k, w_q, w_k, position_embeddings=None, dtype=torch.float32):
    """(fq, fk for every query head, qw, kw) for q [B, H, L, d], k [B, H_kv, L, d], weights [H, d, f]
    and RoPE's (cos, sin) or None. Through the kernel where the backend allows it and it takes the
    inputs: multi-token passes in `dtype` (the projections'), single-token steps in float32, as the
    step kernels take them, differentiable where a gradient is needed (training). Elsewhere the
    PyTorch reference, in float32."""
    return FEATURES(_Call(q, k, w_q, w_k, position_embeddings, dtype))


@dataclass(frozen=True, eq=False)
class _Call:
    q: torch.Tensor
    k: torch.Tensor
    w_q: torch.Tensor
    w_k: torch.Tensor
    position_embeddings: tuple | None
    dtype: torch.dtype

    @property
    def training(self) -> bool:
        return torch.is_grad_enabled() and any(t.requires_grad for t in (self.q, self.k, self.w_q, self.w_k))


def _with_grad_supports(call: _Call) -> str | None:
    from .triton import features_unsupported

    if not call.training:
        return "no gradient needed"
    if min(call.q.shape[-1], call.w_q.shape[-1]) < 16:
        return "head dim or feature dim below 16: the backward's tiles"
    return features_unsupported(call.q, call.k, call.w_q)


def features_with_grad(call: _Call):
    """The kernel's differentiable form (`triton.LizardFeaturesFunction`)."""
    from .triton import LizardFeaturesFunction

    cos, sin = call.position_embeddings if call.position_embeddings is not None else (None, None)
    out = LizardFeaturesFunction.apply(call.q, call.k, call.w_q, call.w_k, cos, sin, call.dtype)
    return out if cos is not None else (*out, call.q.to(call.dtype), call.k.to(call.dtype))


def _without_grad_supports(call: _Call) -> str | None:
    from .triton import features_unsupported

    if call.training:
        return "a gradient needed"
    return features_unsupported(call.q, call.k, call.w_q)


@torch.no_grad()
def features_without_grad(call: _Call):
    """The kernel for inference (`triton.lizard_features`)."""
    from .triton import lizard_features as kernel

    return kernel(call.q, call.k, call.w_q, call.w_k, call.position_embeddings,
                  torch.float32 if call.q.shape[2] == 1 else call.dtype)


def _naive(call: _Call):
    return lizard_features_naive(call.q, call.k, call.w_q, call.w_k, call.position_embeddings)


FEATURES = Form("lizard_features", (
    Implementation("triton-differentiable", _with_grad_supports, features_with_grad),
    Implementation("triton", _without_grad_supports, features_without_grad),
    Implementation("torch", backend.always, _naive, kernels=False)))
FORMS = {form.name: form for form in (FEATURES,)}
