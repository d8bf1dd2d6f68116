"""The gated delta rule in chunks of C tokens (the WY / UT form of Yang et al. 2024), same results as
`naive.delta_rule_recurrent` in values and gradients.

With S [d_k, d_v] (keys by values) and u_t = b_t (v_t - a_t S_{t-1}^T k_t), the new value a token
writes, the recurrence is S_t = a_t S_{t-1} + k_t u_t^T. In a chunk from state S0, with gamma_t the
chunk-local cumulative log decay (Gamma_t = e^gamma_t, D_ts = Gamma_t / Gamma_s):

    S_t = Gamma_t S0 + sum_{s <= t} D_ts k_s u_s^T
    u_t = b_t v_t - b_t Gamma_t S0^T k_t - b_t sum_{s < t} D_ts (k_t . k_s) u_s

so (I + A) U = diag(b) V - diag(b Gamma) K S0 with A_ts = b_t D_ts (k_t . k_s) strictly lower: one
unit-triangular solve per chunk gives U = U' - W S0 with U' = (I + A)^-1 diag(b) V and
W = (I + A)^-1 diag(b Gamma) K, both independent of S0 and so computed for every chunk at once.
Only the chunk-to-chunk pass is sequential:

    O     = diag(Gamma) Q S0 + ((Q K^T) . D, lower incl.) U
    S_C   = Gamma_C S0 + K^T diag(Gamma_C / Gamma_s) U

Decay ratios are formed as e^(gamma_t - gamma_s) under the causal mask, never as a quotient, so long
chunks with strong decay stay finite. Memory O(L * C); the PyTorch form computes in float32 (float64
inputs stay float64).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..common import accumulation_dtype
from .naive import prepare
from .options import DeltaRuleOptions

__all__ = ["delta_rule_chunked"]


def delta_rule_chunked(q, k, v, log_a, b, valid, state, options: DeltaRuleOptions):
    """(o [B, H, L, d_v] in q's dtype, state after) over L tokens continuing `state`."""
    out_dtype, L = q.dtype, q.shape[2]
    work = accumulation_dtype(q.dtype)
    q, k, v, log_a, b = (t.to(work) for t in (q, k, v, log_a, b))
    q, k, v, log_a, b = prepare(q, k, v, log_a, b, valid, options)
    C = options.chunk
    n = -(-L // C)
    pad = n * C - L
    # Padding to whole chunks: neutral tokens (a = 1, b = 0) that neither read nor write.
    q = F.pad(q, (0, 0, 0, pad)).unflatten(3, (n, C))  # [B, Hs, G, N, C, dk]
    k, v = (F.pad(t, (0, 0, 0, pad)).unflatten(2, (n, C)) for t in (k, v))  # [B, Hs, N, C, d]
    log_a, b = (F.pad(t, (0, pad)).unflatten(2, (n, C)) for t in (log_a, b))  # [B, Hs, N, C]

    gamma = log_a.cumsum(-1)  # chunk-local: each chunk's decays start again from 1
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    diff = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~causal, float("-inf"))
    decay = diff.exp()  # D_ts for s <= t, 0 above the diagonal
    strict = decay * (~torch.eye(C, dtype=torch.bool, device=q.device)).to(work)
    A = b[..., :, None] * strict * (k @ k.transpose(-1, -2))
    eye = torch.eye(C, dtype=work, device=q.device)
    rhs = torch.cat([b[..., None] * v, (b * gamma.exp())[..., None] * k], dim=-1)
    solved = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
    u_fresh, w = solved.split([v.shape[-1], k.shape[-1]], dim=-1)
    to_end = (gamma[..., -1:] - gamma).exp()  # Gamma_C / Gamma_s

    S, starts, values = state["S"].to(work), [], []
    for c in range(n):
        starts.append(S)
        u = u_fresh[:, :, c] - w[:, :, c] @ S  # [B, Hs, C, dv]
        values.append(u)
        S = gamma[:, :, c, -1, None, None].exp() * S + (k[:, :, c] * to_end[:, :, c, :, None]).transpose(-1, -2) @ u
    S0, U = torch.stack(starts, 2), torch.stack(values, 2)  # [B, Hs, N, dk, dv], [B, Hs, N, C, dv]

    inter = gamma.exp()[:, :, None, ..., None] * (q @ S0[:, :, None])
    intra = ((q @ k[:, :, None].transpose(-1, -2)) * decay[:, :, None]) @ U[:, :, None]
    o = (inter + intra).flatten(3, 4)[..., :L, :].flatten(1, 2) * options.scale
    if valid is not None:
        o = o * valid[:, None, :, None].to(o.dtype)
    return o.to(out_dtype), {"S": S}
