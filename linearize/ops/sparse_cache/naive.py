"""Gated linear attention, a sliding softmax window and a sparse cache of the tokens the linear state
recalls worst (LoLA: McDermott et al. 2025, "Low-Rank Linear Attention With Sparse Caching"),
token by token over the whole history: the obviously-correct reference (each query masks the whole
history, O(L^2); `recurrent.py` runs the same on a constant state, O(L * (window + slots)), and
`parallel.py` over all tokens at once).

The linear state, as Lizard's linear branch keeps it (`linearize.ops.gla_window`):

    S_t = gamma_t S_{t-1} + phi_k(k_t) v_t^T,    z_t = gamma_t z_{t-1} + phi_k(k_t)
    read(S_t, f) = f^T S_t / (f^T z_t + eps)     (f^T S_t alone where `normalize` is off)

The cache, per KV head, holds at most `slots` tokens that have left the window. At step t:
  1. S_t, z_t take token t (a padding token neither decays nor feeds them).
  2. Token s = t - w leaves the window (w = `window`; nothing leaves while t < w). A valid s gets the
     score e_s = the mean over the query heads sharing the KV head of ||v_s - read(S_t, phi_k(k_s))||^2,
     the linear state's recall error for it as the state stands after token t. Scores are computed
     once, without gradients, and never recomputed.
  3. s enters the cache if it holds fewer than `slots` tokens, or if e_s is at least the lowest score
     in it; that token (of the lowest score, the earliest position among equal ones) is evicted. A
     token that does not enter, or is evicted, is gone for good (the linear state still holds it,
     as it holds every token). Ranking tokens by (score, position), the newer winning ties, the
     cache after step t is thus exactly the top `slots` of the valid tokens that have left the
     window by then: `parallel.py` computes it that way, for every t at once.
  4. Query t attends under one softmax to the window keys (t - w, t], the cached keys (all at
     positions <= t - w: the two sets never overlap) and the sink logits, and combines that with
     the linear read-out of phi_q(q_t) as `linearize.ops.gla_window` does. With `shared`, one normaliser:
         y_t = (sum_j e^{s_tj - m_t} v_j + phi_q^T S_t) / (sum_sinks e^{u - m_t} + sum_j e^{s_tj - m_t} + phi_q^T z_t + eps)
     j over the window and the cache, s_tj = scale * q_t.k_j, m_t the highest of those logits and the
     sinks' u (so a cached key with a high logit also shifts the weight from the linear terms to the
     softmax); otherwise beta * linear + alpha_h * softmax, each normalised on its own.

So the cache at t is a deterministic function of the tokens up to t: the op is causal. Gradients
reach the keys and values of the attended tokens (window and cache) and the linear branch's inputs;
the selection itself is discrete and carries none. Padding queries read out zeros.

Inputs as `linearize.ops.gla_window`'s: fq, fk [B, H, L, F]; log_g [B, H, L, 1 or F]; qw [B, H, L, d];
kw, v [B, H_kv, L, d]; valid [B, L] (False for padding).

Why the GLA state scores the tokens (rather than a separate L2-normalised key memory): the cache is
there to repair what this layer's linear branch gets wrong, so it should measure the recall of the
state whose read-out enters the output, with the branch's own feature map and normaliser. Why one
cache per KV head with the group's mean error: the window is shared per KV head the same way, and
the cache then costs what `slots` more window tokens cost.
"""

from __future__ import annotations

import torch

from ..common import repeat_kv
from ..gla_window.naive import _combine as combine_branches
from ..gla_window.naive import _window_terms as softmax_terms
from .options import SparseCacheOptions

__all__ = ["attend", "linear_update", "recall_error", "sparse_cache_naive"]


def linear_update(S, z, fk_t, log_g_t, v_t, keep_t):
    """S_t, z_t after one token: fk_t [B, H, F], log_g_t [B, H, 1 or F], v_t [B, H, d] (repeated to the
    query heads), keep_t [B] (False: padding, the state unchanged)."""
    keep = keep_t[:, None, None].to(fk_t.dtype)
    gamma, phi_k = (log_g_t * keep).exp(), fk_t * keep
    return gamma[..., None] * S + phi_k[..., :, None] * v_t[..., None, :], gamma * z + phi_k


