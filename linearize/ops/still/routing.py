"""STILL's routing: choosing, per chunk, which keys and values take the softmax slots and which depart
to the linear state.

Shared by the reference form (`naive.still_parallel`, `naive.still_step`) and the kernels' path
(`fresh_routing`, `continued_routing`, which `linearize.ops.still` runs before `triton.py`'s attention).
Each token is scored once, on arrival (`token_scores`: Self-Saliency by default, or an ablation's,
`ROUTINGS`); when its row's chunk of C tokens completes, the chunk's top `per_chunk` are chosen
(`select_chunk`); when a token leaves the window, a chosen one enters the salient slots (when they are
full, the lowest scored of them and it, the oldest on ties, folds instead) and the others fold into the
linear state: `route_departure` one departure at a time, `_replay_routing` every departure of a parallel
call at once. Out come each key's fold time, the slots, and the state after a call (`_next_state`); the
attention over them is not here.
"""

from __future__ import annotations

import torch

from ..common import exp_weights, extend_window, keep_last, repeat_kv
from ..ranking import NEVER, kth_ranked_above, rank_by_score_then_position
from .options import StillOptions

# The routing rules (`StillConfig.routing`): the score each token is ranked by, per KV head. The local
# ones come from q_t's attention over the last C keys up to t, the self ones from q_t and k_t alone,
# the positional ones from the token's position; `uniform` ties every token (see `token_scores`).
LOCAL_ROUTINGS = ("saliency", "diagonal")
SELF_ROUTINGS = ("dot", "key_norm", "uniform")
POSITIONAL_ROUTINGS = ("random", "recency")
ROUTINGS = LOCAL_ROUTINGS + SELF_ROUTINGS + POSITIONAL_ROUTINGS


def check_routing(routing):
    """A one-line error naming the rules, for a name that is none of them."""
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, got {routing!r}")


def saliency_scores(q, keys, key_valid, new_valid, *, chunk, scale, eps, routing="saliency"):
    """Self-Saliency of the L newest tokens; `keys` [B,H_kv,P,d] ends with them (P >= L).

    Over the local window of the last C keys up to t: KL-like divergence between the attention of
    q_t with and without its own key. Padding tokens get -inf so they are never chosen. With
    `routing="diagonal"`, the attention of q_t to its own key in that window instead.
    """
    L, P = q.shape[2], keys.shape[2]
    n_rep = q.shape[1] // keys.shape[1]
    scores = (q @ repeat_kv(keys, n_rep).transpose(-1, -2)) * scale
    q_pos = torch.arange(L, device=q.device)[:, None] + (P - L)
    k_pos = torch.arange(P, device=q.device)[None, :]
    local = (k_pos <= q_pos) & (k_pos > q_pos - chunk) & key_valid[:, None, None, :]
    return _local_score(scores, local, k_pos == q_pos, new_valid, n_rep, eps, routing)


def _local_score(scores, local, is_self, new_valid, n_rep, eps, routing):
    """Score per query from its logits (last dim) over the keys it may see (`local`), `is_self` marking
    its own key; averaged over each KV group, -inf at padding: [B, H_kv, L]. `routing`: "saliency"
    (the divergence) or "diagonal" (the softmax's weight on the query's own key)."""
    diag = torch.softmax(scores.masked_fill(~local, float("-inf")), dim=-1).nan_to_num(0.0)
    if routing == "diagonal":
        score = diag.masked_fill(~is_self, 0.0).sum(-1)
    else:
        weights, _ = exp_weights(scores.masked_fill(~(local & ~is_self), float("-inf")))
        nodiag = weights / weights.sum(-1, keepdim=True).clamp_min(1e-30)
        score = (diag * ((diag + eps) / (nodiag + eps)).log()).sum(-1)
    return _per_kv_head(score.flatten(2)[..., : new_valid.shape[1]], n_rep, new_valid)


def _per_kv_head(score, n_rep, new_valid):
    """[B, H, L] per query head -> [B, H_kv, L], the mean over each KV group; -inf at padding."""
    score = score.unflatten(1, (-1, n_rep)).mean(2)
    return score.masked_fill(~new_valid[:, None, :], float("-inf"))


