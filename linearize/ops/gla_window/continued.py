"""Lizard attention continuing from a carried state, around the fused kernel (a prefill after earlier
ones, or one that fills a cache): the kernel's linear part starts from the carried S, z, and the carried
window keys join the softmax of the call's first w - 1 queries here, merged through the kernel's
log-sum-exp. Reference: `naive.gla_window_parallel` with all new tokens valid (tests/kernels/test_continued.py).
"""

from __future__ import annotations

import torch

from ..common import carried_window, extend_window, repeat_kv
from .options import GlaWindowOptions
from .triton import lizard_attention_head


@torch.no_grad()
def lizard_attention_continued(fq, fk, log_g, qw, kw, v, state, options: GlaWindowOptions):
    """The fused kernel continuing from a carried state (a prefill after earlier ones, or one that
    fills a cache): (y, new state); `linearize.ops.continue_gla_window`'s Triton implementation.

    The kernel's linear part starts from the carried S_0, z_0 (its state pass does) and returns the
    state after the call. The kernel mixes the branches of every row as a fresh pass would; the carried
    window keys then join the softmax of the first w - 1 queries, from the parts the kernel keeps for
    those rows (the window's output, log-sum-exp and row max, the linear denominator). Same contract as
    `gla_window_parallel` with all new tokens valid, beta = 1, normalize=True; no gradients (prefill
    only). The kernel must apply to the inputs.
    """
    window = options.window
    P = min(fq.shape[2], window - 1)
    y, (y_win, den, lse, m), (S, z) = lizard_attention_head(fq, fk, log_g, qw, kw, v, options, head=P,
                                                            carried=(state["S"], state["z"]))
    if P > 0:
        y[:, :, :P] = _with_carried_keys(y[:, :, :P].float(), y_win.float(), den, lse, m, qw[:, :, :P].float(),
                                         state, window=window, scale=options.scale, alpha=options.alpha,
                                         shared=options.shared).to(y.dtype)

    # Only the call's last w - 1 tokens can stay in the window: the rest is neither cast nor copied.
    start = kw.shape[2] - min(window - 1, kw.shape[2])
    last = kw[:, :, start:], v[:, :, start:]
    valid = torch.ones(fq.shape[0], last[0].shape[2], dtype=torch.bool, device=fq.device)
    keys, values, key_valid = extend_window(state, last[0].to(state["win_k"].dtype), last[1].to(state["win_v"].dtype),
                                            valid)
    new_state = {"S": S.to(state["S"].dtype), "z": z.to(state["z"].dtype),
                 **carried_window(keys, values, key_valid, window)}
    return y, new_state


def _with_carried_keys(y, y_win, den, lse, m, qw, state, *, window, scale, alpha, shared):
    """The first P rows' output once the carried window keys join their softmax: query i of this call
    sees carried key j (of w - 1, oldest first) when j >= i. In float32, from the rows' mixed output y,
    window output y_win, linear denominator den, window log-sum-exp lse and row max m [B, H, P]."""
    P = y.shape[2]
    n_rep = qw.shape[1] // state["win_k"].shape[1]
    keys, values = repeat_kv(state["win_k"], n_rep).float(), repeat_kv(state["win_v"], n_rep).float()
    scores = (qw @ keys.transpose(-1, -2)) * scale
    i, j = torch.arange(P, device=y.device)[:, None], torch.arange(window - 1, device=y.device)[None, :]
    seen = (j >= i)[None, None] & state["win_valid"][:, None, None, :]
    scores = scores.masked_fill(~seen, float("-inf"))
    if not shared:
        m = lse  # the window's own softmax, relative to its log-sum-exp: its sum is 1
    m_new = torch.maximum(m, scores.amax(-1))
    old, new = (m - m_new).exp(), (scores - m_new[..., None]).exp()
    carried_num, carried_den = new @ values, new.sum(-1)
    if shared:
        # One normaliser, y = (l y_win + den y_gla) / (l + den) with the window's sum l = e^(lse - m)
        # relative to the row max: the window's numerator moves to the new max, the linear one stays.
        l = (lse - m).exp()
        linear_num = y * (l + den)[..., None] - y_win * l[..., None]
        window_num = old[..., None] * y_win * l[..., None] + carried_num
        return (window_num + linear_num) / (old * l + carried_den + den)[..., None]
    win = (old[..., None] * y_win + carried_num) / (old + carried_den)[..., None]
    return y + alpha.float()[None, :, None, None] * (win - y_win)
