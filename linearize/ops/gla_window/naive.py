"""Gated linear attention over all tokens plus softmax over a sliding window (Lizard, Liger).

    y_i = beta * y^gla_i + alpha_h * y^win_i                           (combine "sum")
    S_i = gamma_i S_{i-1} + phi_k(k_i) v_i^T,  z_i = gamma_i z_{i-1} + phi_k(k_i)
    y^gla_i = phi_q(q_i)^T S_i / (phi_q(q_i)^T z_i + eps)             (or unnormalised: no z)
    y^win_i = sum_{j in (i-w, i]} e^{s_ij} v_j / (sum_m e^{t_m} + sum_j e^{s_ij}),  s_ij = q_i.k_j * scale

With `shared=True` the two branches share one normaliser instead:
    y_i = (sum_j e^{s_ij - m_i} v_j + phi_q^T S_i) / (sum_m e^{t_m - m_i} + sum_j e^{s_ij - m_i} + phi_q^T z_i + eps)

The gate is given in log space: log_g [B, H, L, 1] (scalar per head) or [B, H, L, F] (per feature).
Padding tokens neither decay nor feed the state. State: S [B,H,F,d], z [B,H,F], and the last w-1
window keys/values [B,H_kv,w-1,d] with their validity [B,w-1].
"""

from __future__ import annotations

import torch

from ..common import carried_window, cumsum_over_tokens, exp_weights, extend_window, repeat_kv, safe_divide
from .options import GlaWindowOptions


def init_state(batch, num_heads, num_kv_heads, feature_dim, head_dim, window, *, device, dtype=torch.float32):
    zeros = lambda *shape: torch.zeros(*shape, device=device, dtype=dtype)
    return {
        "S": zeros(batch, num_heads, feature_dim, head_dim),
        "z": zeros(batch, num_heads, feature_dim),
        "win_k": zeros(batch, num_kv_heads, window - 1, head_dim),
        "win_v": zeros(batch, num_kv_heads, window - 1, head_dim),
        "win_valid": torch.zeros(batch, window - 1, device=device, dtype=torch.bool),
    }


def state_after(fk, log_g, kw, v, window, valid=None):
    """The state after L tokens from an empty one (`valid` [B, L], default all), for paths that
    compute only the outputs."""
    n_rep = fk.shape[1] // kw.shape[1]
    B, H_kv, L, d = kw.shape
    if valid is None:
        valid = torch.ones(B, L, dtype=torch.bool, device=fk.device)
    keep = valid[:, None, :, None].to(fk.dtype)
    fk, log_g = fk * keep, log_g * keep
    # Decay from each token to the end as a reverse cumsum: exact at any length, unlike A_L - A_j.
    to_end = (cumsum_over_tokens(log_g, reverse=True) - log_g).exp()
    k_to_end = fk * to_end
    empty = init_state(B, fk.shape[1], H_kv, fk.shape[-1], d, window, device=fk.device, dtype=v.dtype)
    return {"S": k_to_end.transpose(-1, -2) @ repeat_kv(v, n_rep), "z": k_to_end.sum(2),
            **carried_window(*extend_window(empty, kw, v, valid), window)}


def _window_terms(qw, keys, values, key_mask, scale, sinks):
    """Unnormalised softmax numerator and denominator over the masked keys plus the sink logits."""
    n_rep = qw.shape[1] // keys.shape[1]
    scores = (qw @ repeat_kv(keys, n_rep).transpose(-1, -2)) * scale
    scores = scores.masked_fill(~key_mask, float("-inf"))
    sink_logits = None if sinks is None else sinks[None, :, None, :].expand(*scores.shape[:3], -1)
    weights, sink_weights = exp_weights(scores, sink_logits)
    num = weights @ repeat_kv(values, n_rep)
    den = weights.sum(-1)
    if sink_weights is not None:
        den = den + sink_weights.sum(-1)
    return num, den


