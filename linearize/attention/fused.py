"""Lizard-family attention (Lizard, Liger) on the fused Triton kernel, where the kernel applies."""

from __future__ import annotations

import os

import torch

from .. import kernels
from ..ops import gla_window


def kernels_enabled() -> bool:
    """LINEARIZE_KERNELS=0 keeps the PyTorch ops everywhere (for A/B timings and debugging)."""
    return os.environ.get("LINEARIZE_KERNELS", "1") != "0"


def run(fq, fk, log_g, qw, kw, v, valid, *, state, start, caching, dtype, can_continue, query_scale=1.0,
        shared=False, unpadded=False, in_place=False, **options):
    """(y in `dtype`, new state or None) through the kernel, or None where it does not apply.

    It applies to multi-token passes from an empty state whose rows are each one run of tokens (left
    or right padding), with `can_continue` and no gradient needed to unpadded passes continuing
    `state` or filling a cache (`kernels.lizard_attention_continued`), and without gradients to
    single-token steps (`kernels.lizard_step`: float32 features, the rest as given, converted in the
    kernel). Operands of multi-token passes go in `dtype` (the projections' dtype: bf16 under autocast),
    sinks and alpha in float32; `query_scale` multiplies fq there only. `options` are
    `kernels.lizard_attention`'s (window, scale, sinks, alpha, eps, normalize); `shared` gives both
    branches one normaliser. `unpadded` says that every token is valid (the call had no attention
    mask): then `valid` is not read back from the device, a host sync per layer that would keep the
    host from queueing work ahead of the GPU. `in_place` lets a step write its new state into
    `state`'s tensors (a frozen cache's, whose store then copies nothing).
    """
    if not kernels_enabled():
        return None
    if fq.shape[2] == 1:
        if state is None or torch.is_grad_enabled():
            return None
        return kernels.lizard_step(fq if query_scale == 1.0 else fq * query_scale, fk, log_g, qw, kw, v, valid,
                                   state, shared=shared, in_place=in_place, out_dtype=dtype, **options)
    options |= float32_head_scalars(options)
    if start > 0 and (not can_continue or torch.is_grad_enabled()):
        return None
    # Checked for the operands as they will be cast (the PyTorch feature maps give float32 beside bf16
    # values), before any cast: a pass the kernel does not take copies nothing.
    if kernels.unsupported_reason(fq, fk, log_g, qw, kw, v, window=options["window"], sinks=options["sinks"],
                                  dtype=dtype):
        return None
    one_run, all_valid, lead = (True, True, None) if unpadded else row_layout(valid)
    if not (all_valid if start > 0 else one_run):
        return None
    operands = ((fq if query_scale == 1.0 else fq * query_scale).to(dtype), fk.to(dtype), log_g, qw.to(dtype),
                kw.to(dtype), v.to(dtype))
    # An unpadded first prefill that fills a cache continues an empty state: the kernel then returns
    # the new state too, instead of `gla_window.state_after` computing it again over the call.
    fills_cache = caching and all_valid and can_continue and not torch.is_grad_enabled()
    if start > 0 or fills_cache:
        if start == 0:
            (B, H, _, F), HKV, D = fq.shape, kw.shape[1], qw.shape[-1]
            state = gla_window.init_state(B, H, HKV, F, D, options["window"], device=fq.device)
        return kernels.lizard_attention_continued(*operands, state, shared=shared, **options)
    # Leading padding is rotated to the end of its row: every real token then sees only real tokens
    # before it (padding after them never reaches them), and the outputs are rotated back.
    if lead is None:
        y = kernels.lizard_attention(*operands, shared=shared, **options)
    else:
        L = valid.shape[1]
        shift = torch.remainder(torch.arange(L, device=valid.device) + lead[:, None], L)
        y = kernels.lizard_attention(*(rotate_rows(t, shift) for t in operands), shared=shared, **options)
        y = rotate_rows(y, torch.argsort(shift, dim=1))
    new_state = None
    if caching:
        new_state = gla_window.state_after(fk.float(), log_g, kw.float(), v.float(), options["window"], valid)
    return y, new_state


def float32_head_scalars(options: dict) -> dict:
    """`options`' sinks and alpha in float32 (what the multi-token kernels and the PyTorch ops take; a
    bf16 model keeps them in bf16, and only its decode steps take them as they are)."""
    sinks = options["sinks"]
    return {"sinks": None if sinks is None else sinks.float(), "alpha": options["alpha"].float()}


def features(q, k, w_q, w_k, position_embeddings, dtype):
    """(fq, fk, qw, kw) from the features kernel, or None where it does not apply (kernels off, or see
    `kernels.lizard_features`). Multi-token passes get them in `dtype`, the projections' (`run` would
    cast them to it); single-token steps in float32, as the step kernels take them. Where a gradient
    is needed (training), through `kernels.lizard_features_with_grad`."""
    if not kernels_enabled():
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, w_q, w_k)):
        # LINEARIZE_FEATURES_BACKWARD=0 keeps training's features on the PyTorch ops alone (A/B timings,
        # or a GPU where the backward kernel fails) while every other kernel stays on.
        if os.environ.get("LINEARIZE_FEATURES_BACKWARD", "1") == "0":
            return None
        return kernels.lizard_features_with_grad(q, k, w_q, w_k, position_embeddings, dtype)
    dtype = torch.float32 if q.shape[2] == 1 else dtype
    return kernels.lizard_features(q, k, w_q, w_k, position_embeddings, dtype)


def row_layout(valid: torch.Tensor) -> tuple[bool, bool, torch.Tensor | None]:
    """(each row's valid tokens form one run, all tokens valid, each row's leading padding or None
    when no row has any), read back from the device in one transfer."""
    runs = valid[:, :1].int() + (valid[:, 1:] & ~valid[:, :-1]).sum(1, keepdim=True)
    lead = (~valid).int().argmin(1) * valid.any(1)
    one_run, all_valid, padded = torch.stack([(runs <= 1).all(), valid.all(), lead.any()]).tolist()
    return one_run, all_valid, lead if padded else None


def rotate_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [B, H, L, ...] with each row's positions taken in the order `index` [B, L] gives."""
    return x.gather(2, index[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[-1]))
