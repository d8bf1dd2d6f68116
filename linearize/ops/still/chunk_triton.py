"""A Triton forward of STILL's chunked form (`chunked.still_chunked`) for fresh passes without
gradients (a prompt's prefill, scoring): its work grows linearly with the sequence, where
`triton._fwd_kernel` walks every key up to each query.

The preparation is `chunked.py`'s, in PyTorch: the fold table (`prepare`), the linear state before
each block of C queries (`block_states`: one [F, d] state and [F] normaliser a query head a block,
in float32) and the salient slot holders at each block's start (`salient_lists`), in groups of blocks
whose states and list masks fit GROUP_ELEMENTS. Then `_chunk_fwd_kernel`, a program per query head
and block, reads:

- its C queries (q, fq, and the gate);
- softmax keys: its block's salient list (at most K keys, gathered by index) and its window region
  [s - W + 1, s + C) (contiguous), BN keys a step, in an online softmax; a key j counts for query i
  when j <= i < E_j and it is valid;
- the linear part: fq . S_b (and fq . z_b), S_b read BF feature rows a step, plus the block's own
  fold events fold_at[s .. s + C) causally, fq_i . fk_{fold_at[t]} for t <= i, as chunked linear
  attention does;

and writes y with the published form's conventions (`naive.still_parallel`): only the softmax terms
carry the row max, eps once in the denominator, the gate on the whole linear numerator:

  y = (acc_soft + g * (A v_ev + fq S_b)) / (l_soft + A 1 + fq . z_b + eps).

A block costs O(C (K + W + C) d + C (C + d) F). GEMM operands in the projections' dtype (S_b cast to
it), accumulation in float32. No backward: training keeps `triton.py`'s differentiable pass.
Reference: `naive.still_parallel(fresh=True, keep_state=False)` (tests/kernels/test_still_chunk_triton.py).

Importing this module needs triton; the dispatch in `linearize.ops.still` guards that import.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..gla_window.triton import DOT_DTYPES, _dot, _dot_acc, _load_tile, _store_tile
from .chunked import block_states, event_sides, prepare, salient_lists
from .options import StillOptions
from .triton import _program_heads, block_size

# Elements of the per-block states (B H G F d) or of the salient lists' masks (B H_kv G L) a group of
# G blocks holds at once: bounds the preparation's memory (float32, several such arrays alive).
GROUP_ELEMENTS = 1 << 24


def chunk_launch(dtype, D, F) -> dict:
    """`_chunk_fwd_kernel`'s tiles and launch options: C queries a program (the block), BN keys a
    softmax step, BF feature rows of the state a step (a [BF, d] float32 tile), warps and stages.
    Square tiles of `triton.block_size`, untimed on a GPU: the constants a sweep would tune."""
    block = block_size(dtype, D, F)
    return {"C": block, "BN": block, "BF": max(16, min(F, 4096 // D)), "num_warps": 4, "num_stages": 2}


@triton.jit
def _softmax_keys(q, i, j, K, V, FOLD, VALID, kv, b, L, m, l, acc, scale, D: tl.constexpr, DT: tl.constexpr):
    """Keys j (indices; >= L: none) of KV head kv into the running softmax (max m, sum l, acc) of
    queries i: key j counts for query i when j <= i < its fold time and it is valid."""
    inside = j < L
    k = _load_tile(K + kv * L * D, j, L, D, D)
    v = _load_tile(V + kv * L * D, j, L, D, D)
    fold = tl.load(FOLD + kv * L + j, mask=inside, other=0)
    ok = inside & (tl.load(VALID + b * L + j, mask=inside, other=0) != 0)
    soft = ok[None, :] & (j[None, :] <= i[:, None]) & (i[:, None] < fold[None, :])
    s = tl.where(soft, _dot(q, tl.trans(k), DT) * scale, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    p = tl.exp(s - m_new[:, None])
    corr = tl.exp(m - m_new)
    return m_new, l * corr + tl.sum(p, 1), _dot_acc(p, v, acc * corr[:, None], DT)


@triton.jit
def _chunk_fwd_kernel(Q, K, V, FQ, FK, G, FOLD, VALID, FOLD_AT, LISTS, S, Z, Y, L, Lp, H, HKV, b0, n_blocks,
                      n_list, window, scale, eps, D: tl.constexpr, F: tl.constexpr, C: tl.constexpr,
                      BN: tl.constexpr, BF: tl.constexpr, GATE: tl.constexpr, DT: tl.constexpr):
    """Grid (B*H, n_blocks): the block b0 + program_id(1) of C queries [s, s + C), over its salient
    list (LISTS [B*H_kv, n_blocks, n_list], L: none), its window region and the linear state before
    it (S [B*H, n_blocks, F, D], Z [B*H, n_blocks, F], float32) plus its fold events (FOLD_AT [B*H_kv, Lp])."""
    bh, b, kv = _program_heads(H, HKV)
    blk = tl.program_id(1)
    s = (b0 + blk) * C
    r = tl.arange(0, C)
    i = s + r
    q = _load_tile(Q + bh * L * D, i, L, D, D)
    fq = _load_tile(FQ + bh * L * F, i, L, F, F)
    m = tl.zeros([C], tl.float32) - 1e30  # finite, so exp(m_old - m_new) never sees inf - inf
    l_soft = tl.zeros([C], tl.float32)
    acc = tl.zeros([C, D], tl.float32)
    # Softmax: the salient slot holders at s, then the window region [s - W + 1, s + C).
    lists = LISTS + (kv * n_blocks + blk) * n_list
    for t0 in range(0, n_list, BN):
        t = t0 + tl.arange(0, BN)
        j = tl.load(lists + t, mask=t < n_list, other=L)
        m, l_soft, acc = _softmax_keys(q, i, j, K, V, FOLD, VALID, kv, b, L, m, l_soft, acc, scale, D, DT)
    for j0 in range(tl.maximum(s - window + 1, 0), tl.minimum(s + C, L), BN):
        j = j0 + tl.arange(0, BN)
        m, l_soft, acc = _softmax_keys(q, i, j, K, V, FOLD, VALID, kv, b, L, m, l_soft, acc, scale, D, DT)
    # Linear: the block's fold events causally (a fold at step t counts for the queries i >= t) ...
    ev = tl.load(FOLD_AT + kv * Lp + i)
    fk_ev = _load_tile(FK + bh * L * F, ev, L, F, F)
    v_ev = _load_tile(V + kv * L * D, ev, L, D, D)
    a = tl.where(r[None, :] <= r[:, None], _dot(fq, tl.trans(fk_ev), DT), 0.0)
    lin = _dot(a, v_ev, DT)
    lin_den = tl.sum(a, 1)
    # ... and the state before the block, BF feature rows a step.
    state = (bh * n_blocks + blk) * F
    for f0 in range(0, F, BF):
        f = f0 + tl.arange(0, BF)
        fq_part = tl.load(FQ + bh * L * F + i[:, None] * F + f[None, :], mask=(i < L)[:, None], other=0.0)
        s_part = tl.load(S + (state + f)[:, None] * D + tl.arange(0, D)[None, :])
        lin = _dot_acc(fq_part, s_part, lin, DT)
        lin_den += tl.sum(fq_part.to(tl.float32) * tl.load(Z + state + f)[None, :], 1)
    if GATE:
        lin = _load_tile(G + bh * L * D, i, L, D, D).to(tl.float32) * lin
    y = (acc + lin) / (l_soft + lin_den + eps)[:, None]
    _store_tile(Y + bh * L * D, i, L, y, D, D)


def still_chunk_triton(q, k, v, fq, fk, gate, fold, valid, options: StillOptions, *, slots, launch=None):
    """`chunked.still_chunked`'s y [B, H, L, d] in q's dtype, forward only (no autograd). q [B,H,L,d],
    k, v [B,H_kv,L,d] (RoPE applied), fq, fk [B,H,L,F] (cast to q's dtype), gate [B,H,L,d] or None,
    fold [B,H_kv,L] each key's fold time relative to the pass (>= L: never within it), valid [B,L];
    `options` the routing's (window, scale, eps), `slots` K its salient slots; `launch` the kernel's
    tiles (`chunk_launch`'s by default)."""
    B, H, L, D = q.shape
    Hkv, F = k.shape[1], fq.shape[-1]
    n_rep = H // Hkv
    dtype = q.dtype
    launch = dict(launch or chunk_launch(dtype, D, F))
    C = launch.pop("C")
    blocks = -(-L // C)
    with torch.no_grad():
        q, k, v, fq, fk = (t.to(dtype).contiguous() for t in (q, k, v, fq, fk))
        g = gate.contiguous() if gate is not None else q  # placeholder, unread without a gate
        fold, fold_at = prepare(fold, valid, C)
        fk_ext, v_ext = event_sides(fk.float(), v.float())
        fold32, fold_at32 = fold.to(torch.int32).contiguous(), fold_at.to(torch.int32).contiguous()
        valid8 = valid.to(torch.int8).contiguous()
        y = torch.empty_like(q)
        S = q.new_zeros(B, Hkv, n_rep, 1, F, D, dtype=torch.float32)  # the linear state carried from group to group
        z = q.new_zeros(B, Hkv, n_rep, 1, F, dtype=torch.float32)
        group = max(1, GROUP_ELEMENTS // max(B * H * F * D, B * Hkv * L))
        for b0 in range(0, blocks, group):
            b1 = min(blocks, b0 + group)
            events = fold_at[..., b0 * C : b1 * C].view(B, Hkv, b1 - b0, C)
            _, _, S_before, z_before, S, z = block_states(fk_ext, v_ext, events, S, z)
            lists = salient_lists(fold, valid, b0, b1, C, options.window, slots)
            n_list = lists.shape[-1]
            lists = lists.to(torch.int32).contiguous() if n_list else fold32  # placeholder, unread when empty
            _chunk_fwd_kernel[(B * H, b1 - b0)](
                q, k, v, fq, fk, g, fold32, valid8, fold_at32, lists, S_before.contiguous(), z_before.contiguous(),
                y, L, blocks * C, H, Hkv, b0, b1 - b0, n_list, options.window, float(options.scale),
                float(options.eps), D=D, F=F, C=C, GATE=gate is not None, DT=DOT_DTYPES[dtype], **launch)
    return y
