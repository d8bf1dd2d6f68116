"""The sparse-cache op on a constant-size state: one decode step (what decoding runs), and a multi-token
pass as a loop of those steps (what the decode state is checked against; passes run `parallel.py`).
Same semantics as `naive.py`.

State (fixed shapes, whatever the number of tokens seen):
    S [B, H, F, d], z [B, H, F]          the linear state
    ring_fk [B, H, w, F], ring_k, ring_v [B, H_kv, w, d], ring_valid [B, w]
                                          the last w tokens, oldest first (the window of the last
                                          query; the oldest is the next to leave, scored by phi_k)
    cache_k, cache_v [B, H_kv, slots, d]  the cached tokens, from the lowest ranked to the highest by
                                          (score, position): empty slots first, the next victim in slot 0
    cache_score [B, H_kv, slots]          their scores (-inf: an empty slot)
    cache_pos [B, H_kv, slots]            their positions (-1: empty)
    seen [B]                              the tokens (padding included) taken so far

The slots' order is a function of the tokens alone (not of the steps that filled them), so
`parallel.py`, which ranks every departed token at once, leaves the same state.
"""

from __future__ import annotations

import torch

from ..common import repeat_kv
from .naive import attend, linear_update, recall_error
from .options import SparseCacheOptions

__all__ = ["init_state", "sparse_cache_loop", "sparse_cache_step_recurrent"]


def init_state(batch, num_heads, num_kv_heads, feature_dim, head_dim, options: SparseCacheOptions, *, device,
               dtype=torch.float32) -> dict:
    w, slots = options.window, options.slots
    zeros = lambda *shape: torch.zeros(*shape, device=device, dtype=dtype)
    return {
        "S": zeros(batch, num_heads, feature_dim, head_dim),
        "z": zeros(batch, num_heads, feature_dim),
        "ring_fk": zeros(batch, num_heads, w, feature_dim),
        "ring_k": zeros(batch, num_kv_heads, w, head_dim),
        "ring_v": zeros(batch, num_kv_heads, w, head_dim),
        "ring_valid": torch.zeros(batch, w, device=device, dtype=torch.bool),
        "cache_k": zeros(batch, num_kv_heads, slots, head_dim),
        "cache_v": zeros(batch, num_kv_heads, slots, head_dim),
        "cache_score": torch.full((batch, num_kv_heads, slots), float("-inf"), device=device, dtype=dtype),
        "cache_pos": torch.full((batch, num_kv_heads, slots), -1, device=device, dtype=torch.long),
        "seen": torch.zeros(batch, device=device, dtype=torch.long),
    }


def _admit(state, leaving_k, leaving_v, leaving_valid, error, position):
    """The cache entries after the token at `position` [B] leaves the window with `error` [B, H_kv]:
    where it is valid and scores at least slot 0's (the lowest ranked, an empty slot while there is
    one), slot 0 goes and the token takes its place in the order, after the equal scores (it is the
    newest)."""
    score = state["cache_score"]
    enter = leaving_valid[:, None] & (error >= score[..., 0])
    kept_score = torch.cat([score[..., 1:], error[..., None].to(score.dtype)], -1)
    order = kept_score.argsort(dim=-1, stable=True)  # slots 1.. are in order, the newcomer last among equals
    new = {"cache_score": kept_score.gather(-1, order)}
    pos = torch.cat([state["cache_pos"][..., 1:], position[:, None, None].expand_as(score[..., :1])], -1)
    new["cache_pos"] = pos.gather(-1, order)
    for name, leaving in (("cache_k", leaving_k), ("cache_v", leaving_v)):
        kept = torch.cat([state[name][:, :, 1:], leaving[:, :, None]], 2)
        new[name] = kept.gather(2, order[..., None].expand_as(kept))
    return {name: torch.where(enter.view(*enter.shape, *[1] * (value.dim() - 2)), value, state[name])
            for name, value in new.items()}


def sparse_cache_step_recurrent(fq, fk, log_g, qw, kw, v, valid, state, options: SparseCacheOptions):
    """One token (L = 1) after `state`: (y [B, H, 1, d], the new state), in the state's dtype."""
    n_rep = fq.shape[1] // kw.shape[1]
    keep = valid[:, 0]
    fk_t, kw_t, v_t = fk[:, :, 0], kw[:, :, 0], v[:, :, 0]
    S, z = linear_update(state["S"], state["z"], fk_t, log_g[:, :, 0], repeat_kv(v, n_rep)[:, :, 0], keep)
    leaving = {name: state[name][:, :, 0] for name in ("ring_fk", "ring_k", "ring_v")}
    error = recall_error(leaving["ring_fk"], leaving["ring_v"], S, z, options)
    cache = _admit(state, leaving["ring_k"], leaving["ring_v"], state["ring_valid"][:, 0], error,
                   state["seen"] - options.window)
    ring = {
        "ring_fk": torch.cat([state["ring_fk"][:, :, 1:], fk_t[:, :, None]], 2),
        "ring_k": torch.cat([state["ring_k"][:, :, 1:], kw_t[:, :, None]], 2),
        "ring_v": torch.cat([state["ring_v"][:, :, 1:], v_t[:, :, None]], 2),
        "ring_valid": torch.cat([state["ring_valid"][:, 1:], valid], 1),
    }
    keys = torch.cat([ring["ring_k"], cache["cache_k"]], 2)
    values = torch.cat([ring["ring_v"], cache["cache_v"]], 2)
    key_mask = torch.cat([ring["ring_valid"][:, None].expand(-1, kw.shape[1], -1),
                          torch.isfinite(cache["cache_score"])], 2)
    y = attend(fq[:, :, 0], S, z, qw[:, :, 0], keys, values, key_mask, options)
    y = (y * keep[:, None, None].to(y.dtype))[:, :, None]
    return y, {"S": S, "z": z, **ring, **cache, "seen": state["seen"] + 1}


def sparse_cache_loop(fq, fk, log_g, qw, kw, v, valid, state, options: SparseCacheOptions):
    """(y [B, H, L, d], the state after) over L tokens continuing `state`, one step at a time."""
    outputs = []
    for t in range(fq.shape[2]):
        token = slice(t, t + 1)
        y, state = sparse_cache_step_recurrent(fq[:, :, token], fk[:, :, token], log_g[:, :, token],
                                               qw[:, :, token], kw[:, :, token], v[:, :, token],
                                               valid[:, token], state, options)
        outputs.append(y)
    return torch.cat(outputs, 2), state
