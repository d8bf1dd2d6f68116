"""Lizard's branch inputs for passes without gradients: Hedgehog features and the window's rotation.

In PyTorch a layer's phi(q), phi(k) and rotated q, k are ~25 kernels (casts, per-head einsums, two
softmaxes, negations, concatenations, `repeat_kv`, the rotation's halves): at a decode step their
launches cost more than the arithmetic, and in a prefill each is a full pass over [B, H, L, d] in
float32. Here one kernel, `_features_kernel`, does all four, a program per batch row, query head and
block of tokens: x W on tensor cores for blocks of 16 tokens (prefills), on CUDA cores for one token
(decode steps, any power-of-two sizes). A KV head's rotated key is written by the first of its query
heads. `HedgehogFeatureMap` and `attention.base.rotate` are the references.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .lizard_triton import INTERPRET

if INTERPRET:
    from . import _interpreter

    _interpreter.patch()

TOKENS_PER_PROGRAM = 16  # rows of a prefill block: tl.dot's smallest


@triton.jit
def _signed_softmax_store(u, out, rows, live, f, F: tl.constexpr):
    """[softmax(u), softmax(-u)] of u [R, F], row-wise, into rows `rows` of a [., 2F] matrix."""
    up = tl.exp(u - tl.max(u, axis=1)[:, None])
    down = tl.exp(tl.min(u, axis=1)[:, None] - u)
    at = out + rows[:, None] * (2 * F) + f[None, :]
    tl.store(at, up / tl.sum(up, axis=1)[:, None], mask=live[:, None])
    tl.store(at + F, down / tl.sum(down, axis=1)[:, None], mask=live[:, None])


@triton.jit
def _rotate(x, x_partner, c, s, d, D: tl.constexpr):
    """x cos + rotate_half(x) sin, rotate_half(x) = [-x[D/2:], x[:D/2]] (HF's convention)."""
    return x * c + tl.where(d < D // 2, -1.0, 1.0)[None, :] * x_partner * s


@triton.jit
def _features_kernel(q, k, w_q, w_k, cos, sin, fq, fk, qw, kw, L,
                     sq_b, sq_h, sq_l, sk_b, sk_h, sk_l, sc_b, sc_l,
                     H: tl.constexpr, N_REP: tl.constexpr, D: tl.constexpr, F: tl.constexpr, BL: tl.constexpr,
                     ROPE: tl.constexpr, DOT: tl.constexpr):
    """Grid (B*H, cdiv(L, BL)). q, k with the given strides (the last one 1), read as float32; outputs
    contiguous, in their own dtype: fq, fk [B, H, L, 2F], qw [B, H, L, D], kw [B, H_kv, L, D]. DOT: x W
    on tensor cores (3xTF32, about float32 accuracy), else as a broadcast sum (one-token blocks, small F)."""
    bh = tl.program_id(0).to(tl.int64)  # offsets such as bh * L * 2F pass 2^31 at long prefills
    b, h = bh // H, bh % H
    hk = h // N_REP
    rows = tl.program_id(1) * BL + tl.arange(0, BL)
    live = rows < L
    d, f = tl.arange(0, D), tl.arange(0, F)
    q_at = q + b * sq_b + h * sq_h + rows[:, None] * sq_l
    k_at = k + b * sk_b + hk * sk_h + rows[:, None] * sk_l
    x_q = tl.load(q_at + d[None, :], mask=live[:, None], other=0.0).to(tl.float32)
    x_k = tl.load(k_at + d[None, :], mask=live[:, None], other=0.0).to(tl.float32)
    weights = h * D * F + d[:, None] * F + f[None, :]
    W_q = tl.load(w_q + weights).to(tl.float32)
    W_k = tl.load(w_k + weights).to(tl.float32)
    if DOT:
        u_q = tl.dot(x_q, W_q, input_precision="tf32x3")
        u_k = tl.dot(x_k, W_k, input_precision="tf32x3")
    else:
        u_q = tl.sum(x_q[:, :, None] * W_q[None, :, :], axis=1)
        u_k = tl.sum(x_k[:, :, None] * W_k[None, :, :], axis=1)
    _signed_softmax_store(u_q, fq + bh * L * 2 * F, rows, live, f, F)
    _signed_softmax_store(u_k, fk + bh * L * 2 * F, rows, live, f, F)
    if ROPE:
        partner = (d + D // 2) % D
        at = b * sc_b + rows[:, None] * sc_l + d[None, :]
        c = tl.load(cos + at, mask=live[:, None], other=0.0).to(tl.float32)
        s = tl.load(sin + at, mask=live[:, None], other=0.0).to(tl.float32)
        q_partner = tl.load(q_at + partner[None, :], mask=live[:, None], other=0.0).to(tl.float32)
        out = bh * L * D + rows[:, None] * D + d[None, :]
        tl.store(qw + out, _rotate(x_q, q_partner, c, s, d, D), mask=live[:, None])
        if h % N_REP == 0:
            k_partner = tl.load(k_at + partner[None, :], mask=live[:, None], other=0.0).to(tl.float32)
            out = (b * (H // N_REP) + hk) * L * D + rows[:, None] * D + d[None, :]
            tl.store(kw + out, _rotate(x_k, k_partner, c, s, d, D), mask=live[:, None])


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def features_unsupported(q, k, w_q) -> str | None:
    """What keeps `lizard_features` from these inputs, or None."""
    D, F = w_q.shape[1], w_q.shape[2]
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16) or k.dtype != q.dtype:
        return "q and k must share a float dtype"
    if D & (D - 1) or F & (F - 1) or D < 2:
        return "head and feature dims must be powers of two"
    if q.shape[2] > 1 and min(D, F) < 16:
        return "a block of tokens needs head and feature dims >= 16 (tensor-core tiles)"
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        return "q and k need unit stride in the head dim"
    return None


def lizard_features(q, k, w_q, w_k, position_embeddings=None, dtype=torch.float32):
    """(fq, fk, qw, kw) in `dtype` for q [B, H, L, d] and k [B, H_kv, L, d] (any strides but the last;
    computed in float32 from any float dtype): `HedgehogFeatureMap` with weights w_q and w_k [H, d, f]
    on q and on each query head's KV head, and, given `position_embeddings` (cos, sin) [B or 1, L, d],
    `rotate(q, k, ...)` (else qw, kw are q, k in `dtype`). Taking the projections' bf16 q, k and giving
    the kernels' bf16 operands saves a prefill two float32 round trips per tensor."""
    B, H, L, D = q.shape
    HKV, F = k.shape[1], w_q.shape[-1]
    fq = torch.empty(B, H, L, 2 * F, device=q.device, dtype=dtype)
    fk = torch.empty_like(fq)
    rope = position_embeddings is not None
    qw = torch.empty(B, H, L, D, device=q.device, dtype=dtype) if rope else q.to(dtype)
    kw = torch.empty(B, HKV, L, D, device=q.device, dtype=dtype) if rope else k.to(dtype)
    cos, sin = (_unit_last(t.expand(B, L, D)) for t in position_embeddings) if rope else (q[:, 0], q[:, 0])
    BL = 1 if L == 1 else TOKENS_PER_PROGRAM
    _features_kernel[(B * H, triton.cdiv(L, BL))](
        q, k, w_q.contiguous(), w_k.contiguous(), cos, sin, fq, fk, qw, kw, L,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), cos.stride(0), cos.stride(1),
        H=H, N_REP=H // HKV, D=D, F=F, BL=BL, ROPE=rope, DOT=BL > 1, num_warps=4)
    return fq, fk, qw, kw
