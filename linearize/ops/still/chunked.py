"""STILL's attention over a fresh pass in blocks of C queries, given each key's fold time: the
blueprint of a kernel whose work grows linearly with the sequence (PyTorch, differentiable).

Key j is softmax-visible to queries j..E_j - 1 and linear from E_j on (E_j from `routing.fresh_routing`,
relative to the pass; padding keys in neither set). With fq = phi_q(q), fk = phi_k(k) per query head:

  y_i = (sum_{j <= i < E_j} e^{s_ij - m_i} v_j + g_i * (fq_i^T S_i)) / (sum_{j <= i < E_j} e^{s_ij - m_i} + fq_i^T z_i + eps)
  S_i = sum_{E_j <= i} fk_j v_j^T,  z_i = sum_{E_j <= i} fk_j

(s_ij = q_i . k_j * scale, m_i the row max over the softmax set only: the published form). For the
block of queries [s, s + C):

- Linear part. Each time step folds at most one key: one key leaves the window per step, and it
  either folds itself or enters the salient slots, evicting at most one holder (`fold_events` builds
  the table fold_at[t], the key folding at t, or none; tests/ops/test_still_chunked.py checks the
  claim on random routings). A block's fold events are then the C entries fold_at[s .. s + C), so
  the state before the block, S_s = sum_{E_j < s} fk_j v_j^T (and z_s), is an exclusive cumulative
  sum over blocks of each block's [F, C] x [C, d] product, and the folds inside the block are read
  causally, as in chunked linear attention: fq_i . fk_{fold_at[t]} for t <= i.
- Softmax part. The keys with j <= i < E_j are (a) keys of the window region [s - W + 1, s + C),
  and (b) the salient slot holders at time s: keys j <= s - W (gone from the window by s) with
  E_j > s, at most K = slots of them (`salient_lists`: a [K] list per block, from a mask over the
  keys and its running count, in groups of blocks). Over those K + W + C - 1 keys, each query keeps
  j <= i < E_j and validity.

A block costs O(C (K + W + C) d) for the softmax part and O(C (C + d) F) for the linear one, so a
pass costs O(L (K + W + C) (d + F)) rather than the O(L^2 (d + F)) of walking every key up to each
query (`triton.py`). The salient lists cost O(L^2 / C) integer work (a mask over the keys per block),
no products. 16-bit operands are computed in float32, y returned in q's dtype.

The preparation (`prepare`: the fold table; `salient_lists`; `block_states`: the linear state before
each block) is shared with the Triton forward (`chunk_triton.py`), which reads the same per block.

Reference: `naive.still_parallel(fresh=True, keep_state=False)`. `linearize.ops.still`'s CHUNK form
runs it ("torch-chunked") for fresh calls where the kernels do not, ahead of `still_parallel` in blocks:
its work grows with L (K + W + C) where the naive form's [L, K + W + L] scores grow with L^2.
"""

from __future__ import annotations

import torch

from ..common import accumulation_dtype, exp_weights
from .options import StillOptions

CHUNK = 64  # queries a block
GROUP_ELEMENTS = 1 << 24  # scores per group of blocks: bounds the softmax part's memory without gradients


