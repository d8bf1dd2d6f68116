"""One decode step of Lizard-family attention in two Triton kernels (`naive.gla_window_recurrent_step` is the reference).

A step in PyTorch is dozens of small kernels per layer (state update, window concatenation, scores,
softmax with sinks, combine); under a CUDA graph their launches, not their arithmetic, set the step
time. Here `_step_kernel` (one program per batch row and query head) updates S and z, reads out the
linear part and the window softmax with its sinks and mixes them (or divides both numerators by one
shared normaliser); `_shift_window_kernel` (one program per batch row and KV head) then drops the
oldest window key/value and appends the new one.
Both write new tensors, or with `in_place` the state's own: each program reads its whole block of
S, z or the window before it writes it, and the step kernel runs before the shift.
The state and the features are float32; v, the window's q and k, the sinks and alpha may come in
the model's dtype, and y goes out in the one asked for: the kernels convert as they load and store,
so a bf16 model's step launches no casts around them (four a layer, each a launch under the graph).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .options import GlaWindowOptions
from .triton import INTERPRET

if INTERPRET:
    from .. import _interpreter

    _interpreter.patch()


@triton.jit
def _step_kernel(fq, fk, log_g, qw, kw, v, valid, S, z, win_k, win_v, win_valid, sinks, alpha,
                 y, S_out, z_out, scale, beta, eps,
                 H: tl.constexpr, N_REP: tl.constexpr, F: tl.constexpr, D: tl.constexpr, W1: tl.constexpr,
                 BW: tl.constexpr, M: tl.constexpr, BM: tl.constexpr, VEC: tl.constexpr, NORM: tl.constexpr,
                 SHARED: tl.constexpr):
    bh = tl.program_id(0)
    b, h = bh // H, bh % H
    bkv = b * (H // N_REP) + h // N_REP
    f, d, w = tl.arange(0, F), tl.arange(0, D), tl.arange(0, BW)

    keep = (tl.load(valid + b) != 0).to(tl.float32)
    if VEC:
        gamma = tl.exp(tl.load(log_g + bh * F + f) * keep)
        gamma_rows = gamma[:, None]
    else:
        gamma = tl.exp(tl.load(log_g + bh) * keep)
        gamma_rows = gamma
    phi_k = tl.load(fk + bh * F + f).to(tl.float32) * keep
    v_new = tl.load(v + bkv * D + d).to(tl.float32)
    state = gamma_rows * tl.load(S + bh * F * D + f[:, None] * D + d[None, :]) + phi_k[:, None] * v_new[None, :]
    zs = gamma * tl.load(z + bh * F + f) + phi_k
    tl.store(S_out + bh * F * D + f[:, None] * D + d[None, :], state)
    tl.store(z_out + bh * F + f, zs)
    phi_q = tl.load(fq + bh * F + f).to(tl.float32)
    gla = tl.sum(phi_q[:, None] * state, axis=0)
    gla_den = tl.sum(phi_q * zs, axis=0)

    # Window: the carried W1 keys (rows 0..W1-1), then the new one (row W1).
    old = w < W1
    is_new = w == W1
    rows = bkv * W1 * D + w[:, None] * D + d[None, :]
    k_new = tl.load(kw + bkv * D + d).to(tl.float32)
    keys = tl.load(win_k + rows, mask=old[:, None], other=0.0) + tl.where(is_new[:, None], k_new[None, :], 0.0)
    carried = tl.load(win_valid + b * W1 + w, mask=old, other=0).to(tl.float32)
    seen = tl.where(is_new, keep, carried) > 0
    q = tl.load(qw + bh * D + d).to(tl.float32)
    scores = tl.where(seen, tl.sum(keys * q[None, :], axis=1) * scale, float("-inf"))
    top = tl.max(scores, axis=0)
    if M > 0:
        t = tl.load(sinks + h * M + tl.arange(0, BM), mask=tl.arange(0, BM) < M, other=float("-inf")).to(tl.float32)
        top = tl.maximum(top, tl.max(t, axis=0))
    top = tl.where(top > float("-inf"), top, 0.0)  # nothing to attend to: zeros, not NaN
    weights = tl.exp(scores - top)
    den = tl.sum(weights, axis=0)
    if M > 0:
        den += tl.sum(tl.exp(t - top), axis=0)
    values = tl.load(win_v + rows, mask=old[:, None], other=0.0) + tl.where(is_new[:, None], v_new[None, :], 0.0)
    win = tl.sum(weights[:, None] * values, axis=0)
    if SHARED:  # one normaliser: both numerators over both denominators (the window's relative to top)
        out = (win + gla) / (den + gla_den + eps)
    else:
        if NORM:
            gla = gla / (gla_den + eps)
        out = beta * gla + tl.load(alpha + h).to(tl.float32) * win / tl.where(den > 0, den, 1.0)
    tl.store(y + bh * D + d, out.to(y.dtype.element_ty))


@triton.jit
def _shift_window_kernel(kw, v, valid, win_k, win_v, win_valid, k_out, v_out, valid_out,
                         HKV: tl.constexpr, D: tl.constexpr, W1: tl.constexpr, BW: tl.constexpr):
    bkv = tl.program_id(0)
    b = bkv // HKV
    d, w = tl.arange(0, D), tl.arange(0, BW)
    rows = w < W1
    from_old = rows & (w + 1 < W1)
    is_new = (w + 1 == W1)[:, None]
    src = bkv * W1 * D + (w[:, None] + 1) * D + d[None, :]
    dst = bkv * W1 * D + w[:, None] * D + d[None, :]
    k_new = tl.load(kw + bkv * D + d).to(tl.float32)
    v_new = tl.load(v + bkv * D + d).to(tl.float32)
    keys = tl.load(win_k + src, mask=from_old[:, None], other=0.0) + tl.where(is_new, k_new[None, :], 0.0)
    values = tl.load(win_v + src, mask=from_old[:, None], other=0.0) + tl.where(is_new, v_new[None, :], 0.0)
    tl.store(k_out + dst, keys, mask=rows[:, None])
    tl.store(v_out + dst, values, mask=rows[:, None])
    if bkv % HKV == 0:  # the validity row is shared by the KV heads: one program writes it
        shifted = tl.load(win_valid + b * W1 + w + 1, mask=from_old, other=0)
        shifted = tl.where(w + 1 == W1, tl.load(valid + b), shifted)
        tl.store(valid_out + b * W1 + w, shifted, mask=rows)


def step_unsupported(fq, log_g, state, *, window) -> str | None:
    """What keeps the step kernels from inputs the fused kernels take (`lizard_triton.supports`), or None."""
    if fq.shape[2] != 1:
        return "a step takes one token"
    if window < 2:
        return "window < 2 carries no keys"
    if any(t.dtype != torch.float32 for t in (fq, log_g, state["S"], state["z"], state["win_k"], state["win_v"])):
        return "the step runs on float32 features, gate and state"
    return None


def lizard_decode_step(fq, fk, log_g, qw, kw, v, valid, state, options: GlaWindowOptions, *, in_place=False,
                       out_dtype=torch.float32):
    """`gla_window_recurrent_step` in two kernels: (y [B, H, 1, d] in `out_dtype`, new state): new
    tensors, or with `in_place` the state's own (where contiguous), written over."""
    window, sinks, alpha = options.window, options.sinks, options.alpha
    B, H, _, F = fq.shape
    HKV, D = kw.shape[1], qw.shape[-1]
    W1 = window - 1
    fq, fk, log_g, qw, kw, v = (t.contiguous() for t in (fq, fk, log_g, qw, kw, v))
    S, z, win_k, win_v = (state[name].contiguous() for name in ("S", "z", "win_k", "win_v"))
    # Bool tensors go to the kernels as they are (Triton reads them as bytes): a `.view(torch.uint8)`
    # here made inductor (torch 2.11) fail to compile the step (`torch.iinfo` of bool).
    valid = valid.contiguous()
    win_valid = state["win_valid"].contiguous()
    y = torch.empty(qw.shape, device=qw.device, dtype=out_dtype)
    if in_place:  # over the contiguous copies where the state's tensors are not contiguous
        S_out, z_out, k_out, v_out, valid_out = S, z, win_k, win_v, win_valid
    else:
        S_out, z_out = torch.empty_like(S), torch.empty_like(z)
        k_out, v_out, valid_out = torch.empty_like(win_k), torch.empty_like(win_v), torch.empty_like(win_valid)
    M = 0 if sinks is None else sinks.shape[-1]
    no_sinks = alpha.new_zeros(1)
    _step_kernel[(B * H,)](
        fq, fk, log_g, qw, kw, v, valid, S, z, win_k, win_v, win_valid,
        no_sinks if sinks is None else sinks.contiguous(), alpha.contiguous(), y, S_out, z_out,
        options.scale, float(options.beta), options.eps, H=H, N_REP=H // HKV, F=F, D=D, W1=W1, BW=triton.next_power_of_2(W1 + 1), M=M,
        BM=triton.next_power_of_2(max(M, 1)), VEC=log_g.shape[-1] != 1, NORM=options.normalize, SHARED=options.shared,
        num_warps=4)
    _shift_window_kernel[(B * HKV,)](
        kw, v, valid, win_k, win_v, win_valid, k_out, v_out, valid_out,
        HKV=HKV, D=D, W1=W1, BW=max(2, triton.next_power_of_2(W1)), num_warps=4)
    return y, {"S": S_out, "z": z_out, "win_k": k_out, "win_v": v_out, "win_valid": valid_out}
