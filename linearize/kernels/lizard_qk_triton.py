"""Lizard attention from the model's q and k: the Hedgehog features formed inside the forward kernels.

Where the window takes q and k as they are (no RoPE in it), `lizard_triton`'s op would read five
[B, H, L, d] tensors (phi_q(q), phi_k(k), q, k, v) that a features kernel first wrote. Here the forward's
chunk kernel and state pass form phi_q(q), phi_k(k) from the q and k tiles they load anyway
(`lizard_triton._hedgehog`), so the forward reads q, k and v only, as `chunk_simple_gla` does. The
backward recomputes the features with the features kernel, then runs the attention's backward and the
features' backward (`lizard_triton.attention_backward`, `features_triton.features_backward`).

Importing this module needs triton; `linearize.kernels` guards that import.
"""

from __future__ import annotations

import torch

from .features_triton import features_backward, lizard_features
from .lizard_triton import Config, _forward, attention_backward


class LizardQKFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, w_q, w_k, log_g, v, sinks, alpha, window, scale, eps, normalize, cfg, save, shared):
        inputs, y, parts, states, _ = _forward(None, None, log_g, q, k, v, sinks, alpha, window, scale, eps,
                                               normalize, cfg, save, shared, weights=(w_q, w_k))
        if save:
            _, _, log_g, q, k, v, sinks, alpha = inputs
            ctx.save_for_backward(q, k, w_q, w_k, log_g, v, sinks, alpha, *parts, *states)
            ctx.options = (window, scale, normalize, cfg, shared)
        return y

    @staticmethod
    def backward(ctx, dy):
        q, k, w_q, w_k, log_g, v, sinks, alpha, *rest = ctx.saved_tensors
        grad_q, grad_k, grad_wq, grad_wk, _, grad_v = ctx.needs_input_grad[:6]
        fq, fk, _, _ = lizard_features(q, k, w_q, w_k, None, q.dtype)
        dfq, dfk, d_log_g, dqw, dkw, dv, dsinks, dalpha = attention_backward(
            dy, (fq, fk, log_g, q, k, v, sinks, alpha, *rest), *ctx.options, grad_q, grad_k, grad_v)
        del fq, fk
        dq, dk, dw_q, dw_k = features_backward(q, k, w_q, w_k, (), dfq, dfk, (), q.dtype, grad_q or grad_k,
                                               grad_wq or grad_wk)
        dq = dq + dqw if grad_q else None
        dk = dk + dkw if grad_k else None
        return (dq, dk, dw_q, dw_k, d_log_g, dv, dsinks, dalpha) + (None,) * 7


def lizard_attention_qk_triton(q, k, w_q, w_k, log_g, v, *, window, scale, sinks, alpha, eps=1e-6, normalize=True,
                               shared=False, config=None):
    """The kernel path of `linearize.kernels.lizard_attention_qk` (inputs already checked)."""
    if shared and not normalize:
        raise ValueError("shared=True needs normalize=True (one normaliser for both branches)")
    tensors = (q, k, w_q, w_k, log_g, v, sinks, alpha)
    save = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    options = (int(window), float(scale), float(eps), bool(normalize), config or Config.default(q.dtype), save,
               bool(shared))
    if not save:
        return _forward(None, None, log_g, q, k, v, sinks, alpha, *options, weights=(w_q, w_k))[1]
    return LizardQKFunction.apply(*tensors, *options)
