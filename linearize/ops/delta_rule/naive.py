"""The gated delta rule, token by token: the obviously-correct reference.

    S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T,    o_t = scale * S_t^T q_t

S [d_k, d_v] is the transpose of the paper's state (Yang et al. 2024, "Gated Delta Networks"),
keys by values as the other ops' states and fla's. Before the write, S_{t-1}^T k_t is what the
memory returns for k_t; the write moves it a fraction b_t of the way to v_t, after decaying by a_t.

Inputs: q [B, H, L, d_k]; k [B, H_kv, L, d_k], v [B, H_kv, L, d_v]; log_a, b [B, H_s, L] with the
decay a_t = exp(log_a) in (0, 1] and the write strength b_t in (0, 1). H_s, the number of states,
is H (a state per query head) or H_kv (one per KV head, read by its group of query heads): keys
and values are repeated to the states, queries grouped on them. q and k are L2-normalised inside
the op (`l2_normalize`), so the state stays bounded whatever the projections give.
A padding token (valid False) leaves the state unchanged (a = 1, b = 0) and reads out zeros.
State: {"S": [B, H_s, d_k, d_v]}, float32 unless asked otherwise.
"""

from __future__ import annotations

import torch

from ..common import repeat_kv
from .options import DeltaRuleOptions

__all__ = ["delta_rule_recurrent", "delta_rule_step_naive", "init_state", "l2_normalize", "prepare"]


def init_state(batch, num_states, key_dim, value_dim, *, device, dtype=torch.float32) -> dict:
    return {"S": torch.zeros(batch, num_states, key_dim, value_dim, device=device, dtype=dtype)}


def l2_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps) over the last dimension (fla's form: smooth at 0, so padding's zeros stay finite)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def prepare(q, k, v, log_a, b, valid, options: DeltaRuleOptions):
    """Normalised q and k, keys and values repeated to the states, and the gates with padding made
    neutral (log_a = 0, b = 0). Returns (q [B, H_s, G, L, d_k] grouped by state, k, v, log_a, b)."""
    H = q.shape[1]
    n_states, n_kv = log_a.shape[1], k.shape[1]
    if n_states % n_kv or H % n_states:
        raise ValueError(f"the gates' {n_states} heads must be a multiple of the keys' {n_kv} and divide the "
                         f"queries' {H}")
    q = l2_normalize(q, options.eps).unflatten(1, (n_states, H // n_states))
    k = l2_normalize(repeat_kv(k, n_states // n_kv), options.eps)
    v = repeat_kv(v, n_states // n_kv)
    if valid is not None:
        keep = valid[:, None, :]
        log_a = log_a * keep.to(log_a.dtype)
        b = b * keep.to(b.dtype)
    return q, k, v, log_a, b


def _step(q, k, v, log_a, b, S):
    """One token on prepared inputs: q [B, H_s, G, d_k], k [B, H_s, d_k], v [B, H_s, d_v], log_a, b [B, H_s]."""
    a, b = log_a.exp()[..., None, None], b[..., None, None]
    recalled = (k[..., :, None] * S).sum(-2)  # S^T k  [B, H_s, d_v]
    S = a * S + b * k[..., :, None] * (v - a[..., 0] * recalled)[..., None, :]
    return q @ S, S  # [B, H_s, G, d_v]


def delta_rule_recurrent(q, k, v, log_a, b, valid, state, options: DeltaRuleOptions):
    """(o [B, H, L, d_v], state after) over L tokens continuing `state`, one token at a time."""
    q, k, v, log_a, b = prepare(q, k, v, log_a, b, valid, options)
    S, outputs = state["S"], []
    for t in range(k.shape[2]):
        o, S = _step(q[:, :, :, t], k[:, :, t], v[:, :, t], log_a[:, :, t], b[:, :, t], S)
        outputs.append(o)
    o = torch.stack(outputs, 3).flatten(1, 2) * options.scale  # [B, H, L, d_v]
    if valid is not None:
        o = o * valid[:, None, :, None].to(o.dtype)
    return o, {"S": S}


def delta_rule_step_naive(q, k, v, log_a, b, valid, state, options: DeltaRuleOptions):
    """One token (L = 1) as the decode step runs it: the recurrence in the state's dtype (float32, or
    float64), o in q's."""
    work = state["S"].dtype
    o, new_state = delta_rule_recurrent(*(t.to(work) for t in (q, k, v, log_a, b)), valid, state, options)
    return o.to(q.dtype), new_state
