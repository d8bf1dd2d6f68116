"""Lizard's branch inputs for passes without gradients: Hedgehog features and the window's rotation.

In PyTorch a layer's phi(q), phi(k) and rotated q, k are ~25 kernels (casts, per-head einsums, two
softmaxes, negations, concatenations, `repeat_kv`, the rotation's halves): at a decode step their
launches cost more than the arithmetic, and in a prefill each is a full pass over [B, H, L, d] in
float32. Here one kernel, `_features_kernel`, does all four, a program per batch row, query head and
block of tokens: x W on tensor cores for blocks of 64 tokens (prefills; one pass where x and the
weights share a 16-bit dtype), on CUDA cores for one token (decode steps, any power-of-two sizes). A
KV head's rotated key is written by the first of its query heads. `HedgehogFeatureMap` and
`attention.base.rotate` are the references.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..gla_window.triton import INTERPRET

if INTERPRET:
    from .. import _interpreter

    _interpreter.patch()

# Rows of a prefill block. At 16 (tl.dot's smallest) each program had too little work to hide its
# latency: in stage 1's profile (batch 8 x 2K, 9,216 programs a layer) the kernel ran at ~1/5 of the
# bandwidth its bytes need. `lizard_features(block=...)` takes another power of two >= 16 (A/B timings).
TOKENS_PER_PROGRAM = 64


def tokens_per_program(block: int | None = None) -> int:
    block = TOKENS_PER_PROGRAM if block is None else block
    if block < 16 or block & (block - 1):
        raise ValueError(f"a features block must be a power of two >= 16, got {block}")
    return block


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
def _features_block(q, k, W_q, W_k, cos, sin, fq, fk, qw, kw, L, first, b, h, bh,
                    sq_b, sq_h, sq_l, sk_b, sk_h, sk_l, sc_b, sc_l,
                    H: tl.constexpr, N_REP: tl.constexpr, D: tl.constexpr, F: tl.constexpr, BL: tl.constexpr,
                    ROPE: tl.constexpr, DOT: tl.constexpr, NATIVE: tl.constexpr):
    """The four outputs for tokens first..first+BL of batch row b, query head h (bh = b H + h), given
    the head's weights W_q, W_k [D, F] (float32 unless NATIVE)."""
    hk = h // N_REP
    d, f = tl.arange(0, D), tl.arange(0, F)
    rows = first + tl.arange(0, BL)
    live = rows < L
    q_at = q + b * sq_b + h * sq_h + rows[:, None] * sq_l
    k_at = k + b * sk_b + hk * sk_h + rows[:, None] * sk_l
    x_q = tl.load(q_at + d[None, :], mask=live[:, None], other=0.0)
    x_k = tl.load(k_at + d[None, :], mask=live[:, None], other=0.0)
    if NATIVE:
        u_q = tl.dot(x_q, W_q)
        u_k = tl.dot(x_k, W_k)
    else:
        x_q, x_k = x_q.to(tl.float32), x_k.to(tl.float32)
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
        tl.store(qw + out, _rotate(x_q.to(tl.float32), q_partner, c, s, d, D), mask=live[:, None])
        if h % N_REP == 0:
            k_partner = tl.load(k_at + partner[None, :], mask=live[:, None], other=0.0).to(tl.float32)
            out = (b * (H // N_REP) + hk) * L * D + rows[:, None] * D + d[None, :]
            tl.store(kw + out, _rotate(x_k.to(tl.float32), k_partner, c, s, d, D), mask=live[:, None])


@triton.jit
def _features_kernel(q, k, w_q, w_k, cos, sin, fq, fk, qw, kw, L,
                     sq_b, sq_h, sq_l, sk_b, sk_h, sk_l, sc_b, sc_l,
                     H: tl.constexpr, N_REP: tl.constexpr, D: tl.constexpr, F: tl.constexpr, BL: tl.constexpr,
                     ROPE: tl.constexpr, DOT: tl.constexpr, NATIVE: tl.constexpr, WALK: tl.constexpr):
    """Grid (B*H, P). q, k with the given strides (the last one 1); outputs contiguous, in their own
    dtype: fq, fk [B, H, L, 2F], qw [B, H, L, D], kw [B, H_kv, L, D]. WALK: program p takes blocks p,
    p + P, ... of BL tokens with the head's weights loaded once for them all; else P is the number of
    blocks and each program takes its own. DOT: x W on tensor cores, else as a broadcast sum in
    float32 (one-token blocks, small F). NATIVE (x and W in one 16-bit dtype): one tensor-core pass on
    them as they are, exact products accumulated in float32; otherwise both in float32 through 3xTF32
    (about float32 accuracy)."""
    bh = tl.program_id(0).to(tl.int64)  # offsets such as bh * L * 2F pass 2^31 at long prefills
    b, h = bh // H, bh % H
    d, f = tl.arange(0, D), tl.arange(0, F)
    weights = h * D * F + d[:, None] * F + f[None, :]
    W_q = tl.load(w_q + weights)
    W_k = tl.load(w_k + weights)
    if not NATIVE:
        W_q, W_k = W_q.to(tl.float32), W_k.to(tl.float32)
    if WALK:
        for first in range(tl.program_id(1) * BL, L, tl.num_programs(1) * BL):
            _features_block(q, k, W_q, W_k, cos, sin, fq, fk, qw, kw, L, first, b, h, bh,
                            sq_b, sq_h, sq_l, sk_b, sk_h, sk_l, sc_b, sc_l, H, N_REP, D, F, BL, ROPE, DOT, NATIVE)
    else:
        _features_block(q, k, W_q, W_k, cos, sin, fq, fk, qw, kw, L, tl.program_id(1) * BL, b, h, bh,
                        sq_b, sq_h, sq_l, sk_b, sk_h, sk_l, sc_b, sc_l, H, N_REP, D, F, BL, ROPE, DOT, NATIVE)


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


# Elements of one [d, f] weight a program may hold: 128 x 128 (two float32 maps, 128 KiB); at 256 x 128 the
# kernel asked an H200 for 256 KiB of shared memory, above its 227 KiB.
MAX_WEIGHT_ELEMENTS = 128 * 128


def features_unsupported(q, k, w_q) -> str | None:
    """What keeps `lizard_features` from these inputs, or None."""
    D, F = w_q.shape[1], w_q.shape[2]
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16) or k.dtype != q.dtype:
        return "q and k must share a float dtype"
    if D & (D - 1) or F & (F - 1) or D < 2:
        return "head and feature dims must be powers of two"
    if q.shape[2] > 1 and min(D, F) < 16:
        return "a block of tokens needs head and feature dims >= 16 (tensor-core tiles)"
    if D * F > MAX_WEIGHT_ELEMENTS:
        return (f"head dim {D} x feature dim {F}: a program holds both maps' [d, f] weights, above the GPU's "
                f"shared memory past {MAX_WEIGHT_ELEMENTS} elements each (Gemma 3's head dim 256 at f = 128)")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        return "q and k need unit stride in the head dim"
    return None


def lizard_features(q, k, w_q, w_k, position_embeddings=None, dtype=torch.float32, block: int | None = None,
                    programs: int | None = None):
    """(fq, fk, qw, kw) in `dtype` for q [B, H, L, d] and k [B, H_kv, L, d] (any strides but the last;
    computed in float32 from any float dtype): `HedgehogFeatureMap` with weights w_q and w_k [H, d, f]
    on q and on each query head's KV head, and, given `position_embeddings` (cos, sin) [B or 1, L, d],
    `rotate(q, k, ...)` (else qw, kw are q, k in `dtype`). Taking the projections' bf16 q, k and giving
    the kernels' bf16 operands saves a prefill two float32 round trips per tensor. `block`: tokens a
    block of a prefill (default TOKENS_PER_PROGRAM); `programs`: programs per batch row and head,
    each walking its share of the blocks with the weights loaded once (default: a program a block;
    walking holds the weights across blocks, which spills registers, `experiments.kernel_resources`).
    Both for A/B timings: neither changes the results."""
    B, H, L, D = q.shape
    HKV, F = k.shape[1], w_q.shape[-1]
    fq = torch.empty(B, H, L, 2 * F, device=q.device, dtype=dtype)
    fk = torch.empty_like(fq)
    rope = position_embeddings is not None
    qw = torch.empty(B, H, L, D, device=q.device, dtype=dtype) if rope else q.to(dtype)
    kw = torch.empty(B, HKV, L, D, device=q.device, dtype=dtype) if rope else k.to(dtype)
    cos, sin = (_unit_last(t.expand(B, L, D)) for t in position_embeddings) if rope else (q[:, 0], q[:, 0])
    BL = 1 if L == 1 else tokens_per_program(block)
    native = BL > 1 and q.dtype in (torch.bfloat16, torch.float16) and w_q.dtype == w_k.dtype == q.dtype
    blocks = triton.cdiv(L, BL)
    if programs is not None and programs < 1:
        raise ValueError(f"programs per head must be >= 1, got {programs}")
    P = blocks if programs is None else min(programs, blocks)
    _features_kernel[(B * H, P)](
        q, k, w_q.contiguous(), w_k.contiguous(), cos, sin, fq, fk, qw, kw, L,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), cos.stride(0), cos.stride(1),
        H=H, N_REP=H // HKV, D=D, F=F, BL=BL, ROPE=rope, DOT=BL > 1, NATIVE=native, WALK=P < blocks, num_warps=4)
    return fq, fk, qw, kw


BWD_TOKENS_PER_PROGRAM = 64  # rows of a backward block; fewer blocks, fewer partial weight gradients
# Columns of x and W a backward program holds at once: at d = 128, the whole [64, 128] x and [128, f] W
# tiles (float32, split for 3xTF32) beside the softmax's gradient spill in stage 2 and fit fewer programs
# an SM in stage 1 (`python -m experiments.kernel_resources` compares the two).
BWD_COLUMNS = 64
BWD_WARPS = 4


@triton.jit
def _signed_softmax_grad(u, g_at, rows, live, f, F: tl.constexpr):
    """d u for phi = [softmax(u), softmax(-u)], given u [R, F] and d phi at `g_at` [., 2F] rows `rows`."""
    up = tl.exp(u - tl.max(u, axis=1)[:, None])
    up = up / tl.sum(up, axis=1)[:, None]
    down = tl.exp(tl.min(u, axis=1)[:, None] - u)
    down = down / tl.sum(down, axis=1)[:, None]
    at = g_at + rows[:, None] * (2 * F) + f[None, :]
    g_up = tl.load(at, mask=live[:, None], other=0.0).to(tl.float32)
    g_down = tl.load(at + F, mask=live[:, None], other=0.0).to(tl.float32)
    return (up * (g_up - tl.sum(g_up * up, axis=1)[:, None])
            - down * (g_down - tl.sum(g_down * down, axis=1)[:, None]))


@triton.jit
def _rotation_grad(g_at, c_at, s_at, rows, live, d, D: tl.constexpr):
    """d x from d (x cos + rotate_half(x) sin) at `g_at` [., D], rows `rows`, columns `d`."""
    g = tl.load(g_at + rows[:, None] * D + d[None, :], mask=live[:, None], other=0.0).to(tl.float32)
    partner = (d + D // 2) % D
    c = tl.load(c_at + d[None, :], mask=live[:, None], other=0.0).to(tl.float32)
    s_partner = tl.load(s_at + partner[None, :], mask=live[:, None], other=0.0).to(tl.float32)
    g_partner = tl.load(g_at + rows[:, None] * D + partner[None, :], mask=live[:, None], other=0.0).to(tl.float32)
    # rotate_half's transpose: x[e] gets sign(p(e)) s[p(e)] g[p(e)], p(e) = e +- D/2 and sign(p(e)) = -sign(e),
    # which is the forward rotation of g with -s[p(e)] in place of s[e].
    return _rotate(g, g_partner, c, -s_partner, d, D)


@triton.jit
def _x_columns(x_at, sx_l, rows, live, d):
    """Columns `d` of the rows `rows` of x (q or k, row stride `sx_l`), float32."""
    return tl.load(x_at + rows[:, None] * sx_l + d[None, :], mask=live[:, None], other=0.0).to(tl.float32)


@triton.jit
def _w_columns(w_at, d, f, F: tl.constexpr):
    """Rows `d` (the input columns) of a head's [D, F] weight, float32."""
    return tl.load(w_at + d[:, None] * F + f[None, :]).to(tl.float32)


@triton.jit
def _features_bwd_kernel(q, k, w_q, w_k, cos, sin, dfq, dfk, dqw, dkw, dq, dk, dw_q, dw_k, L, NB,
                         sq_b, sq_h, sq_l, sk_b, sk_h, sk_l, sc_b, sc_l,
                         H: tl.constexpr, N_REP: tl.constexpr, D: tl.constexpr, F: tl.constexpr,
                         BL: tl.constexpr, BD: tl.constexpr, ROPE: tl.constexpr, GRAD_X: tl.constexpr,
                         GRAD_W: tl.constexpr):
    """Grid (B*H, NB = cdiv(L, BL), 2): `_features_kernel`'s backward for one query head's phi_q (axis 2
    = 0) or phi_k (1, from its KV head's k) over a block of tokens, `BD` columns of x and W at a time:
    u = x W over the column blocks, its gradient d u, then each column block's gradients. Gradients in,
    contiguous: dfq, dfk [B, H, L, 2F] and, with ROPE, dqw [B, H, L, D], dkw [B, H_kv, L, D]. Out, float32
    and contiguous: with GRAD_X, dq [B, H, L, D] and dk [B, H, L, D] per query head (the caller sums a
    group's; the rotation's term goes to the group's first head); with GRAD_W, each block's share of
    the weights' gradients, dw_q, dw_k [B, H, NB, D, F] (summed over batch and blocks afterwards)."""
    bh = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    side = tl.program_id(2)
    b, h = bh // H, bh % H
    hk = h // N_REP
    rows = blk * BL + tl.arange(0, BL)
    live = rows < L
    f = tl.arange(0, F)
    if side == 0:
        x_at, sx_l, w, g_at = q + b * sq_b + h * sq_h, sq_l, w_q, dfq
        dx, dw, drot = dq, dw_q, dqw + bh * L * D
    else:
        x_at, sx_l, w, g_at = k + b * sk_b + hk * sk_h, sk_l, w_k, dfk
        dx, dw, drot = dk, dw_k, dkw + (b * (H // N_REP) + hk) * L * D
    rotated_here = (side == 0) | (h % N_REP == 0)  # a KV head's rotation: once, not once a query head
    w_at = w + h * D * F
    u = tl.zeros([BL, F], dtype=tl.float32)
    for start in tl.static_range(0, D, BD):
        d = start + tl.arange(0, BD)
        x, W = _x_columns(x_at, sx_l, rows, live, d), _w_columns(w_at, d, f, F)
        u += tl.dot(x, W, input_precision="tf32x3")
    du = _signed_softmax_grad(u, g_at + bh * L * 2 * F, rows, live, f, F)
    # Each column block's x and W are loaded again rather than held from the first loop: the registers
    # are what the column blocks are for.
    for start in tl.static_range(0, D, BD):
        d = start + tl.arange(0, BD)
        if GRAD_W:
            part = (bh * NB + blk) * D * F + d[:, None] * F + f[None, :]
            x = _x_columns(x_at, sx_l, rows, live, d)
            tl.store(dw + part, tl.dot(tl.trans(x), du, input_precision="tf32x3"))
        if GRAD_X:
            d_x = tl.dot(du, tl.trans(_w_columns(w_at, d, f, F)), input_precision="tf32x3")
            if ROPE:  # noqa: SIM102 (a constexpr, compiled out, then a value known at run time)
                if rotated_here:  # its pointers formed here: held across the loop they cost registers
                    c_at, s_at = cos + b * sc_b + rows[:, None] * sc_l, sin + b * sc_b + rows[:, None] * sc_l
                    d_x += _rotation_grad(drot, c_at, s_at, rows, live, d, D)
            tl.store(dx + bh * L * D + rows[:, None] * D + d[None, :], d_x, mask=live[:, None])


class LizardFeaturesFunction(torch.autograd.Function):
    """`lizard_features` with gradients for q, k and the two weights (training): the forward kernel,
    then `_features_bwd_kernel`, which recomputes x W rather than storing phi's inputs. Returns
    (fq, fk, qw, kw) given cos and sin, else (fq, fk): the window then takes q and k themselves."""

    @staticmethod
    def forward(ctx, q, k, w_q, w_k, cos, sin, dtype):
        rope = cos is not None
        fq, fk, qw, kw = lizard_features(q, k, w_q, w_k, (cos, sin) if rope else None, dtype)
        ctx.save_for_backward(q, k, w_q, w_k, *((cos, sin) if rope else ()))
        ctx.rope, ctx.dtype = rope, dtype
        if rope and not (ctx.needs_input_grad[0] or ctx.needs_input_grad[1]):
            # qw, kw depend on q and k alone: with those frozen (stage 1), the attention's backward then
            # skips their gradients (`LizardAttentionFunction` reads needs_input_grad).
            ctx.mark_non_differentiable(qw, kw)
        ctx.set_materialize_grads(False)  # no zero tensors for outputs that got no gradient
        return (fq, fk, qw, kw) if rope else (fq, fk)

    @staticmethod
    def backward(ctx, dfq, dfk, *d_rotated):
        q, k, w_q, w_k, *position = ctx.saved_tensors
        B, H, L, D = q.shape
        HKV, F = k.shape[1], w_q.shape[-1]
        grad_x = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        grad_w = ctx.needs_input_grad[2] or ctx.needs_input_grad[3]

        def dense(grad, *shape):  # an output that got no gradient
            return torch.zeros(shape, device=q.device, dtype=ctx.dtype) if grad is None else grad.contiguous()

        dfq, dfk = dense(dfq, B, H, L, 2 * F), dense(dfk, B, H, L, 2 * F)
        NB = triton.cdiv(L, BWD_TOKENS_PER_PROGRAM)
        f32 = {"device": q.device, "dtype": torch.float32}
        unused = dfq  # a placeholder where the kernel reads or writes nothing
        dq = torch.empty(B, H, L, D, **f32) if grad_x else unused
        dk = torch.empty(B, H, L, D, **f32) if grad_x else unused  # per query head, summed below
        dw_q = torch.empty(B, H, NB, D, F, **f32) if grad_w else unused
        dw_k = torch.empty_like(dw_q) if grad_w else unused
        cos, sin = (_unit_last(t.expand(B, L, D)) for t in position) if ctx.rope else (unused, unused)
        # Read only with GRAD_X (through the rotation).
        dqw, dkw = (dense(d_rotated[0], B, H, L, D), dense(d_rotated[1], B, HKV, L, D)) if ctx.rope and grad_x \
            else (unused, unused)
        _features_bwd_kernel[(B * H, NB, 2)](
            q, k, w_q.contiguous(), w_k.contiguous(), cos, sin, dfq, dfk, dqw, dkw,
            dq, dk, dw_q, dw_k, L, NB, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            cos.stride(0), cos.stride(1), H=H, N_REP=H // HKV, D=D, F=F, BL=BWD_TOKENS_PER_PROGRAM,
            BD=min(D, BWD_COLUMNS), ROPE=ctx.rope, GRAD_X=grad_x, GRAD_W=grad_w, num_warps=BWD_WARPS)
        dq, dk = (dq.to(q.dtype), dk.view(B, HKV, H // HKV, L, D).sum(2).to(k.dtype)) if grad_x else (None, None)
        dw_q, dw_k = (dw_q.sum((0, 2)).to(w_q.dtype), dw_k.sum((0, 2)).to(w_k.dtype)) if grad_w else (None, None)
        return dq, dk, dw_q, dw_k, None, None, None
