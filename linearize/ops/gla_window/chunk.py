"""Chunked form of `gla_window_parallel`: O(L * chunk) memory instead of O(L^2), same results.

The gated linear part runs chunk by chunk in log space, with cumulative decays taken relative to
each chunk's start (so the intra-chunk decay matrix exp(A_i - A_j) is exact and never overflows)
and the inter-chunk state S, z carried in float32. The window part works on blocks of w queries,
each seeing only its own block and the previous one of keys (2w keys), which covers (i - w, i].
Tested against the naive form in values and gradients (tests/ops/test_gla_window_chunked.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..common import carried_window, exp_weights, extend_window, repeat_kv
from .naive import _combine
from .options import GlaWindowOptions


def _gla_chunks_scalar(fq, fk, log_g, v, S, z, chunk):
    """The scalar-gate case with every chunk's own terms computed at once.

    Only the carry of the [F, d] state from chunk to chunk is sequential (two small ops a chunk);
    the [C, C] decay matrices of all chunks together take B*H*L*C floats.
    """
    L = fq.shape[2]
    pad = (-L) % chunk  # padded tokens have no key and no decay, so they change nothing
    fq, fk, v, log_g = (F.pad(x, (0, 0, 0, pad)) for x in (fq, fk, v, log_g))
    n = fq.shape[2] // chunk
    q_c, k_c, v_c = (x.unflatten(2, (n, chunk)) for x in (fq, fk, v))  # [B, H, n, C, *]
    A = log_g[..., 0].unflatten(2, (n, chunk)).cumsum(-1)  # [B, H, n, C], relative to each chunk's start
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=fq.device).tril()
    decay = (A[..., :, None] - A[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    scores = (q_c @ k_c.transpose(-1, -2)) * decay
    k_to_end = k_c * (A[..., -1:] - A).exp()[..., None]
    chunk_S = k_to_end.transpose(-1, -2) @ v_c  # [B, H, n, F, d]
    chunk_z = k_to_end.sum(-2)
    total = A[..., -1].exp()  # [B, H, n]
    start_S, start_z = [], []
    for c in range(n):
        start_S.append(S)
        start_z.append(z)
        S = total[:, :, c, None, None] * S + chunk_S[:, :, c]
        z = total[:, :, c, None] * z + chunk_z[:, :, c]
    q_from_start = q_c * A.exp()[..., None]
    num = scores @ v_c + q_from_start @ torch.stack(start_S, 2)
    den = scores.sum(-1) + (q_from_start * torch.stack(start_z, 2)[..., None, :]).sum(-1)
    return num.flatten(2, 3)[:, :, :L], den.flatten(2, 3)[:, :, :L], S, z


def _gla_chunks(fq, fk, log_g, v, S, z, chunk):
    """Numerator, denominator of the gated linear part and the final S, z, chunk by chunk."""
    if log_g.shape[-1] == 1:
        return _gla_chunks_scalar(fq, fk, log_g, v, S, z, chunk)
    # A vector gate's [C, C, F] decays for all chunks at once would not fit: one chunk at a time.
    L = fq.shape[2]
    nums, dens = [], []
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=fq.device).tril()
    for start in range(0, L, chunk):
        sl = slice(start, min(start + chunk, L))
        q_c, k_c, g_c, v_c = fq[:, :, sl], fk[:, :, sl], log_g[:, :, sl], v[:, :, sl]
        n = q_c.shape[2]
        A = g_c.cumsum(dim=2)  # relative to this chunk's start: in [n * min log g, 0]
        diff = A[:, :, :, None, :] - A[:, :, None, :, :]
        decay = diff.masked_fill(~causal[:n, :n, None], float("-inf")).exp()
        if A.shape[-1] == 1:
            scores = (q_c @ k_c.transpose(-1, -2)) * decay[..., 0]
        else:
            scores = torch.einsum("bhif,bhjf,bhijf->bhij", q_c, k_c, decay)
        q_from_start = q_c * A.exp()
        nums.append(scores @ v_c + q_from_start @ S)
        dens.append(scores.sum(-1) + (q_from_start * z[:, :, None, :]).sum(-1))
        to_end = (A[:, :, -1:, :] - A).exp()
        total = A[:, :, -1, :].exp()
        S = total[..., None] * S + (k_c * to_end).transpose(-1, -2) @ v_c
        z = total * z + (k_c * to_end).sum(2)
    return torch.cat(nums, 2), torch.cat(dens, 2), S, z


def window_blocks(qw, keys, values, key_valid, window, scale, sinks):
    """Softmax over (i - w, i] for each new query; `keys` = w-1 carried keys followed by the L new ones."""
    H, L = qw.shape[1], qw.shape[2]
    n_rep = H // keys.shape[1]
    nb = -(-L // window)
    # One invalid key in front makes the new tokens start at offset w, so query block b sees key blocks b, b+1.
    pad_right = nb * window - L
    keys = F.pad(keys, (0, 0, 1, pad_right))
    values = F.pad(values, (0, 0, 1, pad_right))
    key_valid = F.pad(key_valid, (1, pad_right), value=False)
    q = F.pad(qw, (0, 0, 0, pad_right)).unflatten(2, (nb, window))  # [B, H, nb, w, d]

    def pairs(x, dim):  # blocks b and b+1 side by side: [.., nb, 2w, ..]
        blocks = x.unflatten(dim, (nb + 1, window))
        return torch.cat([blocks.narrow(dim, 0, nb), blocks.narrow(dim, 1, nb)], dim=dim + 1)

    k_pairs = repeat_kv(pairs(keys, 2), n_rep)
    v_pairs = repeat_kv(pairs(values, 2), n_rep)
    valid_pairs = pairs(key_valid, 1)  # [B, nb, 2w]
    scores = torch.einsum("bhnqd,bhnkd->bhnqk", q, k_pairs) * scale
    q_pos = torch.arange(window, device=qw.device)[:, None] + window
    k_pos = torch.arange(2 * window, device=qw.device)[None, :]
    band = (k_pos <= q_pos) & (k_pos > q_pos - window)
    mask = band[None, None, None] & valid_pairs[:, None, :, None, :]
    scores = scores.masked_fill(~mask, float("-inf"))
    sink_logits = None if sinks is None else sinks[None, :, None, None, :].expand(*scores.shape[:4], -1)
    weights, sink_weights = exp_weights(scores, sink_logits)
    num = torch.einsum("bhnqk,bhnkd->bhnqd", weights, v_pairs).flatten(2, 3)[:, :, :L]
    den = weights.sum(-1)
    if sink_weights is not None:
        den = den + sink_weights.sum(-1)
    return num, den.flatten(2, 3)[:, :, :L]


def gla_window_chunked(fq, fk, log_g, qw, kw, v, valid, state, options: GlaWindowOptions):
    """Same contract and results as `gla_window_parallel`, in O(L * (chunk + w)) memory."""
    n_rep = fq.shape[1] // kw.shape[1]
    keep = valid[:, None, :, None].to(fq.dtype)
    gla_num, gla_den, S, z = _gla_chunks(fq, fk * keep, log_g * keep, repeat_kv(v, n_rep), state["S"], state["z"],
                                         options.chunk)
    keys, values, key_valid = extend_window(state, kw, v, valid)
    win_num, win_den = window_blocks(qw, keys, values, key_valid, options.window, options.scale, options.sinks)
    y = _combine(gla_num, gla_den, win_num, win_den, options)
    new_state = {
        "S": S,
        "z": z,
        **carried_window(keys, values, key_valid, options.window),
    }
    return y, new_state

