"""Ranked eviction without a loop: when does a cache of the K highest-ranked elements drop each one?

Elements arrive in index order into a cache that keeps the K highest-ranked of those seen so far;
element e is dropped (or refused) once K elements ranked above it have arrived. `kth_ranked_above`
gives, for every element at once, the index of that K-th arrival. STILL's salient slots
(`linearize.ops.still.routing`) and the sparse cache (`linearize.ops.sparse_cache.parallel`) both
turn it into each key's last visible query.
"""

from __future__ import annotations

import torch

NEVER = torch.iinfo(torch.long).max  # a time that never comes: a key that is never dropped


def rank_by_score_then_position(score, position, member):
    """Each element's rank [..., N] among the set `member` marks, ascending by (score, position): of
    equal scores the later position ranks higher. -1 outside the set."""
    by_pos = position.argsort(dim=-1, stable=True)
    order = by_pos.gather(-1, score.gather(-1, by_pos).argsort(dim=-1, stable=True))
    count = order.shape[-1]
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(count, device=order.device).expand_as(order))
    return torch.where(member, rank, -1)


def kth_ranked_above(rank, K):
    """For each element, the index of the K-th element (in index order) ranked above it, or N (the
    count) where fewer than K are. `rank` [..., N]: distinct ranks of the set's members, -1 outside it.

    With the elements sorted from the highest rank down, those above element e are the first s_e of
    that order, so the answer is the K-th smallest index among them: a K-th smallest over a prefix,
    which a wavelet matrix on the sorted order's indices answers for every prefix at once, one level
    per bit of an index. O(N log N) work in O(log N) ops (a 32K-token prefill at 896 slots: 16 levels,
    where counting every pair weighs 33K x 33K per KV head and layer).
    """
    if K == 0:
        return torch.zeros_like(rank, dtype=torch.long)
    N = rank.shape[-1]
    index = torch.arange(N, device=rank.device)
    # Distinct values: outside the set, each apart and below every member (their answers are not read).
    value = torch.where(rank >= 0, rank.long(), -2 - index)
    seq = value.argsort(dim=-1, descending=True)  # seq[s]: the index of the s-th highest
    above = torch.empty_like(seq).scatter_(-1, seq, index.expand_as(seq))  # how many rank above each
    # Every element's query: the K-th smallest (k = K - 1, 0-based) of seq[lo:hi), hi = its count above;
    # [..., 2, N] holds lo and hi. From the top bit down, each level narrows the range to the side (0s
    # or 1s at that bit) holding the K-th smallest, in the next level's order: the 0s first, each
    # side kept in its order.
    bounds = torch.stack([torch.zeros_like(above), above], -2)
    k = torch.full_like(above, K - 1)
    for bit in reversed(range(max(1, (N - 1).bit_length()))):
        zero = (seq & (1 << bit)) == 0
        zeros = torch.nn.functional.pad(torch.cumsum(zero, -1), (1, 0))  # zeros[i]: 0s among seq[:i]
        n_zeros = zeros[..., None, -1:]
        at = zeros.gather(-1, bounds.flatten(-2)).view_as(bounds)
        count = at[..., 1, :] - at[..., 0, :]
        low = k < count
        bounds = torch.where(low[..., None, :], at, n_zeros + bounds - at)
        k = torch.where(low, k, k - count)
        seq = seq.gather(-1, torch.sort(zero.to(torch.int8), dim=-1, descending=True, stable=True).indices)
    # The range now holds that one index (they are distinct); empty where fewer than K rank above.
    return torch.where(above >= K, seq.gather(-1, bounds[..., 0, :].clamp_max(N - 1)), N)
