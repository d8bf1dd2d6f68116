"""Lizard's Hedgehog features and window queries/keys in PyTorch: the reference of `triton.py`.

    phi(x) = [softmax(x W_h) ++ softmax(-x W_h)], one W_h in R^{d x f} per head (LoLCATs, Lizard),
    and the window's q, k rotated by RoPE (Llama's rotation) where position embeddings are given.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from ..common import repeat_kv


def signed_softmax(u: torch.Tensor) -> torch.Tensor:
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


def hedgehog(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """phi(x) for x [B, H, L, d] and weight [H, d, f]: [B, H, L, 2f]."""
    return signed_softmax(per_head_projection(x, weight.to(x.dtype)))


def rotate(q: torch.Tensor, k: torch.Tensor, position_embeddings) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE as Llama applies it (transformers' own function): cos, sin [B or 1, L, d] in q's dtype."""
    cos, sin = position_embeddings
    return apply_rotary_pos_emb(q, k, cos.to(q.dtype), sin.to(q.dtype))


def lizard_features_naive(q, k, w_q, w_k, position_embeddings=None):
    """(fq, fk for every query head, qw, kw) in float32."""
    q, k = q.float(), k.float()
    fq = hedgehog(q, w_q)
    fk = hedgehog(repeat_kv(k, q.shape[1] // k.shape[1]), w_k)
    return (fq, fk, *(rotate(q, k, position_embeddings) if position_embeddings is not None else (q, k)))