@torch.no_grad()
def recall_error(fk_s, v_s, S, z, options: SparseCacheOptions):
    """[B, H_kv]: the mean over each KV head's query heads of ||v_s - read(S, fk_s)||^2, for the token
    leaving the window with features fk_s [B, H, F] and value v_s [B, H_kv, d]."""
    n_rep = fk_s.shape[1] // v_s.shape[1]
    read = (fk_s[..., :, None] * S).sum(-2)
    if options.branches.normalize:
        read = read / ((fk_s * z).sum(-1) + options.branches.eps)[..., None]
    error = (repeat_kv(v_s[:, :, None], n_rep)[:, :, 0] - read).square().sum(-1)  # [B, H]
    return error.unflatten(1, (v_s.shape[1], n_rep)).mean(-1)


def attend(fq_t, S, z, qw_t, keys, values, key_mask, options: SparseCacheOptions):
    """The output for one query [B, H, d]: the softmax over keys [B, H_kv, N, d] where key_mask
    [B, H_kv, N] (plus the sinks), combined with the linear read-out of fq_t [B, H, F]."""
    n_rep = qw_t.shape[1] // keys.shape[1]
    mask = repeat_kv(key_mask[..., None], n_rep)[:, :, None, :, 0]  # [B, H, 1, N]
    branches = options.branches
    num, den = softmax_terms(qw_t[:, :, None], keys, values, mask, branches.scale, branches.sinks)
    gla_num = (fq_t[..., :, None] * S).sum(-2)[:, :, None]
    gla_den = (fq_t * z).sum(-1)[:, :, None]
    return combine_branches(gla_num, gla_den, num, den, branches)[:, :, 0]


def _admit(cached, score, s, error, leaving_valid, slots):
    """The cache after token s leaves the window with `error` [B, H_kv]: cached [B, H_kv, L] says which
    positions it holds, score [B, H_kv, L] their scores."""
    positions = torch.arange(cached.shape[-1], device=cached.device)
    room = cached.sum(-1) < slots
    lowest_scores = score.masked_fill(~cached, float("inf"))
    victim = lowest_scores.argmin(-1)  # the first of equal minima: the earliest position
    lowest = lowest_scores.gather(-1, victim[..., None])[..., 0]
    enter = leaving_valid[:, None] & (room | (error >= lowest))  # s, the newest, wins a tie
    evicted = (enter & ~room)[..., None] & (positions == victim[..., None])
    entered = enter[..., None] & (positions == s)
    return (cached & ~evicted) | entered, torch.where(entered, error[..., None], score)


def sparse_cache_naive(fq, fk, log_g, qw, kw, v, valid, options: SparseCacheOptions):
    """(y [B, H, L, d], cached [B, H_kv, L]: the positions in the cache after the last token) over L
    tokens from an empty state, in the inputs' dtype; `valid` None: every token valid."""
    B, H, L, F = fq.shape
    H_kv, d, w = kw.shape[1], v.shape[-1], options.window
    if valid is None:
        valid = torch.ones(B, L, dtype=torch.bool, device=fq.device)
    v_rep = repeat_kv(v, H // H_kv)
    S = fq.new_zeros(B, H, F, d)
    z = fq.new_zeros(B, H, F)
    cached = torch.zeros(B, H_kv, L, dtype=torch.bool, device=fq.device)
    score = fq.new_full((B, H_kv, L), float("-inf"))
    positions = torch.arange(L, device=fq.device)
    outputs = []
    for t in range(L):
        S, z = linear_update(S, z, fk[:, :, t], log_g[:, :, t], v_rep[:, :, t], valid[:, t])
        s = t - w
        if s >= 0:
            error = recall_error(fk[:, :, s], v[:, :, s], S, z, options)
            cached, score = _admit(cached, score, s, error, valid[:, s], options.slots)
        in_window = (positions > t - w) & (positions <= t) & valid  # [B, L]
        attended = in_window[:, None, :] | cached
        y_t = attend(fq[:, :, t], S, z, qw[:, :, t], kw, v, attended, options)
        outputs.append(y_t * valid[:, t, None, None].to(y_t.dtype))
    return torch.stack(outputs, 2), cached