def banded_saliency_scores(q, keys, key_valid, new_valid, *, chunk, scale, eps, routing="saliency"):
    """`saliency_scores` from only the keys a query sees: each block of C queries against 2C keys.

    Query t (combined index t + P - L) sees keys (t + P - L - C, t + P - L]; block b of queries sees
    combined keys [P - L + (b - 1) C, P - L + (b + 1) C), so the cost is L x 2C instead of L x P.
    """
    H, L = q.shape[1], q.shape[2]
    P, C = keys.shape[2], chunk
    blocks = -(-L // C)
    n_rep = H // keys.shape[1]
    tail = blocks * C - L
    # Padded index = combined index + C; block b's keys start at padded P - L + bC.
    span = slice(P - L, P - L + (blocks + 1) * C)
    key_blocks = torch.nn.functional.pad(keys, (0, 0, C, tail))[:, :, span].unfold(2, 2 * C, C)
    valid_blocks = torch.nn.functional.pad(key_valid, (C, tail), value=False)[:, span].unfold(1, 2 * C, C)
    q_blocks = torch.nn.functional.pad(q, (0, 0, 0, tail)).unflatten(2, (blocks, C))
    scores = (q_blocks @ repeat_kv(key_blocks, n_rep)) * scale  # [B, H, blocks, C, 2C]
    i = torch.arange(C, device=q.device)[:, None]
    j = torch.arange(2 * C, device=q.device)[None, :]
    local = (j > i) & (j <= i + C) & valid_blocks[:, None, :, None, :]
    return _local_score(scores, local, j == i + C, new_valid, n_rep, eps, routing)


# `dot` and `key_norm` scores are rounded to multiples of this: RoPE rotates q_t and k_t by the same
# angle, so neither score depends on where a token stands, and in the first layer (where q_t and k_t
# depend on the token alone) a repeated token ties with its copies. Unrounded, float32's rounding of
# the rotation and of the projections (which differ between a prefill and a decode step) would break
# those ties differently in each form; rounded, they tie exactly and the tie rule (the earlier in a
# chunk, the older in the slots) decides the same in every form. A power of two: the rounding is exact.
SELF_SCORE_QUANTUM = 2.0**-10


def self_scores(routing, q, new_keys, new_valid, *, scale):
    """Scores from each token's own query and key ([B,H,L,d], [B,H_kv,L,d]): `dot` q_t.k_t * scale
    (averaged over each KV group), `key_norm` ||k_t|| (a KV head's own), both rounded to
    SELF_SCORE_QUANTUM; `uniform` 0 for every token (so the chunk picks its earliest tokens and full
    slots evict their oldest: the tie rules). -inf at padding: [B, H_kv, L]."""
    if routing == "dot":
        n_rep = q.shape[1] // new_keys.shape[1]
        score = (q * repeat_kv(new_keys, n_rep)).sum(-1).unflatten(1, (-1, n_rep)).mean(2) * scale
    elif routing == "key_norm":
        score = torch.linalg.vector_norm(new_keys, dim=-1)
    else:
        score = new_keys.new_zeros(new_keys.shape[:3])
    score = torch.round(score / SELF_SCORE_QUANTUM) * SELF_SCORE_QUANTUM
    return score.masked_fill(~new_valid[:, None, :], float("-inf"))


def positional_scores(routing, positions, num_kv_heads, valid):
    """Scores for the ablations: `recency` keeps the newest, `random` a position hash (same in all forms)."""
    pos = positions[:, None, :].expand(-1, num_kv_heads, -1)
    if routing == "recency":
        score = pos.to(torch.float32)
    else:
        heads = torch.arange(num_kv_heads, device=pos.device)[None, :, None]
        score = ((pos * 2654435761 + heads * 40503) % 2**32).to(torch.float32) / 2**32
    return score.masked_fill(~valid[:, None, :], float("-inf"))


def select_chunk(scores, valid, per_chunk):
    """Top-`per_chunk` of one chunk's tokens by score ([B,H_kv,C]); stable, so earlier wins ties."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :per_chunk]
    chosen = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, order, True)
    return chosen & valid


def route_departure(slots, cand_score, cand_pos, cand_sel):
    """Route one departing token per (batch, KV head) into the salient slots.

    slots: dict with score/pos/used [B,H_kv,K]. Returns (slot, victim, fold_cand, new slots) where
    `slot` [B,H_kv] is the slot the candidate is written to (-1: none), `victim` marks that this
    slot held a token which must now be folded, and `fold_cand` that the candidate is folded.
    """
    used = slots["used"]
    if used.shape[-1] == 0:
        none = torch.full_like(cand_pos, -1)
        return none, torch.zeros_like(cand_sel), torch.ones_like(cand_sel), slots
    free = ~used
    has_free = free.any(-1)
    first_free = free.to(torch.int8).argmax(-1)
    ranked = torch.where(used, slots["score"], torch.full_like(slots["score"], float("inf")))
    lowest = ranked.amin(-1, keepdim=True)
    oldest_lowest = torch.where(ranked == lowest, slots["pos"], torch.full_like(slots["pos"], NEVER)).argmin(-1)
    candidate_loses = cand_score < lowest[..., 0]

    place = cand_sel & (has_free | ~candidate_loses)
    victim = cand_sel & ~has_free & ~candidate_loses
    slot = torch.where(has_free, first_free, oldest_lowest)
    slot = torch.where(place, slot, torch.full_like(slot, -1))
    fold_cand = ~cand_sel | (~has_free & candidate_loses)

    index = slot.clamp_min(0)[..., None]
    write = place[..., None]

    def put(tensor, value):
        current = tensor.gather(-1, index)
        return tensor.scatter(-1, index, torch.where(write, value[..., None].to(tensor.dtype), current))

    new_slots = {
        "score": put(slots["score"], cand_score),
        "pos": put(slots["pos"], cand_pos),
        "used": put(used, torch.ones_like(cand_sel)),
    }
    return slot, victim, fold_cand, new_slots


def token_scores(q, keys, key_valid, valid, positions, *, routing, chunk, scale, eps):
    """The routing score of each of the L new tokens, per KV head: [B, H_kv, L], -inf at padding.

    q [B,H,L,d] the new queries; keys [B,H_kv,P,d] the combined sequence (the old window, then the
    new tokens), key_valid [B,P] its validity; valid [B,L] the new tokens'; positions [B,L] their
    indices among their row's real tokens. Every form (the parallel one, the step, the kernels'
    `fresh_routing`) scores its tokens here, each token once, on arrival.
    """
    check_routing(routing)
    # Routing is discrete: scores only take part in comparisons, so they carry no gradient.
    with torch.no_grad():
        if routing in LOCAL_ROUTINGS:
            local = banded_saliency_scores if q.shape[2] > 1 else saliency_scores
            return local(q, keys, key_valid, valid, chunk=chunk, scale=scale, eps=eps, routing=routing)
        if routing in SELF_ROUTINGS:
            return self_scores(routing, q, keys[:, :, keys.shape[2] - q.shape[2] :], valid, scale=scale)
        return positional_scores(routing, positions, keys.shape[1], valid)


def _row_positions(state, valid, chunk):
    """Each new token's index among its row's real tokens, and whether it completes a chunk."""
    positions = state["count"][:, None] + valid.long().cumsum(1) - 1
    return positions, valid & ((positions + 1) % chunk == 0)


def _select_if_complete(chosen, scores, key_valid, end, completes, chunk, per_chunk):
    """Mark the top tokens of the chunk ending at combined index `end` for the rows it completes."""
    c = slice(end - chunk + 1, end + 1)
    picked = select_chunk(scores[..., c], key_valid[:, None, c], per_chunk)
    chosen[..., c] = torch.where(completes[:, None, None], picked, chosen[..., c])


def _select_completed_chunks(chosen, scores, key_valid, completes, W1, chunk, per_chunk):
    """`_select_if_complete` for every new token at once (a row's real tokens are contiguous, so
    the chunks completed in one call are disjoint slices of the combined sequence)."""
    B, Hkv, _ = scores.shape
    L, C = completes.shape[1], chunk
    # End t's chunk is combined [W1 + t - C + 1, W1 + t]: offset t + o from combined W1 - C + 1.
    first = W1 - C + 1
    picked = select_chunk(scores[..., first:].unfold(-1, C, 1), key_valid[:, None, first:].unfold(-1, C, 1),
                          per_chunk)  # [B, H_kv, L, C]
    picked = picked & completes[:, None, :, None]
    index = (torch.arange(L, device=scores.device)[:, None] + torch.arange(C, device=scores.device)).flatten()
    span = L + C - 1
    hits = torch.zeros(B, Hkv, span, device=scores.device, dtype=torch.int32)
    hits = hits.index_add(-1, index, picked.flatten(2).to(torch.int32))
    covered = torch.zeros(B, span, device=scores.device, dtype=torch.int32)
    covered = covered.index_add(-1, index, completes[:, :, None].expand(-1, -1, C).flatten(1).to(torch.int32))
    chosen[..., first:] = torch.where(covered[:, None, :] > 0, hits > 0, chosen[..., first:])


def _scored_window(q, k, v, valid, state, routing, chunk, scale, eps):
    """The combined sequence (old window, then new tokens) with scores and selection flags.

    Returns keys, values, validity, scores, chosen (selection flags, new tokens not yet chosen) and,
    per new token, whether it completes its row's chunk.
    """
    keys, values, key_valid = extend_window(state, k, v, valid)
    row_pos, completes = _row_positions(state, valid, chunk)
    new_scores = token_scores(q, keys, key_valid, valid, row_pos, routing=routing, chunk=chunk, scale=scale, eps=eps)
    scores = torch.cat([state["win_score"], new_scores], dim=2)
    chosen = torch.cat([state["win_sel"], torch.zeros_like(new_scores, dtype=torch.bool)], dim=2)
    return keys, values, key_valid, scores, chosen, completes


def _replay_routing(state, scores, chosen, key_valid, completes, positions, start, W1, chunk, per_chunk, fresh,
                    keep_state=True):
    """Fold time of every key (salient slots first, then the combined sequence) and the final slots
    (None, None without `keep_state` where skipping them saves work).

    Chunk selections depend only on scores, so they all come first; then the L departures (combined
    index i leaves after step start + i) are routed as `route_departure` would route them one by one:
    directly when the slots can hold every token chosen in this call (always within STILL's training
    length of 1024), through `_replay_with_eviction` otherwise and in a fresh pass that might overflow.
    """
    B, Hkv, _ = scores.shape
    L = completes.shape[1]
    _select_completed_chunks(chosen, scores, key_valid, completes, W1, chunk, per_chunk)
    K = state["sal_used"].shape[-1]
    # From a fresh state at most L // chunk chunks complete, so whether their picks fit is known
    # without looking. A fresh pass that may overflow replays without checking: the check is a host
    # sync per layer, which stalls training's queue and breaks a CUDA graph's capture.
    fits = fresh and (L // chunk) * per_chunk <= K
    slot_ids = torch.arange(K, device=scores.device).expand(B, Hkv, K)  # ids: slots first, then combined
    slots = {"score": state["sal_score"], "pos": state["sal_pos"], "used": state["sal_used"]}
    fold_time = torch.full((B, Hkv, K + W1 + L), NEVER, device=scores.device, dtype=torch.long)
    departing = chosen[..., :L]
    leave = torch.arange(start + 1, start + L + 1, device=scores.device)

    # A continued call checks whether its picks fit: a host sync, which a CUDA graph's capture refuses,
    # so while capturing the general replay (the same routing either way) runs unchecked.
    checked = not fresh and not capturing(scores)
    if fits or (checked and (state["sal_used"].sum(-1) + departing.sum(-1) <= K).all()):
        fold_time[..., K : K + L] = torch.where(departing, NEVER, leave)
        if not keep_state:
            return fold_time, None, None
        if K == 0:
            return fold_time, slot_ids, slots
        # The r-th chosen departure takes the r-th free slot (route_departure fills the lowest free one).
        padded = torch.nn.functional.pad(departing, (0, max(0, K - L)), value=False)  # at least K candidates
        pick = torch.sort((~padded).to(torch.int8), dim=-1, stable=True).indices[..., :K].clamp_max(L - 1)
        free_first = torch.sort(state["sal_used"].to(torch.int8), dim=-1, stable=True).indices
        take = torch.arange(K, device=scores.device) < departing.sum(-1, keepdim=True)

        def fill(tensor, value):
            return tensor.scatter(-1, free_first, torch.where(take, value, tensor.gather(-1, free_first)))

        slot_ids = fill(slot_ids, K + pick)
        slots = {"score": fill(slots["score"], scores.gather(-1, pick)),
                 "pos": fill(slots["pos"], positions[pick]),
                 "used": fill(slots["used"], torch.ones_like(take.expand_as(slots["used"])))}
        return fold_time, slot_ids, slots

    return _replay_with_eviction(state, scores, chosen, positions, start, L)


def capturing(t: torch.Tensor) -> bool:
    """Whether `t`'s device stream is being captured into a CUDA graph."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _replay_with_eviction(state, scores, chosen, positions, start, L):
    """`route_departure` over L departures at once, for calls where the slots overflow.

    Departing one by one, the slots always hold the top K, by (score, position), of every salient
    token seen so far (the K slot holders and the chosen departures up to then): an overflow drops
    the lowest, the newest winning ties. So a token folds at the first departure after which K tokens
    ranked above it have been seen, or at its own departure if that already holds. The slot a newcomer
    takes is its victim's, followed back to a slot held before this call or filled while free.
    Elements: the K slot holders (ids 0..K-1), then the L departures (ids K + i).
    """
    B, Hkv, K = state["sal_used"].shape
    device = scores.device
    leave = torch.arange(start + 1, start + L + 1, device=device)
    el_score = torch.cat([state["sal_score"], scores[..., :L]], -1)
    el_pos = torch.cat([state["sal_pos"], positions[:L].expand(B, Hkv, L)], -1)
    el_in = torch.cat([state["sal_used"], chosen[..., :L]], -1)
    el_time = torch.cat([torch.full((K,), start, device=device), leave]).expand(B, Hkv, K + L)

    # Rank by (score, position): by position, then stably by score. Elements outside the set rank -1,
    # below all of them (their own fold times are not read).
    rank = rank_by_score_then_position(el_score, el_pos, el_in).to(torch.int32)
    # K-th earliest time at which a higher-ranked element was seen (NEVER when fewer than K exist).
    # Elements come in time order, so that is the time of the K-th higher-ranked one in index order.
    el_time_end = torch.cat([el_time, torch.full_like(el_time[..., :1], NEVER)], -1)
    kth = el_time_end.gather(-1, kth_ranked_above(rank, K))
    fold = torch.where(el_in & (kth != NEVER), torch.maximum(kth, el_time), NEVER)
    departing = torch.arange(K + L, device=device) >= K
    fold = torch.where(departing & ~el_in, el_time, fold)  # unchosen departures fold at once

    # Slots: the r-th chosen departure fills the r-th free slot while any is free; later ones that
    # stay take their victim's slot (pointer jumping resolves chains of victims within the call).
    ids = torch.arange(K + L, device=device).expand(B, Hkv, K + L)
    rank = el_in[..., K:].long().cumsum(-1) - 1
    free_order = torch.sort(state["sal_used"].to(torch.int8), dim=-1, stable=True).indices  # free slots first
    n_free = (~state["sal_used"]).sum(-1, keepdim=True)
    fills_free = el_in[..., K:] & (rank < n_free)
    root_slot = torch.cat([torch.arange(K, device=device).expand(B, Hkv, K),
                           torch.where(fills_free, free_order.gather(-1, rank.clamp(0, K - 1)), -1)], -1)
    evicted = (fold != NEVER) & (fold > el_time) & el_in
    event = torch.where(evicted, fold - start - 1 + K, K + L)  # the departure whose arrival evicts it
    victim_of = torch.full((B, Hkv, K + L + 1), -1, dtype=torch.long, device=device)
    victim_of = victim_of.scatter(-1, event, ids)[..., : K + L]
    filled_free = torch.cat([torch.zeros_like(el_in[..., :K]), fills_free], -1)
    takes_victim = el_in & departing & (fold > el_time) & ~filled_free
    parent = torch.where(takes_victim, victim_of, ids)
    for _ in range(max(1, (K + L).bit_length())):
        parent = parent.gather(-1, parent)
    slot_of = root_slot.gather(-1, parent)

    in_set = el_in & (fold == NEVER)
    slot_ids = torch.arange(K + 1, device=device).expand(B, Hkv, K + 1)
    slot_ids = slot_ids.scatter(-1, torch.where(in_set, slot_of, K), ids)[..., :K]  # column K: a discard
    slots = {"score": el_score.gather(-1, slot_ids), "pos": el_pos.gather(-1, slot_ids),
             "used": in_set.gather(-1, slot_ids)}
    fold_time = torch.full((B, Hkv, K + state["win_k"].shape[2] + L), NEVER, device=device, dtype=torch.long)
    fold_time[..., : K + L] = fold
    return fold_time, slot_ids, slots


