"""Stage 1 weighted toward the positions where the teacher attends far (`DistillConfig.far_weight`).

A linearized layer attends to its most recent keys (its window: the query's own key and the `reach - 1`
before it) with exact softmax and to the rest through an approximation (a linear state). Where the
teacher puts much of a query's attention on keys beyond that reach, the approximation carries the
output, and retrieval lives or dies there; an unweighted transfer loss spends most of its gradient on
positions the window already gets right. `far_mass` measures, per query and head, the teacher's softmax
probability on keys `reach` or more positions back, from the teacher's own rotated q and k;
`far_position_weights` turns it into per-position weights of the attention-transfer MSE (`weighted_mse`).
"""

from __future__ import annotations

import torch

QUERY_CHUNK = 256  # queries a chunk: their [B, H, chunk, L] float32 probabilities exist at a time


@torch.no_grad()
def far_mass(q: torch.Tensor, k: torch.Tensor, *, scale: float, reach: int, softcap: float | None = None,
             allowed: torch.Tensor | None = None, chunk: int = QUERY_CHUNK) -> torch.Tensor:
    """[B, H, L] float32: for each query t and head, the sum of the teacher's softmax probabilities over
    the keys s it sees with t - s >= `reach` (reach 0: every key it sees). q [B, H, L, d] and k
    [B, H_kv, L, d] are rotated as the teacher attends with them (query head h reads key head
    h // (H / H_kv), as `repeat_kv` repeats them); the logits are q k^T * scale, capped as Gemma 2 caps
    them where `softcap` is given. `allowed`: a [B or 1, H or 1, L, L] bool mask of the keys each query
    sees (default causal); a query that sees none has mass 0. `chunk` queries at a time, so memory is
    O(L * chunk) a head rather than O(L^2)."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1 query, got {chunk}")
    if reach < 0:
        raise ValueError(f"reach must be >= 0 keys, got {reach}")
    B, H, L, d = q.shape
    kv_heads = k.shape[1]
    group = H // kv_heads
    queries = q.float().view(B, kv_heads, group, L, d)
    keys_t = k.float()[:, :, None].transpose(-1, -2)  # [B, H_kv, 1, d, L]
    key_pos = torch.arange(L, device=q.device)
    far = torch.empty(B, kv_heads, group, L, dtype=torch.float32, device=q.device)
    for start in range(0, L, chunk):
        end = min(start + chunk, L)
        logits = (queries[..., start:end, :] @ keys_t) * scale  # [B, H_kv, group, c, L]
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        query_pos = torch.arange(start, end, device=q.device)[:, None]
        sees = key_pos <= query_pos if allowed is None else _grouped(allowed[..., start:end, :], kv_heads, group)
        probs = torch.softmax(logits.masked_fill(~sees, float("-inf")), dim=-1).nan_to_num(0.0)
        beyond = key_pos <= query_pos - reach  # [c, L]: keys `reach` or more positions back
        far[..., start:end] = (probs * beyond).sum(-1)
    return far.view(B, H, L)


def _grouped(mask: torch.Tensor, kv_heads: int, group: int) -> torch.Tensor:
    """A [B or 1, H or 1, c, L] mask in `far_mass`'s [B or 1, H_kv or 1, group or 1, c, L] layout."""
    if mask.shape[1] == 1:
        return mask[:, :, None]
    return mask.reshape(mask.shape[0], kv_heads, group, *mask.shape[2:])


def far_position_weights(far: torch.Tensor, far_weight: float) -> torch.Tensor:
    """[B, L] weights w_t = 1 + far_weight * (far_t averaged over heads) from `far` [B, H, L], divided by
    their mean over each sequence: the mean weight is 1, so far_weight moves the emphasis between
    positions, not the loss's scale."""
    weights = 1 + far_weight * far.float().mean(1)
    return weights / weights.mean(-1, keepdim=True)


def weighted_mse(out: torch.Tensor, target: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The mean over [B, L, C] of weights[b, t] * (out - target)^2, in float32 (weights [B, L]; all ones
    gives `mse_loss`'s value). Its gradient reaches `out` alone: the target and weights are constants."""
    squared = (out - target.detach()).float().square()
    return (squared * weights.detach()[..., None]).mean()
