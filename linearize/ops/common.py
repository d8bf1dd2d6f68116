"""Small pieces shared by the attention ops."""

from __future__ import annotations

import torch


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """What the PyTorch forms compute and carry states in: float64 for float64 inputs (the references'
    checks), float32 for everything else, 16-bit included."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, H_kv, L, d] -> [B, H_kv * n_rep, L, d], each KV head serving n_rep query heads."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


def cumsum_over_tokens(log_g: torch.Tensor, reverse: bool = False) -> torch.Tensor:
    """Cumulative sum of [B, H, L, 1 or F] gates over the tokens (dim 2), from the end with `reverse`.

    A scalar gate is summed as [B, H, L]: scanning dim 2 of [B, H, L, 1] takes torch's outer-dim scan,
    one thread per (B, H) row (683 us for [1, 32, 16K, 1] in the 8B prefill profile, docs/benchmarks.md).
    """
    x = log_g[..., 0] if log_g.shape[-1] == 1 else log_g.movedim(2, -1)
    x = x.flip(-1).cumsum(-1).flip(-1) if reverse else x.cumsum(-1)
    return x[..., None] if log_g.shape[-1] == 1 else x.movedim(-1, 2)


def keep_last(x: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """The last n entries along dim (n may be 0, where x[-0:] would keep everything)."""
    return x.narrow(dim, x.shape[dim] - n, n)


def exp_weights(scores: torch.Tensor, extra_logits: torch.Tensor | None = None):
    """exp(s - m) for masked scores (-inf = masked) and optional extra logits sharing the shift m.

    m is the row max over both, and 0 for a row with nothing unmasked, so such rows give zeros
    instead of NaN. Returns (weights, extra_weights or None).
    """
    m = scores.amax(dim=-1, keepdim=True)
    if extra_logits is not None:
        m = torch.maximum(m, extra_logits.amax(dim=-1, keepdim=True))
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    weights = torch.exp(scores - m)
    extra = torch.exp(extra_logits - m) if extra_logits is not None else None
    return weights, extra


def safe_divide(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """num / den where den > 0, else 0 (rows that attended to nothing, i.e. padding)."""
    return num / torch.where(den > 0, den, torch.ones_like(den))


def extend_window(state: dict, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor):
    """The carried window (w-1 keys, values, validity) followed by the new tokens."""
    return (torch.cat([state["win_k"], k], dim=2), torch.cat([state["win_v"], v], dim=2),
            torch.cat([state["win_valid"], valid], dim=1))


def carried_window(keys: torch.Tensor, values: torch.Tensor, key_valid: torch.Tensor, window: int) -> dict:
    """The state entries for the next call: the last w-1 keys, values and their validity."""
    return {"win_k": keep_last(keys, window - 1, dim=2), "win_v": keep_last(values, window - 1, dim=2),
            "win_valid": keep_last(key_valid, window - 1, dim=1)}