def _route(q, k, v, valid, state, options: StillOptions, *, start, fresh, keep_state):
    """Scores, chunk selections and fold times of a parallel call: the combined sequence (keys,
    values, validity, scores, selections), its positions, and `_replay_routing`'s outputs."""
    W1, routing, chunk, per_chunk = options.window - 1, options.routing, options.chunk, options.per_chunk
    scale, eps = options.scale, options.eps
    keys, values, key_valid, scores, chosen, completes = _scored_window(q, k, v, valid, state, routing, chunk, scale,
                                                                        eps)
    positions = torch.arange(start - W1, start + q.shape[2], device=q.device)
    # The routing runs in the frame of `start`, a Python number, which a CUDA graph replaying the call
    # freezes at its capture; the slots' positions, which outlive the call, are absolute. The state's
    # own clock (`next_pos`, on the device, equal to `start` when run eagerly) maps between the two, so
    # a replay compares and stores them right.
    shift = (state["next_pos"] - start)[:, None, None]
    framed = dict(state, sal_pos=state["sal_pos"] - shift)
    fold_time, slot_ids, slots = _replay_routing(framed, scores, chosen, key_valid, completes, positions, start, W1,
                                                 chunk, per_chunk, fresh, keep_state)
    if slots is not None:
        slots = dict(slots, pos=slots["pos"] + shift)
    return keys, values, key_valid, scores, chosen, positions, fold_time, slot_ids, slots


