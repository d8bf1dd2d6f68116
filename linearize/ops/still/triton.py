"""Triton kernels for STILL's attention over a sequence given each key's fold time: flash-attention
style, one program per block of queries walking the keys, so no [L, L] score or mask is ever stored.
A fresh pass (training, scoring, a prefill) runs them as they are (`still_attention_triton`,
differentiable); a call continuing a state runs the forward over [the state's softmax-visible keys,
the new tokens] (`still_attention_parts`: the output's parts, no autograd), `ops.still` adding the
carried linear state.

Each key j is softmax-visible from its arrival until its fold time E_j (from the routing in
`ops.still.routing`, relative to the pass) and linear after it:

  y_i = (sum_{j <= i < E_j} e^{s_ij - m_i} v_j + g_i * sum_{E_j <= i} (fq_i . fk_j) v_j)
        / (sum_{j <= i < E_j} e^{s_ij - m_i} + sum_{E_j <= i} fq_i . fk_j + eps)

s_ij = q_i . k_j * scale and m_i is the row max over the softmax set. Only the softmax terms carry
that shift (the published form), so y depends on m_i and its gradient goes to the key that holds it.
Reference: `ops.still.naive.still_parallel(fresh=True, keep_state=False)`. Backward: one kernel over
blocks of queries (dq, dfq), one over blocks of keys (dk, dv, dfk), each recomputing the tile's
scores; the per-row terms and d gate are elementwise, in PyTorch.

Importing this module needs triton; the dispatch in `linearize.ops.still` guards that import.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..gla_window.triton import DOT_DTYPES, _dot, _dot_acc, _load_tile, _online_softmax, _store_tile

if os.environ.get("TRITON_INTERPRET") == "1":
    from .. import _interpreter

    _interpreter.patch()

TILE_BYTES = 128  # a tile row of q, k, v or features at most this many bytes: the backward's tiles fit in shared memory
NEVER = 2**30  # fold time of a key that stays softmax-visible (int32)


def block_size(dtype, D, F):
    """Queries and keys per tile: 64 for 16-bit rows of up to 64 values; halved per doubling of a row's bytes
    (float32 with d = 64 at 64 needs 297 KB of shared memory in the backward, the H200 has 227 KB)."""
    block = 64 * TILE_BYTES // (torch.finfo(dtype).bits // 8 * max(D, F))
    return max(16, min(64, block))


# `_fwd_kernel` at 16-bit head dim 128 with up to 128 features (8B-class models have 128): 128 queries a
# program, 64 keys a step, 8 warps, 2 stages. They prefill faster than square tiles at the Llama-3-8B shape
# (`python -m experiments.scripts.time_still_block`; docs/benchmarks.md has the run), though at 128
# features they spill 8 bytes a thread for sm_90; the shared memory they need, by features, is below
# (`python -m experiments.kernel_resources`). Not for a gated pass that saves the backward's parts
# (training): that one spills ~200 bytes a thread at these tiles.
WIDE_FORWARD = {"BM": 128, "BN": 64, "num_warps": 8, "num_stages": 2}
WIDE_FORWARD_SHARED = {64: 131_328, 128: 164_096}


def forward_launch(dtype, D, F, device=None, *, gate=False, save=False) -> dict:
    """`_fwd_kernel`'s tiles and launch options (queries a program, keys a step, warps, stages) for a pass
    with or without a gate, saving the parts or not: the wide tiles where they were measured faster and
    the GPU has their shared memory, else square tiles of `block_size`."""
    if (torch.finfo(dtype).bits == 16 and D == 128 and F <= 128 and not (gate and save) and device is not None
            and device.type == "cuda"
            and torch.cuda.get_device_properties(device).shared_memory_per_block_optin
            >= WIDE_FORWARD_SHARED[64 if F <= 64 else 128]):
        return dict(WIDE_FORWARD)
    block = block_size(dtype, D, F)
    return {"BM": block, "BN": block, "num_warps": 4, "num_stages": 3}


def key_kernel_launch(dtype, D, F) -> dict:
    """`_bwd_dkv_kernel`'s tiles and launch options: half as many keys a program as queries, and 8 warps.
    Its three [keys, d] accumulators beside the keys' own tiles spill registers at 64 x 64 and 4 warps
    (480 bytes a thread at bf16, d = 64), not so (`experiments/kernel_resources.py`)."""
    block = block_size(dtype, D, F)
    return {"BM": block, "BN": max(16, block // 2), "num_warps": 8, "num_stages": 2}


@triton.jit
def _program_heads(H, HKV):
    """This program's b * H + h (axis 0 of every grid), its batch row and its KV head's b * HKV + h_kv."""
    bh = tl.program_id(0).to(tl.int64)
    b = bh // H
    return bh, b, b * HKV + (bh % H) // (H // HKV)


@triton.jit
def _keys(K, V, FK, bh, kv, j, L, D: tl.constexpr, F: tl.constexpr):
    """Keys j's k and v (of KV head kv) and fk (of query head bh)."""
    return (_load_tile(K + kv * L * D, j, L, D, D), _load_tile(V + kv * L * D, j, L, D, D),
            _load_tile(FK + bh * L * F, j, L, F, F))


