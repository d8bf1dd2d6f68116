"""Fused GPU kernels (Triton). Optional: everything here imports and runs without triton or a GPU.

`lizard_attention` runs the fused Lizard kernel when it can (triton importable, CUDA tensors, or CPU
tensors under TRITON_INTERPRET=1; supported shapes and dtypes) and the chunked PyTorch op otherwise,
with the same results. `lizard_attention_continued` continues a carried state around the kernel
(prefill only, no gradients); `lizard_step` is one decode step. `still_attention` is STILL's attention
over a fresh pass (training, scoring, a prompt's prefill). Design and limits: docs/kernels.md.
"""

from __future__ import annotations

import functools
import os

import torch

from ..ops import gla_window
from ..ops.common import carried_window, extend_window, repeat_kv
from ..ops.gla_window_chunked import gla_window_chunked


@functools.cache
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _interpreting() -> bool:
    """TRITON_INTERPRET=1: Triton kernels run on CPU tensors through numpy (slow; for tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def available() -> bool:
    """Whether the Triton kernels can run here: triton importable and a CUDA device or interpreter mode."""
    return _triton_importable() and (torch.cuda.is_available() or _interpreting())


def unsupported_reason(fq, fk, log_g, qw, kw, v, *, window, sinks, dtype=None) -> str | None:
    """None when `lizard_attention` would take the kernel path for these inputs (cast to `dtype` where
    given), else why not."""
    if not available():
        return "triton or a CUDA device (or TRITON_INTERPRET=1) missing"
    from .lizard_triton import supports

    return supports(fq, fk, log_g, qw, kw, v, window=window, sinks=sinks, dtype=dtype)


def lizard_attention(fq, fk, log_g, qw, kw, v, *, window, scale, sinks, alpha, eps=1e-6, normalize=True,
                     shared=False):
    """Lizard attention from scratch (no carried state, no padding), y [B, H, L, d] in the inputs' dtype.

    y_i = phi_q_i^T S_i / (phi_q_i^T z_i + eps) + alpha_h * softmax window over (i - w, i] with sinks,
    i.e. `gla_window_parallel` with an empty state, all tokens valid, beta = 1, shared=False; with
    normalize=False the linear part is phi_q_i^T S_i alone (Liger's form; scale fq for its beta); with
    shared=True both branches share one normaliser (`gla_window_parallel`'s shared=True; alpha unused).
    fq, fk [B,H,L,F]; log_g [B,H,L,1] or [B,H,L,F]; qw [B,H,L,d]; kw, v [B,H_kv,L,d]; sinks [H, M] or
    None; alpha [H]. Differentiable in all tensors.
    """
    options = {"window": window, "scale": scale, "sinks": sinks, "alpha": alpha, "eps": eps, "normalize": normalize,
               "shared": shared}
    if unsupported_reason(fq, fk, log_g, qw, kw, v, window=window, sinks=sinks) is None:
        from .lizard_triton import lizard_attention_triton

        return lizard_attention_triton(fq, fk, log_g, qw, kw, v, **options)
    return _chunked(fq, fk, log_g, qw, kw, v, **options)


@torch.no_grad()
def lizard_step(fq, fk, log_g, qw, kw, v, valid, state, *, window, scale, sinks, alpha, eps=1e-6, normalize=True,
                shared=False, in_place=False, out_dtype=torch.float32):
    """`gla_window_step` (beta = 1) through the decode-step kernels: (y in `out_dtype`, new state), or
    None where they do not apply (where the fused kernels would not, or the features, gate or state
    not float32, or window < 2). `in_place`: the new state is written into `state`'s tensors."""
    # The step kernels convert qw, kw and v as they load them: checked as the float32 they become.
    if unsupported_reason(fq, fk, log_g, qw, kw, v, window=window, sinks=sinks, dtype=torch.float32):
        return None
    from .decode_triton import lizard_decode_step, step_unsupported

    if step_unsupported(fq, log_g, state, window=window):
        return None
    return lizard_decode_step(fq, fk, log_g, qw, kw, v, valid, state, window=window, scale=scale, sinks=sinks,
                              alpha=alpha, normalize=normalize, shared=shared, eps=eps, in_place=in_place,
                              out_dtype=out_dtype)


def still_unsupported(q, k, features: int) -> str | None:
    """None when `still_attention` would run the kernels for these inputs, else why not."""
    if not available():
        return "triton or a CUDA device (or TRITON_INTERPRET=1) missing"
    from .still_triton import supports

    return supports(q, k, features)


def still_attention(q, k, v, fq, fk, gate, fold, valid, *, scale, eps=1e-6):
    """STILL's attention over a fresh pass through the kernels (`still_triton.still_attention_triton`:
    the fold times from `ops.still.fresh_routing`); check `still_unsupported` first."""
    from .still_triton import still_attention_triton

    return still_attention_triton(q, k, v, fq, fk, gate, fold, valid, scale=scale, eps=eps)


@torch.no_grad()
def lizard_features(q, k, w_q, w_k, position_embeddings=None, dtype=torch.float32):
    """Lizard's Hedgehog features and window queries/keys in one kernel (`features_triton.lizard_features`:
    (fq, fk per query head, qw, kw) in `dtype`), or None where it does not apply (no kernels here, or see
    `features_triton.features_unsupported`)."""
    if not available():
        return None
    from .features_triton import features_unsupported
    from .features_triton import lizard_features as features

    if features_unsupported(q, k, w_q):
        return None
    return features(q, k, w_q, w_k, position_embeddings, dtype)


def lizard_features_with_grad(q, k, w_q, w_k, position_embeddings=None, dtype=torch.float32):
    """`lizard_features` for training: differentiable in q, k and both weights
    (`features_triton.LizardFeaturesFunction`), or None where it does not apply. Without
    `position_embeddings` the window's qw, kw are q and k in `dtype`."""
    if not available():
        return None
    from .features_triton import LizardFeaturesFunction, features_unsupported

    if features_unsupported(q, k, w_q) or min(q.shape[-1], w_q.shape[-1]) < 16:  # the backward's tiles
        return None
    cos, sin = position_embeddings if position_embeddings is not None else (None, None)
    out = LizardFeaturesFunction.apply(q, k, w_q, w_k, cos, sin, dtype)
    return out if cos is not None else (*out, q.to(dtype), k.to(dtype))


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
    from .lizard_triton import lizard_attention_parts

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


def _chunked(fq, fk, log_g, qw, kw, v, *, window, scale, sinks, alpha, eps, normalize, shared):
    # The chunked op mixes its float32 state with the inputs: compute in at least float32.
    dtype = torch.promote_types(qw.dtype, torch.float32)
    B, H, L, F = fq.shape
    state = gla_window.init_state(B, H, kw.shape[1], F, qw.shape[-1], window, device=fq.device, dtype=dtype)
    valid = torch.ones(B, L, dtype=torch.bool, device=fq.device)
    y, _ = gla_window_chunked(*(t.to(dtype) for t in (fq, fk, log_g, qw, kw, v)), valid, state, window=window,
                              scale=scale, sinks=None if sinks is None else sinks.to(dtype), alpha=alpha.to(dtype),
                              beta=1.0, normalize=normalize, shared=shared, eps=eps)
    return y.to(qw.dtype)