def _combine(gla_num, gla_den, win_num, win_den, options: GlaWindowOptions):
    if options.shared:
        return (win_num + gla_num) / (win_den + gla_den + options.eps)[..., None]
    y_gla = gla_num / (gla_den + options.eps)[..., None] if options.normalize else gla_num
    return options.beta * y_gla + options.alpha[None, :, None, None] * safe_divide(win_num, win_den[..., None])


def gla_window_parallel(fq, fk, log_g, qw, kw, v, valid, state, options: GlaWindowOptions):
    """Naive parallel form over L new tokens continuing from `state`. Returns (y [B,H,L,d], new state)."""
    window = options.window
    L = fq.shape[2]
    n_rep = fq.shape[1] // kw.shape[1]
    keep = valid[:, None, :, None].to(fq.dtype)
    fk = fk * keep
    log_g = log_g * keep
    v_rep = repeat_kv(v, n_rep)

    # Cumulative log decay from the start of this call; decay(i <- j) = exp(A_i - A_j) for j <= i.
    A = log_g.cumsum(dim=2)
    causal = torch.ones(L, L, dtype=torch.bool, device=fq.device).tril()
    diff = (A[:, :, :, None, :] - A[:, :, None, :, :]).masked_fill(~causal[None, None, :, :, None], float("-inf"))
    decay = diff.exp()
    if A.shape[-1] == 1:
        scores = (fq @ fk.transpose(-1, -2)) * decay[..., 0]
    else:
        scores = torch.einsum("bhif,bhjf,bhijf->bhij", fq, fk, decay)
    fq_from_start = fq * A.exp()
    gla_num = scores @ v_rep + fq_from_start @ state["S"]
    gla_den = scores.sum(-1) + (fq_from_start * state["z"][:, :, None, :]).sum(-1)

    keys, values, key_valid = extend_window(state, kw, v, valid)
    q_pos = torch.arange(L, device=fq.device)[:, None] + (window - 1)
    k_pos = torch.arange(keys.shape[2], device=fq.device)[None, :]
    band = (k_pos <= q_pos) & (k_pos > q_pos - window)
    key_mask = band[None, None] & key_valid[:, None, None, :]
    win_num, win_den = _window_terms(qw, keys, values, key_mask, options.scale, options.sinks)

    y = _combine(gla_num, gla_den, win_num, win_den, options)

    to_end = (A[:, :, -1:, :] - A).exp()  # decay from each token to the end of this call
    total = A[:, :, -1, :].exp()  # decay of the carried state over the whole call
    new_state = {
        "S": total[..., None] * state["S"] + (fk * to_end).transpose(-1, -2) @ v_rep,
        "z": total * state["z"] + (fk * to_end).sum(2),
        **carried_window(keys, values, key_valid, window),
    }
    return y, new_state


def gla_window_recurrent_step(fq, fk, log_g, qw, kw, v, valid, state, options: GlaWindowOptions):
    """Recurrent form for one token (L = 1): update S, z and the window, then read out."""
    n_rep = fq.shape[1] // kw.shape[1]
    keep = valid[:, None, :, None].to(fq.dtype)
    gamma = (log_g * keep)[:, :, 0].exp()  # [B, H, 1 or F]
    phi_k = (fk * keep)[:, :, 0]  # [B, H, F]
    v_rep = repeat_kv(v, n_rep)[:, :, 0]  # [B, H, d]
    S = gamma[..., None] * state["S"] + phi_k[..., :, None] * v_rep[..., None, :]
    z = gamma * state["z"] + phi_k
    phi_q = fq[:, :, 0]
    gla_num = (phi_q[..., None] * S).sum(-2)[:, :, None]
    gla_den = (phi_q * z).sum(-1)[:, :, None]

    keys, values, key_valid = extend_window(state, kw, v, valid)
    win_num, win_den = _window_terms(qw, keys, values, key_valid[:, None, None, :], options.scale, options.sinks)

    y = _combine(gla_num, gla_den, win_num, win_den, options)
    new_state = {
        "S": S,
        "z": z,
        "win_k": keys[:, :, 1:],
        "win_v": values[:, :, 1:],
        "win_valid": key_valid[:, 1:],
    }
    return y, new_state