@triton.jit
def _key_masks(i, j, FOLD, VALID, L):
    """[queries, keys] softmax and linear sets of a tile: key j seen by query i >= j (padding never),
    softmax before its fold time, linear from it."""
    inside = j < L
    fold = tl.load(FOLD + j, mask=inside, other=0)
    seen = (j[None, :] <= i[:, None]) & ((tl.load(VALID + j, mask=inside, other=0) != 0) & inside)[None, :]
    soft = seen & (i[:, None] < fold[None, :])
    return soft, seen & ~soft


@triton.jit
def _fwd_kernel(Q, K, V, FQ, FK, G, FOLD, VALID, Y, YS, YL, M, LS, DEN, ARG, L, H, HKV, scale, eps,
                D: tl.constexpr, F: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, GATE: tl.constexpr,
                SAVE: tl.constexpr, DT: tl.constexpr):
    """Grid (B*H, cdiv(L, BM)): queries [qb*BM, (qb+1)*BM) over the keys up to their last one. Saves
    for the backward the two parts of y (over den, the linear one before the gate), the row max, the
    softmax sum, den and the key holding the max (-1: none)."""
    bh, b, kv = _program_heads(H, HKV)
    qb = tl.program_id(1)
    i = qb * BM + tl.arange(0, BM)
    q = _load_tile(Q + bh * L * D, i, L, D, D)
    fq = _load_tile(FQ + bh * L * F, i, L, F, F)
    m = tl.zeros([BM], tl.float32) - 1e30  # finite, so exp(m_old - m_new) never sees inf - inf
    l_soft = tl.zeros([BM], tl.float32)
    l_lin = tl.zeros([BM], tl.float32)
    arg = tl.zeros([BM], tl.int32) - 1
    acc_soft = tl.zeros([BM, D], tl.float32)
    acc_lin = tl.zeros([BM, D], tl.float32)
    for jb in range(tl.cdiv(tl.minimum((qb + 1) * BM, L), BN)):
        j = jb * BN + tl.arange(0, BN)
        k, v, fk = _keys(K, V, FK, bh, kv, j, L, D, F)
        soft, lin = _key_masks(i, j, FOLD + kv * L, VALID + b * L, L)
        s = tl.where(soft, _dot(q, tl.trans(k), DT) * scale, float("-inf"))
        m, l_soft, arg, acc_soft = _online_softmax(s, jb * BN, v, m, l_soft, arg, acc_soft, DT)
        lam = tl.where(lin, _dot(fq, tl.trans(fk), DT), 0.0)
        l_lin += tl.sum(lam, 1)
        acc_lin = _dot_acc(lam, v, acc_lin, DT)
    den = l_soft + l_lin + eps
    y_soft = acc_soft / den[:, None]
    y_lin = acc_lin / den[:, None]
    if GATE:
        y = y_soft + _load_tile(G + bh * L * D, i, L, D, D).to(tl.float32) * y_lin
    else:
        y = y_soft + y_lin
    _store_tile(Y + bh * L * D, i, L, y, D, D)
    if SAVE:
        _store_tile(YS + bh * L * D, i, L, y_soft, D, D)
        _store_tile(YL + bh * L * D, i, L, y_lin, D, D)
        rows = bh * L + i
        tl.store(M + rows, m, mask=i < L)
        tl.store(LS + rows, l_soft, mask=i < L)
        tl.store(DEN + rows, den, mask=i < L)
        tl.store(ARG + rows, arg, mask=i < L)


