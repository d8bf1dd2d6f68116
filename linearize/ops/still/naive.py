"""STILL: a fixed softmax budget filled by Self-Saliency routing, the rest in a gated linear state.

Per KV head, a token t lives in three places over time:
  * the window: the last W tokens (t' - W < t <= t'), always attended with softmax;
  * when it leaves the window (at time t + W) it is routed: if its chunk chose it (top-lambda by
    score when the chunk of C tokens completed), it enters the salient slots (budget - W of them);
    if the slots overflow, the salient token with the lowest score (oldest on ties; the newcomer
    included) is folded into the linear state instead;
  * folded tokens feed S += phi_k(k) v^T, z += phi_k(k) and are never attended with softmax again.
So each token is softmax-visible from its arrival until its fold time E, and linear after it. The
routing is `routing.py`'s; this module is the attention over it. The naive parallel form takes every
fold time from replaying the routing (`routing._route`), then builds that mask; the step form applies
the same `routing.route_departure` once per token. Output, with a shared normaliser:

  y_i = (sum_{softmax set} e^{s_ij - m_i} v_j + g_i * (phi_q(q_i)^T S_i)) / (sum e^{s_ij - m_i} + phi_q(q_i)^T z_i + eps)

The score is the routing's (`routing.token_scores`, computed once per token on arrival, the same in
every form): Self-Saliency by default, or an ablation's (`routing.ROUTINGS`). Scores from queries are
computed per query head and averaged over each KV group, so GQA heads share one set.
Chunks are counted in each row's own tokens (padding excluded, `count` in the state), so a left-
padded row routes exactly as it would unpadded; chunk c holds that row's tokens [cC, cC + C).
"""

from __future__ import annotations

import torch

from ..common import exp_weights, repeat_kv
from .options import StillOptions
from .routing import NEVER, _next_state, _route, _scored_window, _select_if_complete, route_departure


def init_state(batch, num_heads, num_kv_heads, feature_dim, head_dim, window, slots, *, device, dtype=torch.float32):
    def zeros(*shape, kind=dtype):
        return torch.zeros(*shape, device=device, dtype=kind)

    return {
        "S": zeros(batch, num_heads, feature_dim, head_dim),
        "z": zeros(batch, num_heads, feature_dim),
        "win_k": zeros(batch, num_kv_heads, window - 1, head_dim),
        "win_v": zeros(batch, num_kv_heads, window - 1, head_dim),
        "win_valid": zeros(batch, window - 1, kind=torch.bool),
        "win_score": zeros(batch, num_kv_heads, window - 1),
        "win_sel": zeros(batch, num_kv_heads, window - 1, kind=torch.bool),
        "sal_k": zeros(batch, num_kv_heads, slots, head_dim),
        "sal_v": zeros(batch, num_kv_heads, slots, head_dim),
        "sal_score": zeros(batch, num_kv_heads, slots),
        "sal_pos": zeros(batch, num_kv_heads, slots, kind=torch.long),
        "sal_used": zeros(batch, num_kv_heads, slots, kind=torch.bool),
        "count": zeros(batch, kind=torch.long),
        # The absolute position of the next token, on the device: a step reads it there, so that a
        # CUDA graph replaying the step does not freeze the position it was captured at.
        "next_pos": zeros(batch, kind=torch.long),
    }


def _output(q, fq, gate, soft_keys, soft_values, soft_mask, lin_num, lin_den, scale, eps):
    n_rep = q.shape[1] // soft_keys.shape[1]
    scores = (q @ repeat_kv(soft_keys, n_rep).transpose(-1, -2)) * scale
    weights, _ = exp_weights(scores.masked_fill(~soft_mask, float("-inf")))
    num = weights @ repeat_kv(soft_values, n_rep)
    if gate is not None:
        lin_num = gate * lin_num
    return (num + lin_num) / (weights.sum(-1) + lin_den + eps)[..., None]


