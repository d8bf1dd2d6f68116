"""Lizard attention continuing from a carried state, around the fused kernel (a prefill after earlier
ones, or one that fills a cache): the kernel's linear part starts from the carried S, z, and the carried
window keys join the softmax of the call's first w - 1 queries here, merged through the kernel's
log-sum-exp. Reference: `naive.gla_window_parallel` with all new tokens valid (tests/kernels/test_continued.py).
"""

from __future__ import annotations

import torch

from ..common import carried_window, extend_window, repeat_kv
from .triton import lizard_attention_parts


@torch.no_grad()
def lizard_attention_continued(fq, fk, log_g, qw, kw, v, state, *, window, scale, sinks, alpha, eps=1e-6,
                               shared=False):
    """`lizard_attention` continuing from a carried state (a prefill after earlier ones): (y, new state).

    The kernel's linear part starts from the carried S_0, z_0 (its state pass does) and returns the
    state after the call. The carried window keys join the softmax of the first w - 1 queries, merged
    through the kernel's log-sum-exp (and with `shared` its row max). Same contract as
    `gla_window_parallel` with all new tokens valid, beta = 1, normalize=True; no gradients (prefill
    only). The kernel must apply to the inputs.
    """
    y_gla, y_win, den, lse, *row_max, (S, z) = lizard_attention_parts(
        fq, fk, log_g, qw, kw, v, window=window, scale=scale, sinks=sinks, alpha=alpha, eps=eps, shared=shared,
        carried=(state["S"], state["z"]))
    # The two branches mixed at every row in one pass over the call (the window's weight relative to
    # the row max m: shared, one normaliser; else alpha times the window's own softmax) ...
    m = row_max[0] if shared else lse
    win_den = (lse - m).exp()
    if shared:
        y = torch.lerp(y_gla, y_win, (win_den / (win_den + den))[..., None].to(y_gla.dtype))
    else:
        y = torch.addcmul(y_gla, y_win, alpha.float()[None, :, None, None])
    # ... then the first w - 1 rows again, in float32, with the carried window keys joining their
    # softmax: query i of this call sees carried key j (of w - 1, oldest first) when j >= i.
    P = min(fq.shape[2], window - 1)
    if P > 0:
        n_rep = fq.shape[1] // kw.shape[1]
        keys, values = repeat_kv(state["win_k"], n_rep).float(), repeat_kv(state["win_v"], n_rep).float()
        scores = (qw[:, :, :P].float() @ keys.transpose(-1, -2)) * scale
        i, j = torch.arange(P, device=fq.device)[:, None], torch.arange(window - 1, device=fq.device)[None, :]
        seen = (j >= i)[None, None] & state["win_valid"][:, None, None, :]
        scores = scores.masked_fill(~seen, float("-inf"))
        m_head, head_den = m[:, :, :P], win_den[:, :, :P]
        m_new = torch.maximum(m_head, scores.amax(-1))
        old, new = (m_head - m_new).exp(), (scores - m_new[..., None]).exp()
        win_num = old[..., None] * y_win[:, :, :P].float() * head_den[..., None] + new @ values
        win_den = old * head_den + new.sum(-1)
        linear = y_gla[:, :, :P].float()
        if shared:
            lin_den = den[:, :, :P]
            head = (win_num + linear * lin_den[..., None]) / (win_den + lin_den)[..., None]
        else:
            head = linear + alpha.float()[None, :, None, None] * win_num / win_den[..., None]
        y[:, :, :P] = head.to(y.dtype)

    # Only the call's last w - 1 tokens can stay in the window: the rest is neither cast nor copied.
    start = kw.shape[2] - min(window - 1, kw.shape[2])
    last = kw[:, :, start:], v[:, :, start:]
    valid = torch.ones(fq.shape[0], last[0].shape[2], dtype=torch.bool, device=fq.device)
    keys, values, key_valid = extend_window(state, last[0].to(state["win_k"].dtype), last[1].to(state["win_v"].dtype),
                                            valid)
    new_state = {"S": S.to(state["S"].dtype), "z": z.to(state["z"].dtype),
                 **carried_window(keys, values, key_valid, window)}
    return y.to(qw.dtype), new_state
