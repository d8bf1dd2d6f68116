"""Feature maps phi for linear attention. All act on [batch, heads, tokens, head_dim]."""

from __future__ import annotations

import torch
from torch import nn


def _signed_softmax(u: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.softmax(u, dim=-1), torch.softmax(-u, dim=-1)], dim=-1)


# Tokens per block of the weight gradient's split reduction (`PerHeadProjection`).
GRADIENT_BLOCK = 1024


class PerHeadProjection(torch.autograd.Function):
    """x W_h for every head h: [B, H, L, d] x [H, d, f] -> [B, H, L, f], as `einsum("bhld,hdf->bhlf")`.

    The weight's gradient x_h^T g_h is a few output tiles per head with a reduction over all B*L
    tokens. As one GEMM per head, cuBLAS runs it on a handful of SMs (35 ms of a 141 ms stage-1 step at
    SmolLM2's shape on the H200). Here the tokens are cut into blocks of at most GRADIENT_BLOCK, each
    block's product is one GEMM of a batched call, and the partial sums are added: the same sum
    in a different order, on as many SMs as there are blocks.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return torch.einsum("bhld,hdf->bhlf", x, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = torch.einsum("bhlf,hdf->bhld", grad, weight) if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            H, L = x.shape[1], x.shape[2]
            block = min(L, GRADIENT_BLOCK)
            pad = -L % block  # zero rows add nothing to the sum

            def blocks(t):
                return nn.functional.pad(t, (0, 0, 0, pad)).transpose(0, 1).reshape(H, -1, block, t.shape[-1])

            grad_w = torch.matmul(blocks(x).transpose(-1, -2), blocks(grad)).sum(1)
        return grad_x, grad_w


def per_head_projection(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return PerHeadProjection.apply(x, weight)


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
        return _signed_softmax(per_head_projection(x, self.weight.to(x.dtype)))


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
        return _signed_softmax(u)


class SoftmaxFeatureMap(nn.Module):
    """Liger: phi(x) = softmax(x) over the head dimension, no parameters."""

    def __init__(self, head_dim: int):
        super().__init__()
        self.out_dim = head_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x, dim=-1)