def still_parallel(q, k, v, valid, gate, state, phi_q, phi_k, options: StillOptions, *, start, fresh=False,
                   keep_state=True):
    """Naive parallel form over L new tokens at absolute positions start.. continuing from `state`.

    q [B,H,L,d] and k [B,H_kv,L,d] already carry RoPE; gate [B,H,L,d] or None. Returns (y, new state).
    `fresh=True` promises that `state` is `init_state`'s: its empty slots and window are then left out
    of the attention (they are masked out anyway), which makes a first pass much cheaper.
    `keep_state=False` returns (y, None): a pass that fills no cache (training, scoring) skips the slots'
    bookkeeping and the state update.
    """
    H, L = q.shape[1], q.shape[2]
    n_rep = H // k.shape[1]
    W1 = options.window - 1
    scale, eps = options.scale, options.eps
    keys, values, key_valid, scores, chosen, positions, fold_time, slot_ids, slots = _route(
        q, k, v, valid, state, options, start=start, fresh=fresh, keep_state=keep_state)
    K = state["sal_used"].shape[-1]

    all_keys = torch.cat([state["sal_k"], keys], dim=2)
    all_values = torch.cat([state["sal_v"], values], dim=2)
    all_valid = torch.cat([state["sal_used"], key_valid[:, None, :].expand(-1, k.shape[1], -1)], dim=2)
    arrival = torch.cat([torch.full((K,), -1, device=q.device, dtype=torch.long), positions])
    # The columns attention reads: all of them, or only the new tokens' after a fresh state.
    cols = slice(K + W1 if fresh else 0, None)
    att_keys, att_values, att_valid = all_keys[:, :, cols], all_values[:, :, cols], all_valid[..., cols]
    att_fold = fold_time[..., cols]
    q_time = torch.arange(start, start + L, device=q.device)[:, None]
    ft = repeat_kv(att_fold, n_rep)[:, :, None, :]  # [B, H, 1, N]
    ok = repeat_kv(att_valid, n_rep)[:, :, None, :]
    soft_mask = (arrival[None, cols] <= q_time)[None, None] & (q_time[None, None] < ft) & ok
    lin_mask = (ft <= q_time[None, None]) & ok

    fq = phi_q(q)
    fk = phi_k(repeat_kv(att_keys, n_rep))
    values_rep = repeat_kv(att_values, n_rep)
    lin = (fq @ fk.transpose(-1, -2)) * lin_mask.to(q.dtype)
    lin_num = lin @ values_rep + fq @ state["S"]
    lin_den = lin.sum(-1) + (fq * state["z"][:, :, None, :]).sum(-1)
    y = _output(q, fq, gate, att_keys, att_values, soft_mask, lin_num, lin_den, scale, eps)
    if not keep_state:
        return y, None

    folded = (att_fold != NEVER) & att_valid
    fk_folded = fk * repeat_kv(folded, n_rep)[..., None].to(q.dtype)
    return y, _next_state(state, (keys, values, key_valid, scores, chosen), (all_keys, all_values), slot_ids, slots,
                          fk_folded, values_rep, valid, W1)


def still_step(q, k, v, valid, gate, state, phi_q, phi_k, options: StillOptions):
    """Recurrent form for the next token (at absolute position `state["next_pos"]`): score, select, attend,
    route. Nothing in it reads the device back or depends on the position as a Python number, so a
    CUDA graph can replay it."""
    window, chunk, per_chunk, routing = options.window, options.chunk, options.per_chunk, options.routing
    scale, eps = options.scale, options.eps
    n_rep = q.shape[1] // k.shape[1]
    keys, values, key_valid, scores, chosen, completes = _scored_window(q, k, v, valid, state, routing, chunk, scale,
                                                                        eps)
    _select_if_complete(chosen, scores, key_valid, window - 1, completes[:, 0], chunk, per_chunk)

    soft_keys = torch.cat([state["sal_k"], keys], dim=2)
    soft_values = torch.cat([state["sal_v"], values], dim=2)
    soft_mask = torch.cat([state["sal_used"], key_valid[:, None, :].expand(-1, k.shape[1], -1)], dim=2)
    fq = phi_q(q)
    lin_num = fq @ state["S"]
    lin_den = (fq * state["z"][:, :, None, :]).sum(-1)
    y = _output(q, fq, gate, soft_keys, soft_values, repeat_kv(soft_mask, n_rep)[:, :, None, :], lin_num, lin_den,
                scale, eps)

    # The oldest window token leaves: into a salient slot, or folded (it, or the slot's victim).
    slots = {"score": state["sal_score"], "pos": state["sal_pos"], "used": state["sal_used"]}
    cand_pos = (state["next_pos"] - (window - 1))[:, None].expand(scores.shape[:2])
    slot, victim, fold_cand, slots = route_departure(slots, scores[..., 0], cand_pos, chosen[..., 0])
    index = slot.clamp_min(0)[..., None, None].expand(-1, -1, 1, k.shape[-1])
    has_slots = state["sal_k"].shape[2] > 0
    victim_k = state["sal_k"].gather(2, index) if has_slots else keys[:, :, :1]
    victim_v = state["sal_v"].gather(2, index) if has_slots else values[:, :, :1]
    fold_k = torch.where(victim[..., None, None], victim_k, keys[:, :, :1])
    fold_v = torch.where(victim[..., None, None], victim_v, values[:, :, :1])
    fold = (victim | (fold_cand & key_valid[:, None, 0]))[..., None, None].to(q.dtype)
    fk = phi_k(repeat_kv(fold_k, n_rep)) * repeat_kv(fold, n_rep)
    written = (slot >= 0)[..., None, None]
    new_state = {
        "S": state["S"] + fk.transpose(-1, -2) @ repeat_kv(fold_v, n_rep),
        "z": state["z"] + fk[:, :, 0],
        "win_k": keys[:, :, 1:],
        "win_v": values[:, :, 1:],
        "win_valid": key_valid[:, 1:],
        "win_score": scores[..., 1:],
        "win_sel": chosen[..., 1:],
        "sal_k": state["sal_k"].scatter(2, index, torch.where(written, keys[:, :, :1], victim_k)) if has_slots
        else state["sal_k"],
        "sal_v": state["sal_v"].scatter(2, index, torch.where(written, values[:, :, :1], victim_v)) if has_slots
        else state["sal_v"],
        "sal_score": slots["score"],
        "sal_pos": slots["pos"],
        "sal_used": slots["used"],
        "count": state["count"] + valid.sum(1),
        "next_pos": state["next_pos"] + 1,
    }
    return y, new_state