@triton.jit
def _query_rows(Q, FQ, DN, GDN, DDEN, DMAX, M, ARG, bh, i, L, D: tl.constexpr, F: tl.constexpr):
    """A block of queries' inputs to the backward: q, fq, the d numerator (plain and gated), d den,
    the row max's gradient, the row max and the key holding it."""
    rows = bh * L + i
    inside = i < L
    return (_load_tile(Q + bh * L * D, i, L, D, D), _load_tile(FQ + bh * L * F, i, L, F, F),
            _load_tile(DN + bh * L * D, i, L, D, D), _load_tile(GDN + bh * L * D, i, L, D, D),
            tl.load(DDEN + rows, mask=inside, other=0.0), tl.load(DMAX + rows, mask=inside, other=0.0),
            tl.load(M + rows, mask=inside, other=0.0), tl.load(ARG + rows, mask=inside, other=-1))


@triton.jit
def _bwd_dq_kernel(Q, K, V, FQ, FK, FOLD, VALID, DN, GDN, DDEN, DMAX, M, ARG, DQ, DFQ, L, H, HKV, scale,
                   D: tl.constexpr, F: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, DT: tl.constexpr):
    """Grid (B*H, cdiv(L, BM)): d q and d fq of a block of queries, over the keys up to its last one."""
    bh, b, kv = _program_heads(H, HKV)
    qb = tl.program_id(1)
    i = qb * BM + tl.arange(0, BM)
    q, _, dn, gdn, d_den, d_max, m, arg = _query_rows(Q, FQ, DN, GDN, DDEN, DMAX, M, ARG, bh, i, L, D, F)
    dq = tl.zeros([BM, D], tl.float32)
    dfq = tl.zeros([BM, F], tl.float32)
    for jb in range(tl.cdiv(tl.minimum((qb + 1) * BM, L), BN)):
        j = jb * BN + tl.arange(0, BN)
        k, v, fk = _keys(K, V, FK, bh, kv, j, L, D, F)
        soft, lin = _key_masks(i, j, FOLD + kv * L, VALID + b * L, L)
        p = tl.exp(tl.where(soft, _dot(q, tl.trans(k), DT) * scale - m[:, None], float("-inf")))
        # d of the logits: p dp, and the row max's share on the key holding it; d of the linear weights.
        ds = p * (_dot(dn, tl.trans(v), DT) + d_den[:, None]) - tl.where(arg[:, None] == j[None, :],
                                                                          d_max[:, None], 0.0)
        d_lam = tl.where(lin, _dot(gdn, tl.trans(v), DT) + d_den[:, None], 0.0)
        dq = _dot_acc(ds, k, dq, DT)
        dfq = _dot_acc(d_lam, fk, dfq, DT)
    _store_tile(DQ + bh * L * D, i, L, dq * scale, D, D)
    _store_tile(DFQ + bh * L * F, i, L, dfq, F, F)