def still_chunked(q, k, v, fq, fk, gate, fold, valid, options: StillOptions, *, slots, chunk=CHUNK):
    """y [B, H, L, d] in q's dtype. q [B,H,L,d], k, v [B,H_kv,L,d] (RoPE applied); fq, fk [B,H,L,F];
    gate [B,H,L,d] or None; fold [B,H_kv,L] each key's fold time relative to the pass (>= L: never
    within it); valid [B,L]; `options` the routing's (the window, scale and eps are read here) and
    `slots` K its salient slots; `chunk` queries a block. Differentiable in q, k, v, fq, fk and gate."""
    window, scale, eps = options.window, options.scale, options.eps
    B, H, L, d = q.shape
    Hkv = k.shape[1]
    n_rep = H // Hkv
    C = chunk
    blocks = -(-L // C)
    Lp = blocks * C
    out_dtype = q.dtype
    dtype = accumulation_dtype(q.dtype)
    q, k, v, fq, fk = (t.to(dtype) for t in (q, k, v, fq, fk))
    fold, fold_at = prepare(fold, valid, C)
    fk_ext, v_ext = event_sides(fk, v)

    def blocked(t):  # [B, H, L, x] -> [B, H_kv, n_rep, blocks, C, x], queries padded to whole blocks
        t = torch.nn.functional.pad(t, (0, 0, 0, Lp - L))
        return t.view(B, Hkv, n_rep, blocks, C, t.shape[-1])

    q_blocks, fq_blocks = blocked(q), blocked(fq)
    N = slots + window - 1 + C
    group = max(1, GROUP_ELEMENTS // (B * H * C * N))
    F = fk.shape[-1]
    S = fq.new_zeros(B, Hkv, n_rep, 1, F, d)  # the linear state carried from group to group
    z = fq.new_zeros(B, Hkv, n_rep, 1, F)
    parts = []
    for b0 in range(0, blocks, group):
        b1 = min(blocks, b0 + group)
        events = fold_at[..., b0 * C : b1 * C].view(B, Hkv, b1 - b0, C)
        lin_num, lin_den, S, z = _linear_part(fq_blocks[:, :, :, b0:b1], fk_ext, v_ext, events, S, z)
        num, den = _softmax_part(q_blocks[:, :, :, b0:b1], k, v, fold, valid, b0, b1, window, slots, C, scale)
        parts.append((num, den, lin_num, lin_den))
    num, den, lin_num, lin_den = (torch.cat(p, 3).flatten(3, 4).flatten(1, 2)[:, :, :L] for p in zip(*parts))
    if gate is not None:
        lin_num = gate.to(dtype) * lin_num
    y = (num + lin_num) / (den + lin_den + eps)[..., None]
    return y.to(out_dtype)


def fold_events(fold, valid, length):
    """fold_at [B, H_kv, length]: the key folding at each time step of the pass, or L (no key) where
    none does. `fold` [B,H_kv,L] the fold times (>= L: never), valid [B,L]. One key at most folds per
    step (see the module's docstring); padding keys are left out."""
    B, Hkv, L = fold.shape
    folds = valid[:, None, :] & (fold < L)
    fold_at = torch.full((B, Hkv, length + 1), L, dtype=torch.long, device=fold.device)
    keys = torch.arange(L, device=fold.device).expand(B, Hkv, L)
    return fold_at.scatter(-1, torch.where(folds, fold, length), keys)[..., :length]


def prepare(fold, valid, chunk):
    """What the attention in blocks of `chunk` queries reads besides the projections, shared by
    `still_chunked` and the kernel (`chunk_triton.py`): the fold times clamped to L (a time past the
    pass's last query: never within it), as long, and the fold table over whole blocks (`fold_events`,
    [B, H_kv, blocks * chunk], L where no key folds)."""
    L = fold.shape[-1]
    fold = fold.clamp(max=L).to(torch.long)
    return fold, fold_events(fold, valid, -(-L // chunk) * chunk)


def event_sides(fk, v):
    """The key side of the fold events: fk [B, H, L, F] as [B, H_kv, n_rep, L + 1, F] and v [B, H_kv,
    L, d] as [B, H_kv, L + 1, d], each with a zero row at index L for the steps where no key folds."""
    B, Hkv, L, _ = v.shape
    fk_ext = torch.nn.functional.pad(fk, (0, 0, 0, 1)).view(B, Hkv, -1, L + 1, fk.shape[-1])
    return fk_ext, torch.nn.functional.pad(v, (0, 0, 0, 1))


def block_states(fk_ext, v_ext, events, S, z):
    """The linear state before each block of a group of G blocks of C steps, given the state before
    the group (S [B, H_kv, n_rep, 1, F, d], z [.., 1, F]) and the group's fold table entries `events`
    [B, H_kv, G, C] (into `event_sides`' fk_ext and v_ext): the carried state plus an exclusive
    cumulative sum of the group's blocks' [F, C] x [C, d] fold products. Returns the events' fk
    [B, H_kv, n_rep, G, C, F] and v [B, H_kv, 1, G, C, d], the states before each block (S [.., G, F,
    d], z [.., G, F]) and the state after the group (S [.., 1, F, d], z [.., 1, F])."""
    B, Hkv, G, C = events.shape
    n_rep, F = fk_ext.shape[2], fk_ext.shape[-1]
    d = v_ext.shape[-1]
    events = events.flatten(2)
    fk_ev = fk_ext.gather(3, events[:, :, None, :, None].expand(B, Hkv, n_rep, G * C, F)).view(B, Hkv, n_rep, G, C, F)
    v_ev = v_ext.gather(2, events[..., None].expand(B, Hkv, G * C, d)).view(B, Hkv, 1, G, C, d)
    dS = fk_ev.transpose(-1, -2) @ v_ev  # [B, H_kv, n_rep, G, F, d]: each block's folds
    dz = fk_ev.sum(-2)
    S_after, z_after = S + dS.cumsum(3), z + dz.cumsum(3)
    S_before, z_before = torch.cat([S, S_after[:, :, :, :-1]], 3), torch.cat([z, z_after[:, :, :, :-1]], 3)
    return fk_ev, v_ev, S_before, z_before, S_after[:, :, :, -1:], z_after[:, :, :, -1:]


def _linear_part(fq_blocks, fk_ext, v_ext, events, S, z):
    """The linear part's numerator [B, H_kv, n_rep, G, C, d] and denominator [.., G, C] for a group of
    G blocks (fq_blocks [B, H_kv, n_rep, G, C, F]; `events` [B, H_kv, G, C] its steps' fold_at
    entries), given the state before the group (`block_states`); and the state after it. Each block
    reads the state before it and the folds within it up to each query."""
    C = fq_blocks.shape[-2]
    fk_ev, v_ev, S_before, z_before, S, z = block_states(fk_ext, v_ext, events, S, z)
    # A fold at step t counts for the queries i >= t of the block.
    causal = torch.ones(C, C, dtype=torch.bool, device=fq_blocks.device).tril()
    A = (fq_blocks @ fk_ev.transpose(-1, -2)) * causal.to(fq_blocks.dtype)
    num = A @ v_ev + fq_blocks @ S_before
    den = A.sum(-1) + (fq_blocks @ z_before[..., None])[..., 0]
    return num, den, S, z


def salient_lists(fold, valid, b0, b1, C, window, slots):
    """The salient slot holders at the start s of each block b0..b1 - 1 (of C queries): the keys
    j <= s - W with E_j > s (valid), at most `slots` of them, in key order, as indices into the keys
    ([B, H_kv, b1 - b0, min(slots, span)], span the keys j <= the last start - W; L fills unused
    places)."""
    B, Hkv, L = fold.shape
    starts = torch.arange(b0, b1, device=fold.device) * C
    span = max(0, (b1 - 1) * C - window + 1)  # keys any of these blocks can find in a slot
    slots = min(slots, span)  # early blocks: fewer keys have left the window than there are slots
    keys = torch.arange(span, device=fold.device)
    held = ((keys <= starts[:, None] - window) & (fold[:, :, None, :span] > starts[:, None])
            & valid[:, None, None, :span])  # [B, H_kv, G, span]
    place = torch.where(held, held.long().cumsum(-1) - 1, slots).clamp(max=slots)  # place `slots`: a discard
    lists = torch.full((B, Hkv, b1 - b0, slots + 1), L, dtype=torch.long, device=fold.device)
    return lists.scatter(-1, place, keys.expand_as(place))[..., :slots]


def _softmax_part(q_blocks, k, v, fold, valid, b0, b1, window, slots, C, scale):
    """The softmax part's shifted numerator [B, H_kv, n_rep, G, C, d] and sum [.., G, C] for blocks
    b0..b1 - 1 (q_blocks their queries, [B, H_kv, n_rep, G, C, d])."""
    B, Hkv, L, d = k.shape
    G = b1 - b0
    device = k.device
    starts = torch.arange(b0, b1, device=device) * C
    # Each block's keys as indices: its salient list, then its window region [s - W + 1, s + C).
    region = starts[:, None] + torch.arange(1 - window, C, device=device)
    region = torch.where((region >= 0) & (region < L), region, L).expand(B, Hkv, G, -1)
    index = torch.cat([salient_lists(fold, valid, b0, b1, C, window, slots), region], -1)  # [B, H_kv, G, N]
    N = index.shape[-1]
    flat = index.flatten(2)
    keys = torch.nn.functional.pad(k, (0, 0, 0, 1)).gather(2, flat[..., None].expand(-1, -1, -1, d))
    values = torch.nn.functional.pad(v, (0, 0, 0, 1)).gather(2, flat[..., None].expand(-1, -1, -1, d))
    key_fold = torch.nn.functional.pad(fold, (0, 1)).gather(2, flat).view(B, Hkv, G, N)
    key_valid = torch.nn.functional.pad(valid, (0, 1)).gather(1, flat.flatten(1)).view(B, Hkv, G, N)

    i = (starts[:, None] + torch.arange(C, device=device))[..., None]  # [G, C, 1]
    visible = ((index[:, :, :, None, :] <= i) & (i < key_fold[:, :, :, None, :])
               & key_valid[:, :, :, None, :])  # [B, H_kv, G, C, N]
    keys, values = keys.view(B, Hkv, 1, G, N, d), values.view(B, Hkv, 1, G, N, d)
    scores = (q_blocks @ keys.transpose(-1, -2)) * scale
    weights, _ = exp_weights(scores.masked_fill(~visible[:, :, None], float("-inf")))
    return weights @ values, weights.sum(-1)