def fresh_routing(q, k, v, valid, state, options: StillOptions, *, start, fk=None):
    """The routing of a fresh pass over L tokens, for the kernels (`linearize.ops.still.triton`)
    to take: when each token folds into the linear state, relative to the pass (query i at time i;
    [B, H_kv, L], NEVER - start for the tokens softmax-visible to its end), and, given `fk` (the
    feature map of each query head's keys, [B, H, L, F]), the state after the pass (else None).
    `state` is `naive.init_state`'s; the routing is `naive.still_parallel(fresh=True)`'s."""
    window = options.window
    keys, values, key_valid, scores, chosen, _, fold_time, slot_ids, slots = _route(
        q, k, v, valid, state, options, start=start, fresh=True, keep_state=fk is not None)
    new = fold_time[..., state["sal_used"].shape[-1] + window - 1:]
    if fk is None:
        return new - start, None
    n_rep = q.shape[1] // k.shape[1]
    folded = repeat_kv((new != NEVER) & valid[:, None, :], n_rep)[..., None].to(fk.dtype)
    slot_sources = (torch.cat([state["sal_k"], keys], dim=2), torch.cat([state["sal_v"], values], dim=2))
    next_state = _next_state(state, (keys, values, key_valid, scores, chosen), slot_sources, slot_ids, slots,
                             fk * folded, repeat_kv(v, n_rep).to(fk.dtype), valid, window - 1)
    return new - start, next_state