@triton.jit
def _bwd_dkv_kernel(Q, K, V, FQ, FK, FOLD, VALID, DN, GDN, DDEN, DMAX, M, ARG, DK, DV, DFK, L, H, HKV, scale,
                    D: tl.constexpr, F: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, DT: tl.constexpr):
    """Grid (B*H, cdiv(L, BN)): d k, d v (per query head) and d fk of a block of keys, over the queries
    from its first one. Its tiles are [keys, queries], the transpose of the query kernel's: the
    products that accumulate into the keys' gradients then take them as they come, where transposing
    four [queries, keys] tiles a step spilled registers."""
    bh, b, kv = _program_heads(H, HKV)
    kb = tl.program_id(1)
    j = kb * BN + tl.arange(0, BN)
    k, v, fk = _keys(K, V, FK, bh, kv, j, L, D, F)
    inside = j < L
    fold = tl.load(FOLD + kv * L + j, mask=inside, other=0)
    key_ok = ((tl.load(VALID + b * L + j, mask=inside, other=0) != 0) & inside)[:, None]
    dk = tl.zeros([BN, D], tl.float32)
    dv = tl.zeros([BN, D], tl.float32)
    dfk = tl.zeros([BN, F], tl.float32)
    for ib in range((kb * BN) // BM, tl.cdiv(L, BM)):
        i = ib * BM + tl.arange(0, BM)
        q, fq, dn, gdn, d_den, d_max, m, arg = _query_rows(Q, FQ, DN, GDN, DDEN, DMAX, M, ARG, bh, i, L, D, F)
        seen = key_ok & (j[:, None] <= i[None, :])
        soft = seen & (i[None, :] < fold[:, None])
        p = tl.exp(tl.where(soft, _dot(k, tl.trans(q), DT) * scale - m[None, :], float("-inf")))
        ds = p * (_dot(v, tl.trans(dn), DT) + d_den[None, :]) - tl.where(arg[None, :] == j[:, None],
                                                                          d_max[None, :], 0.0)
        lin = seen & ~soft
        lam = tl.where(lin, _dot(fk, tl.trans(fq), DT), 0.0)
        d_lam = tl.where(lin, _dot(v, tl.trans(gdn), DT) + d_den[None, :], 0.0)
        dv = _dot_acc(p, dn, _dot_acc(lam, gdn, dv, DT), DT)
        dk = _dot_acc(ds, q, dk, DT)
        dfk = _dot_acc(d_lam, fq, dfk, DT)
    _store_tile(DK + bh * L * D, j, L, dk * scale, D, D)
    _store_tile(DV + bh * L * D, j, L, dv, D, D)
    _store_tile(DFK + bh * L * F, j, L, dfk, F, F)


def supports(q, k, features: int, dtype: torch.dtype | None = None) -> str | None:
    """None when the kernels take these inputs (q, k and `features` per feature map, the kernels'
    operands in `dtype`, default q's), else why not."""
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    if not (q.is_cuda or (interpreting and q.device.type == "cpu")):
        return f"device {q.device.type}"
    dtype = dtype or q.dtype
    for t in (q.dtype, dtype):
        if t not in DOT_DTYPES:
            return f"dtype {t}"
    for name, n in (("head dim", q.shape[-1]), ("feature dim", features)):
        if n not in (16, 32, 64, 128, 256):
            return f"{name} {n} not in 16/32/64/128/256"
        # Gemma's 256-wide heads take 16 x 16 tiles (`block_size`): in 16 bits they compile for sm_90
        # without spilling, in float32 every kernel spills (`python -m experiments.kernel_resources`).
        if n == 256 and torch.finfo(dtype).bits != 16:
            return f"{name} 256 needs 16-bit operands, not {dtype}"
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        return "query heads must be a multiple of the KV heads"
    if q.shape[2] == 0:
        return "empty sequence"
    return None


def _forward(q, k, v, fq, fk, gate, fold, valid, scale, eps, save, parts_dtype):
    """`_fwd_kernel` over the inputs cast to q's dtype: the cast inputs (q, k, v, fq, fk, fold, valid)
    and the outputs (y, y_soft, y_lin, m, l_soft, den, arg); y_soft and y_lin in `parts_dtype`, and
    only y written without `save`."""
    B, H, L, D = q.shape
    HKV, F = k.shape[1], fq.shape[-1]
    dtype = q.dtype
    q, k, v, fq, fk = (t.to(dtype).contiguous() for t in (q, k, v, fq, fk))
    g = gate.float().contiguous() if gate is not None else q  # placeholder, unread without a gate
    fold = fold.clamp(max=NEVER).to(torch.int32).contiguous()
    valid = valid.to(torch.int8).contiguous()
    y = torch.empty_like(q)
    parts = (torch.empty_like(q, dtype=parts_dtype), torch.empty_like(q, dtype=parts_dtype)) if save else (y, y)
    m, l_soft, den = (torch.empty(B, H, L, device=q.device, dtype=torch.float32) for _ in range(3))
    arg = torch.empty(B, H, L, device=q.device, dtype=torch.int32)
    launch = forward_launch(dtype, D, F, q.device, gate=gate is not None, save=save)
    _fwd_kernel[(B * H, triton.cdiv(L, launch["BM"]))](q, k, v, fq, fk, g, fold, valid, y, *parts, m, l_soft, den, arg,
                                                       L, H, HKV, scale, eps, D=D, F=F, GATE=gate is not None,
                                                       SAVE=save, DT=DOT_DTYPES[dtype], **launch)
    return (q, k, v, fq, fk, fold, valid), (y, *parts, m, l_soft, den, arg)


class StillAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, fq, fk, gate, fold, valid, scale, eps, save):
        ctx.dtypes = [t.dtype for t in (k, v, fq, fk)]
        inputs, (y, y_soft, y_lin, m, l_soft, den, arg) = _forward(q, k, v, fq, fk, gate, fold, valid, scale, eps,
                                                                   save, q.dtype)
        if save:
            q, k, v, fq, fk, fold, valid = inputs
            ctx.save_for_backward(q, k, v, fq, fk, gate, fold, valid, y_soft, y_lin, m, l_soft, den, arg)
            ctx.scale = scale
        return y

    @staticmethod
    def backward(ctx, dy):
        q, k, v, fq, fk, gate, fold, valid, y_soft, y_lin, m, l_soft, den, arg = ctx.saved_tensors
        B, H, L, D = q.shape
        HKV, F = k.shape[1], fq.shape[-1]
        dy = dy.float().contiguous()  # the model hands a [B, L, H, D] gradient in, viewed [B, H, L, D]
        g = gate.float() if gate is not None else 1.0
        # Per row: d numerator, d den, and the gradient of the row max m (the softmax terms scale as
        # e^-m: d m = -sum_j p_j dp_j = -(dy . y_soft + d den * l_soft)).
        dn = dy / den[..., None]
        d_den = -(dy * (y_soft.float() + g * y_lin.float())).sum(-1) / den
        d_max = (dy * y_soft.float()).sum(-1) + d_den * l_soft
        dn, gdn = dn.contiguous(), (g * dn).contiguous()  # the kernels read rows of d contiguous values
        dq, dfq = torch.empty_like(q), torch.empty_like(fq)
        dk, dv = (torch.empty(B, H, L, D, device=q.device, dtype=torch.float32) for _ in range(2))
        dfk = torch.empty_like(fk)
        block = block_size(q.dtype, D, F)
        grid = (B * H, triton.cdiv(L, block))
        shapes = {"D": D, "F": F, "BM": block, "BN": block, "DT": DOT_DTYPES[q.dtype]}
        rows = (dn, gdn, d_den, d_max, m, arg)
        _bwd_dq_kernel[grid](q, k, v, fq, fk, fold, valid, *rows, dq, dfq, L, H, HKV, ctx.scale, **shapes)
        launch = key_kernel_launch(q.dtype, D, F)
        _bwd_dkv_kernel[(B * H, triton.cdiv(L, launch["BN"]))](q, k, v, fq, fk, fold, valid, *rows, dk, dv, dfk, L, H,
                                                             HKV, ctx.scale, **(shapes | launch))
        group = H // HKV
        dk, dv = (t.view(B, HKV, group, L, D).sum(2) for t in (dk, dv))
        dk, dv, dfq, dfk = (t.to(dtype) for t, dtype in zip((dk, dv, dfq, dfk), ctx.dtypes))
        d_gate = (dy * y_lin.float()).to(gate.dtype) if gate is not None else None
        return dq, dk, dv, dfq, dfk, d_gate, None, None, None, None, None


