"""Feature maps phi for linear attention. All act on [batch, heads, tokens, head_dim]."""

from __future__ import annotations

import torch
from torch import nn

from .ops.features.naive import hedgehog, per_head_projection, signed_softmax


def _identity_projection(num_heads: int, head_dim: int, feature_dim: int) -> nn.Parameter:
    # Start from the identity on the first feature_dim coordinates: phi then begins as a softmax over
    # (part of) the teacher's own q/k coordinates, which is already correlated with q.k.
    weight = torch.zeros(num_heads, head_dim, feature_dim)
    eye = torch.eye(head_dim, feature_dim)
    weight[:] = eye
    return nn.Parameter(weight)


class HedgehogFeatureMap(nn.Module):
    """phi(x) = [softmax(x W_h) ++ softmax(-x W_h)], one W_h in R^{d x f} per head (LoLCATs, Lizard)."""

    def __init__(self, num_heads: int, head_dim: int, feature_dim: int):
        super().__init__()
        self.weight = _identity_projection(num_heads, head_dim, feature_dim)
        self.out_dim = 2 * feature_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return hedgehog(x, self.weight)


class NormPreservingFeatureMap(nn.Module):
    """NP-Map (STILL): u = f(x) ||x|| / ||f(x)||, phi(x) = [softmax(u) ++ softmax(-u)].

    f is a learnable Householder reflection x - 2 (x.r) r with unit r, then a linear d -> f map, per
    head. Re-injecting ||x|| keeps the pretrained vector's magnitude, so only the direction is learned.
    """

    def __init__(self, num_heads: int, head_dim: int, feature_dim: int):
        super().__init__()
        self.reflector = nn.Parameter(torch.randn(num_heads, head_dim) / head_dim**0.5)
        self.weight = _identity_projection(num_heads, head_dim, feature_dim)
        self.out_dim = 2 * feature_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = nn.functional.normalize(self.reflector.to(x.dtype), dim=-1)[None, :, None, :]
        reflected = x - 2 * (x * r).sum(-1, keepdim=True) * r
        fx = per_head_projection(reflected, self.weight.to(x.dtype))
        u = fx * x.norm(dim=-1, keepdim=True) / fx.norm(dim=-1, keepdim=True).clamp_min(1e-6)
        return signed_softmax(u)


class SoftmaxFeatureMap(nn.Module):
    """Liger: phi(x) = softmax(x) over the head dimension, no parameters."""

    def __init__(self, head_dim: int):
        super().__init__()
        self.out_dim = head_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x, dim=-1)