def continued_routing(q, k, v, valid, state, phi_k, options: StillOptions, *, start, keep_state=True):
    """The routing of a call over L tokens continuing `state`, for the kernels to run the attention
    over the combined sequence: the K salient slots, the W - 1 window keys, then the L new tokens
    (P = K + W - 1 keys before the new ones, so the call's query i sits at combined index P + i).

    Returns its keys and values [B, H_kv, P + L, d], their validity [B, H_kv, P + L] (unused slots
    and padding invalid), each key's fold time as a combined index (key j softmax-visible to the
    combined queries j..E_j - 1, linear from E_j; NEVER for the keys that stay), fk = phi_k of each
    query head's keys [B, H, P + L, F], and the state after the call (None without `keep_state`).
    The routing and the state are `naive.still_parallel(fresh=False)`'s; the keys folded before the call
    are in `state["S"]` and `state["z"]`, which the caller adds."""
    window = options.window
    keys, values, key_valid, scores, chosen, _, fold_time, slot_ids, slots = _route(
        q, k, v, valid, state, options, start=start, fresh=False, keep_state=keep_state)
    n_rep = q.shape[1] // k.shape[1]
    all_keys = torch.cat([state["sal_k"], keys], dim=2)
    all_values = torch.cat([state["sal_v"], values], dim=2)
    all_valid = torch.cat([state["sal_used"], key_valid[:, None, :].expand(-1, k.shape[1], -1)], dim=2)
    # `_route`'s fold times are absolute (query t at time t; the slots arrived before the call, the
    # window's and new keys at their positions start - W + 1 ..): time t is combined index t - start + P.
    P = state["sal_used"].shape[-1] + window - 1
    fold = torch.where(fold_time == NEVER, NEVER, fold_time - start + P)
    fk = phi_k(repeat_kv(all_keys, n_rep))
    if not keep_state:
        return all_keys, all_values, all_valid, fold, fk, None
    folded = (fold_time != NEVER) & all_valid
    fk_folded = fk * repeat_kv(folded, n_rep)[..., None].to(q.dtype)
    next_state = _next_state(state, (keys, values, key_valid, scores, chosen), (all_keys, all_values), slot_ids,
                             slots, fk_folded, repeat_kv(all_values, n_rep), valid, window - 1)
    return all_keys, all_values, all_valid, fold, fk, next_state