def still_attention_triton(q, k, v, fq, fk, gate, fold, valid, *, scale, eps=1e-6):
    """STILL's attention over a fresh pass (no carried state): y [B, H, L, d] in q's dtype.

    q [B,H,L,d] and k, v [B,H_kv,L,d] (RoPE applied), fq, fk [B,H,L,F] (the feature maps of q and of
    each query head's keys), gate [B,H,L,d] or None, fold [B,H_kv,L] each key's fold time relative to
    the pass (query i at time i; >= 2^30: never), valid [B,L] (padding keys are never attended).
    Differentiable in q, k, v, fq, fk and gate; fq, fk, k, v are cast to q's dtype.
    """
    # Keep what the backward needs only when there will be one (not under no_grad / inference).
    save = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, fq, fk, gate))
    return StillAttentionFunction.apply(q, k, v, fq, fk, gate, fold, valid, float(scale), float(eps), save)


def still_attention_parts(q, k, v, fq, fk, fold, valid, *, scale, eps=1e-6):
    """The pieces of `still_attention_triton`'s y without a gate, forward only (no autograd): y_soft
    = acc_soft / den and y_lin = acc_lin / den [B, H, L, d] in float32, and den = l_soft + l_lin + eps
    [B, H, L] (l_soft and acc_soft shifted by the row max of the softmax set, the linear terms not).
    A caller adds terms the kernel does not see (a carried linear state) to acc = y * den and den."""
    with torch.no_grad():
        _, (_, y_soft, y_lin, _, _, den, _) = _forward(q, k, v, fq, fk, None, fold, valid, float(scale), float(eps),
                                                       True, torch.float32)
    return y_soft, y_lin, den
