"""The sparse-cache op over L tokens at once (training, prefill): the selection first, then one
attention over each key's visible interval. Same semantics as `naive.py`, from any carried state.

1. Scores. The linear state takes every token whatever the cache holds, so the score of the token
   leaving at query t, e = ||v - read(S_t, phi_k(k))||^2 with its own key features as the query, is
   a read-out of the gated linear state at t: one chunked pass (`gla_window`'s, no gradient) with
   each query replaced by the features of the token that leaves there. Computed in the state's dtype
   (float32, float64 for float64 inputs).
2. Eviction. The cache after each departure is the top `slots` by (score, position) of the valid
   tokens departed so far (`naive.py`, rule 3). So a token is dropped once `slots` tokens ranked above
   it have departed (refused at its own departure if that already holds): `ranking.kth_ranked_above`
   gives that departure for every token at once, in O(N log N) with no host reads. Each key is then
   softmax-visible to an interval of queries [lo, hi): the window from its arrival, the cache from its
   departure until that eviction (the two meet). The slots carried in from an earlier call are ranked
   with the rest, as departed before the call.
3. Attention. Blocks of C queries (C = `chunk`): at any query at most `window + slots` keys are
   visible and each later query of the block adds one, so the keys a block sees are at most
   window + slots + C - 1, gathered per block and KV head. Softmax over them and the sinks, combined
   with the gated linear read-out (chunked) as `gla_window` combines its branches.

Cost: O(L (window + slots + C) d) for the attention and O(L C F d) for the linear passes, plus
O(N log N) for the selection and O(L N / C) booleans to find each block's keys (N = slots + window
+ L). Gradients reach the attended keys and values, the queries and the linear branch's inputs;
the selection carries none, as in `naive.py`.

The state after the call is `recurrent.py`'s, the slots in its order (lowest ranked first).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..common import exp_weights, repeat_kv
from ..gla_window.chunk import _gla_chunks as gla_chunks
from ..gla_window.naive import _combine as combine_branches
from ..ranking import NEVER, kth_ranked_above, rank_by_score_then_position
from .options import SparseCacheOptions

__all__ = ["departure_scores", "sparse_cache_parallel", "visible_intervals"]


@torch.no_grad()
def departure_scores(fk, log_g, v_rep, state, leaving_fk, leaving_v, options: SparseCacheOptions):
    """[B, H_kv, L]: the score of the token leaving the window at each of the L queries (whatever its
    validity), from the linear state as it stands after that query's token. fk, log_g with padding
    zeroed, v_rep [B, H, L, d] (the new tokens'); leaving_fk [B, H, L, F] and leaving_v [B, H_kv, L, d]
    the leaving tokens'."""
    n_rep = fk.shape[1] // leaving_v.shape[1]
    num, den, _, _ = gla_chunks(leaving_fk, fk, log_g, v_rep, state["S"], state["z"], options.branches.chunk)
    read = num / (den + options.branches.eps)[..., None] if options.branches.normalize else num
    error = (repeat_kv(leaving_v, n_rep) - read).square().sum(-1)  # [B, H, L]
    return error.unflatten(1, (-1, n_rep)).mean(2)


def _candidates(scores, state, combined_valid, window):
    """The keys of a call as the selection reads them: the `slots` carried slots, then the combined
    sequence of the `window` carried window tokens and the L new ones, whose token c leaves the
    window at query c (c < L). [B, H_kv, N] or [N] each: score (-inf where none), absolute position,
    validity (False: padding, an empty slot), `ranked` (in the set the cache selects from: the slots
    and the tokens departing in the call), `time`, the query of departure (-1 for the slots), and
    `first`, the first query that sees it (its window's)."""
    B, H_kv, K = state["cache_score"].shape
    L, device = scores.shape[-1], scores.device
    combined = torch.arange(window + L, device=device)
    expand = lambda x: x[:, None].expand(B, H_kv, -1)
    valid = torch.cat([torch.isfinite(state["cache_score"]), expand(combined_valid)], -1)
    return {
        "score": torch.cat([state["cache_score"], F.pad(scores, (0, window), value=float("-inf"))], -1),
        "pos": torch.cat([state["cache_pos"], expand(state["seen"][:, None] - window + combined)], -1),
        "valid": valid,
        "ranked": valid & torch.cat([torch.ones(K, dtype=torch.bool, device=device), combined < L]),
        "time": torch.cat([torch.full((K,), -1, device=device), combined]),
        "first": torch.cat([torch.zeros(K, dtype=torch.long, device=device), combined - window]),
    }


@torch.no_grad()
def visible_intervals(candidates, slots):
    """lo, hi [B, H_kv, N]: key n is softmax-visible to the queries lo <= i < hi (an empty interval for
    padding and empty slots); its rank by (score, position), -1 outside the ranked set; and whether it
    stays in the cache after the call. `candidates` as `_candidates` gives them."""
    rank = rank_by_score_then_position(candidates["score"], candidates["pos"], candidates["ranked"])
    # Keys come in departure order (the slots first, all before the call), so the K-th one ranked
    # above a key, in index order, is the departure that evicts it (or refuses it, if earlier).
    time_end = torch.cat([candidates["time"], torch.tensor([NEVER], device=rank.device)])
    evicted_at = time_end[kth_ranked_above(rank, slots)]
    lo = candidates["first"].expand_as(rank)
    hi = torch.where(candidates["ranked"], torch.maximum(candidates["time"], evicted_at), NEVER)  # the window's to the end
    hi = torch.where(candidates["valid"], hi, lo)
    return lo, hi, rank, candidates["ranked"] & (evicted_at == NEVER)


def _softmax_terms(qw, keys, values, lo, hi, options: SparseCacheOptions):
    """Numerator [B, H, L, d] and denominator [B, H, L] of the softmax of each query over the keys
    [B, H_kv, N, d] visible to it (`visible_intervals`) and the sinks, in blocks of C queries."""
    B, H, L, d = qw.shape
    H_kv, N = keys.shape[1], keys.shape[2]
    n_rep, block = H // H_kv, options.branches.chunk
    n_blocks = -(-L // block)
    starts = torch.arange(n_blocks, device=qw.device) * block
    # The keys each block sees, at most window + slots + C - 1 (the module's docstring): their indices
    # packed to the front, in key order.
    with torch.no_grad():
        overlap = (lo[..., None, :] < (starts + block)[:, None]) & (hi[..., None, :] > starts[:, None])
        overlap &= (lo < hi)[..., None, :]  # [B, H_kv, n_blocks, N]
        M = min(N, options.window + options.slots + block - 1)
        slot = torch.where(overlap, overlap.cumsum(-1, dtype=torch.int32) - 1, M).long().clamp_max(M)
        index = torch.zeros(B, H_kv, n_blocks, M + 1, dtype=torch.long, device=qw.device)
        index = index.scatter(-1, slot, torch.arange(N, device=qw.device).expand_as(slot))[..., :M]
        taken = torch.arange(M, device=qw.device) < overlap.sum(-1, keepdim=True)
        flat = index.flatten(2)
        seen_lo, seen_hi = (x.gather(-1, flat).unflatten(-1, (n_blocks, M)) for x in (lo, hi))
        query = (starts[:, None] + torch.arange(block, device=qw.device))[..., None]  # [n_blocks, C, 1]
        mask = taken[..., None, :] & (seen_lo[..., None, :] <= query) & (query < seen_hi[..., None, :])
    k_blocks, v_blocks = (x.gather(2, flat[..., None].expand(-1, -1, -1, d)).unflatten(2, (n_blocks, M))
                          for x in (keys, values))  # [B, H_kv, n_blocks, M, d]
    q = F.pad(qw, (0, 0, 0, n_blocks * block - L)).unflatten(2, (n_blocks, block)).unflatten(1, (H_kv, n_rep))
    logits = torch.einsum("bgrncd,bgnmd->bgrncm", q, k_blocks) * options.branches.scale
    logits = logits.masked_fill(~mask[:, :, None], float("-inf"))
    sinks = options.branches.sinks
    sink_logits = None if sinks is None else sinks.view(H_kv, n_rep, 1, 1, -1).expand(B, -1, -1, n_blocks, block, -1)
    weights, sink_weights = exp_weights(logits, sink_logits)
    num = torch.einsum("bgrncm,bgnmd->bgrncd", weights, v_blocks)
    den = weights.sum(-1)
    if sink_weights is not None:
        den = den + sink_weights.sum(-1)
    return num.flatten(1, 2).flatten(2, 3)[:, :, :L], den.flatten(1, 2).flatten(2, 3)[:, :, :L]


def sparse_cache_parallel(fq, fk, log_g, qw, kw, v, valid, state, options: SparseCacheOptions):
    """(y [B, H, L, d], the state after) over L tokens continuing `state` (`recurrent.init_state`'s
    for a fresh pass), in the state's dtype; the inputs as `naive.py` takes them, valid [B, L]."""
    L, n_rep, w = fq.shape[2], fq.shape[1] // kw.shape[1], options.window
    keep = valid[:, None, :, None].to(fq.dtype)
    fk_kept, log_g_kept, v_rep = fk * keep, log_g * keep, repeat_kv(v, n_rep)
    gla_num, gla_den, S, z = gla_chunks(fq, fk_kept, log_g_kept, v_rep, state["S"], state["z"], options.branches.chunk)

    # The combined sequence: the carried window (w tokens, oldest first), then the new tokens.
    ring = {"ring_fk": torch.cat([state["ring_fk"], fk], 2), "ring_k": torch.cat([state["ring_k"], kw], 2),
            "ring_v": torch.cat([state["ring_v"], v], 2), "ring_valid": torch.cat([state["ring_valid"], valid], 1)}
    scores = departure_scores(fk_kept, log_g_kept, v_rep, state, ring["ring_fk"][:, :, :L], ring["ring_v"][:, :, :L],
                              options)
    selection = _candidates(scores, state, ring["ring_valid"], w)
    lo, hi, rank, stays = visible_intervals(selection, options.slots)
    keys = torch.cat([state["cache_k"], ring["ring_k"]], 2)
    values = torch.cat([state["cache_v"], ring["ring_v"]], 2)
    win_num, win_den = _softmax_terms(qw, keys, values, lo, hi, options)
    y = combine_branches(gla_num, gla_den, win_num, win_den, options.branches) * keep

    # The slots after the call: the keys that stay, lowest ranked first, empty slots before them.
    top = torch.where(stays, rank, -1).argsort(dim=-1)[..., -options.slots:]
    filled = stays.gather(-1, top)
    pick = lambda x: x.gather(2, top[..., None].expand(-1, -1, -1, x.shape[-1]))
    cache = {
        "cache_k": torch.where(filled[..., None], pick(keys), 0),
        "cache_v": torch.where(filled[..., None], pick(values), 0),
        "cache_score": torch.where(filled, selection["score"].gather(-1, top), float("-inf")),
        "cache_pos": torch.where(filled, selection["pos"].gather(-1, top), -1),
    }
    ring = {name: x[:, :, -w:] if x.dim() > 2 else x[:, -w:] for name, x in ring.items()}
    return y, {"S": S, "z": z, **ring, **cache, "seen": state["seen"] + L}