def _next_state(state, combined, slot_sources, slot_ids, slots, fk_folded, values_rep, valid, W1):
    """The state after a parallel call: `combined` its (keys, values, validity, scores, selections)
    from `_scored_window`; `slot_sources` the keys and values the slots are gathered from (the old
    slots', then the combined sequence's), `slot_ids` and `slots` from the routing; and the folded keys'
    features (zero for the others) with their values, per query head."""
    keys, values, key_valid, scores, chosen = combined
    all_keys, all_values = slot_sources
    idx = slot_ids[..., None]
    return {
        "S": state["S"] + fk_folded.transpose(-1, -2) @ values_rep,
        "z": state["z"] + fk_folded.sum(2),
        "win_k": keep_last(keys, W1, dim=2),
        "win_v": keep_last(values, W1, dim=2),
        "win_valid": keep_last(key_valid, W1, dim=1),
        "win_score": keep_last(scores, W1, dim=2),
        "win_sel": keep_last(chosen, W1, dim=2),
        "sal_k": all_keys.gather(2, idx.expand(-1, -1, -1, all_keys.shape[-1])),
        "sal_v": all_values.gather(2, idx.expand(-1, -1, -1, all_values.shape[-1])),
        "sal_score": slots["score"],
        "sal_pos": slots["pos"],
        "sal_used": slots["used"],
        "count": state["count"] + valid.sum(1),
        "next_pos": state["next_pos"] + valid.shape[1],
    }
