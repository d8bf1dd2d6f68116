"""The sparse-cache op on a constant-size state: one decode step, and a multi-token pass as a loop of
steps (the PyTorch form; the kernel is left to the GPU work). Same semantics as `naive.py`.

State (fixed shapes, whatever the number of tokens seen):
    S [B, H, F, d], z [B, H, F]          the linear state
    ring_fk [B, H, w, F], ring_k, ring_v [B, H_kv, w, d], ring_valid [B, w]
                                          the last w tokens, oldest first (the window of the last
                                          query; the oldest is the next to leave, scored by phi_k)
    cache_k, cache_v [B, H_kv, slots, d]  the cached tokens
    cache_score [B, H_kv, slots]          their scores (-inf: an empty slot)
    cache_pos [B, H_kv, slots]            their positions (-1: empty), to evict the earliest of equal scores
    seen [B]                              the tokens (padding included) taken so far
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
    it replaces the slot of the lowest score (an empty one first, then the earliest position among
    equal scores) where there is room or it scores higher."""
    score, pos = state["cache_score"], state["cache_pos"]
    lowest = score.amin(-1, keepdim=True)
    tied_positions = pos.masked_fill(score != lowest, torch.iinfo(pos.dtype).max)
    victim = tied_positions.argmin(-1, keepdim=True)  # empty slots (pos -1) first, then the earliest
    enter = leaving_valid[:, None] & (error > lowest[..., 0])
    slot = (torch.arange(score.shape[-1], device=score.device) == victim) & enter[..., None]  # [B, H_kv, slots]
    return {
        "cache_k": torch.where(slot[..., None], leaving_k[:, :, None], state["cache_k"]),
        "cache_v": torch.where(slot[..., None], leaving_v[:, :, None], state["cache_v"]),
        "cache_score": torch.where(slot, error[..., None].to(score.dtype), score),
        "cache_pos": torch.where(slot, position[:, None, None], pos),
    }


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
