"""Blocked form of `lolcats_parallel`: O(L * w) memory instead of O(L^2), same results.

With blocks of w tokens (the combined sequence is one invalid key, the w-1 carried keys, then the
new tokens, so new block b is combined block b+1), query block b sees softmax keys in combined
blocks b and b+1 (`window_blocks`) and linear keys j <= i - w: all of combined blocks < b, through
a running sum of per-block phi(k) v^T, plus combined block b under a lower-triangular mask.
Tested against the naive form in values and gradients (tests/ops/test_lolcats_chunked.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..common import carried_window, extend_window, repeat_kv
from ..gla_window.chunk import window_blocks
from .naive import _mix
from .options import LolcatsOptions


def lolcats_chunked(q, k, v, valid, state, phi_q, phi_k, options: LolcatsOptions):
    """Same contract and results as `lolcats_parallel`."""
    window, scale, factor, eps = options.window, options.scale, options.factor, options.eps
    H, L = q.shape[1], q.shape[2]
    n_rep = H // k.shape[1]
    keys, values, key_valid = extend_window(state, k, v, valid)
    win_num, win_den = window_blocks(q, keys, values, key_valid, window, scale, None)

    nb = -(-L // window)
    pad_right = nb * window - L
    padded_keys = F.pad(repeat_kv(keys, n_rep), (0, 0, 1, pad_right))
    padded_values = F.pad(repeat_kv(values, n_rep), (0, 0, 1, pad_right))
    padded_valid = F.pad(key_valid, (1, pad_right), value=False)
    fk = phi_k(padded_keys) * padded_valid[:, None, :, None].to(q.dtype)  # [B, H, (nb + 1) w, F]
    fk_blocks, v_blocks = fk.unflatten(2, (nb + 1, window)), padded_values.unflatten(2, (nb + 1, window))
    # Linear keys of new block b: every combined block before b (running sums), then block b masked.
    block_S = fk_blocks.transpose(-1, -2) @ v_blocks  # [B, H, nb + 1, F, d]
    before_S = state["S"][:, :, None] + F.pad(block_S.cumsum(2), (0, 0, 0, 0, 1, 0))[:, :, :nb]
    before_z = state["z"][:, :, None] + F.pad(fk_blocks.sum(-2).cumsum(2), (0, 0, 1, 0))[:, :, :nb]
    fq = phi_q(F.pad(q, (0, 0, 0, pad_right))).unflatten(2, (nb, window))  # [B, H, nb, w, F]
    causal = torch.ones(window, window, dtype=torch.bool, device=q.device).tril()
    partial = (fq @ fk_blocks[:, :, :nb].transpose(-1, -2)) * causal.to(q.dtype)
    lin_num = (partial @ v_blocks[:, :, :nb] + fq @ before_S).flatten(2, 3)[:, :, :L]
    lin_den = (partial.sum(-1) + (fq * before_z[:, :, :, None, :]).sum(-1)).flatten(2, 3)[:, :, :L]
    y = _mix(win_num, win_den, lin_num, lin_den, factor, eps)

    # Tokens that leave the window during this call: combined entries 1..L of the padded sequence.
    folded_k, folded_v = fk[:, :, : L + 1], padded_values[:, :, : L + 1]
    new_state = {
        "S": state["S"] + folded_k.transpose(-1, -2) @ folded_v,
        "z": state["z"] + folded_k.sum(2),
        **carried_window(keys, values, key_valid, window),
    }
    return y, new_state
