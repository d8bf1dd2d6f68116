"""LoLCATs: softmax on the last w tokens, linear attention on everything before, one normaliser.

    y_i = (f_h sum_{j in (i-w, i]} e^{s_ij - m_i} v_j + (1 - f_h) sum_{j <= i-w} phi_q(q_i).phi_k(k_j) v_j)
          / (f_h sum_j e^{s_ij - m_i} + (1 - f_h) sum_{j <= i-w} phi_q(q_i).phi_k(k_j) + eps)

f_h = sigmoid(w_h) is the per-head window factor. A token is folded into S, z when it leaves the
window, so the state is S [B,H,F,d], z [B,H,F] plus the last w-1 (RoPE'd) keys and values.
`phi_k` is a callable on [B, H, n, d] keys already repeated to the query heads.
"""

from __future__ import annotations

import torch

from ..common import carried_window, exp_weights, extend_window, repeat_kv
from ..gla_window.naive import init_state  # same layout: linear state plus a w-1 window
from .options import LolcatsOptions

__all__ = ["init_state", "lolcats_parallel", "lolcats_step"]


def _mix(win_num, win_den, lin_num, lin_den, factor, eps):
    f = factor[None, :, None]
    return (f[..., None] * win_num + (1 - f[..., None]) * lin_num) / (f * win_den + (1 - f) * lin_den + eps)[..., None]


def lolcats_parallel(q, k, v, valid, state, phi_q, phi_k, options: LolcatsOptions):
    """Naive parallel form over L new tokens continuing from `state`. Returns (y, new state)."""
    window, scale, factor, eps = options.window, options.scale, options.factor, options.eps
    L = q.shape[2]
    n_rep = q.shape[1] // k.shape[1]
    keys, values, key_valid = extend_window(state, k, v, valid)
    keys_rep, values_rep = repeat_kv(keys, n_rep), repeat_kv(values, n_rep)

    q_pos = torch.arange(L, device=q.device)[:, None] + (window - 1)
    k_pos = torch.arange(keys.shape[2], device=q.device)[None, :]
    in_window = (k_pos <= q_pos) & (k_pos > q_pos - window)
    before_window = k_pos <= q_pos - window
    valid_keys = key_valid[:, None, None, :]

    scores = ((q @ keys_rep.transpose(-1, -2)) * scale).masked_fill(~(in_window & valid_keys), float("-inf"))
    weights, _ = exp_weights(scores)
    fq = phi_q(q)
    fk = phi_k(keys_rep) * key_valid[:, None, :, None].to(q.dtype)
    lin = (fq @ fk.transpose(-1, -2)) * before_window.to(q.dtype)
    lin_num = lin @ values_rep + fq @ state["S"]
    lin_den = lin.sum(-1) + (fq * state["z"][:, :, None, :]).sum(-1)
    y = _mix(weights @ values_rep, weights.sum(-1), lin_num, lin_den, factor, eps)

    # Tokens that leave the window during this call are folded into the state.
    n_fold = keys.shape[2] - (window - 1)
    fk_fold, v_fold = fk[:, :, :n_fold], values_rep[:, :, :n_fold]
    new_state = {
        "S": state["S"] + fk_fold.transpose(-1, -2) @ v_fold,
        "z": state["z"] + fk_fold.sum(2),
        **carried_window(keys, values, key_valid, window),
    }
    return y, new_state


def lolcats_step(q, k, v, valid, state, phi_q, phi_k, options: LolcatsOptions):
    """Recurrent form for one token: attend to the window and the state, then fold the oldest key."""
    scale, factor, eps = options.scale, options.factor, options.eps
    n_rep = q.shape[1] // k.shape[1]
    keys, values, key_valid = extend_window(state, k, v, valid)
    keys_rep, values_rep = repeat_kv(keys, n_rep), repeat_kv(values, n_rep)

    scores = ((q @ keys_rep.transpose(-1, -2)) * scale).masked_fill(~key_valid[:, None, None, :], float("-inf"))
    weights, _ = exp_weights(scores)
    fq = phi_q(q)[:, :, 0]  # [B, H, F]
    lin_num = (fq[..., None] * state["S"]).sum(-2)[:, :, None]
    lin_den = (fq * state["z"]).sum(-1)[:, :, None]
    y = _mix(weights @ values_rep, weights.sum(-1), lin_num, lin_den, factor, eps)

    oldest_k = phi_k(keys_rep[:, :, :1])[:, :, 0] * key_valid[:, None, :1].to(q.dtype)  # [B, H, F]
    new_state = {
        "S": state["S"] + oldest_k[..., :, None] * values_rep[:, :, 0, None, :],
        "z": state["z"] + oldest_k,
        "win_k": keys[:, :, 1:],
        "win_v": values[:, :, 1:],
        "win_valid": key_valid[:, 1:],
    }
    return y, new_state
