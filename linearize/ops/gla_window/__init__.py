"""Gated linear attention plus a sliding softmax window (Lizard, Liger): the one dispatch point.

    y_i = beta * phi_q_i^T S_i / (phi_q_i^T z_i + eps) + alpha_h * softmax window over (i - w, i] with sinks

Forms, each tested against `naive` in values and gradients:
  naive.py        `gla_window_parallel` / `gla_window_step`: the obviously-correct reference, O(L^2)
  chunk.py        `gla_window_chunked`: the same in chunks, O(L * chunk) memory
  triton.py       the fused Triton forward and backward over a fresh pass (docs/kernels.md)
  continued.py    the fused kernel continuing a carried state (prefill after prefill)
  step_triton.py  one decode step in two kernels

`gla_window` is what the attention modules call: it picks the Triton kernels where the backend
(`linearize.ops.backend`) allows them and they take the inputs, and the PyTorch forms otherwise.
`lizard_attention` is the same op from scratch (no state, no padding), for benchmarks and tests.
"""

from __future__ import annotations

import torch

from .. import backend
from .chunk import gla_window_chunked
from .naive import gla_window_step, init_state, state_after


def unsupported_reason(fq, fk, log_g, qw, kw, v, *, window, sinks, dtype=None) -> str | None:
    """None when the fused kernel takes these inputs (cast to `dtype` where given), else why not."""
    if not backend.use_kernels():
        return "the backend is torch" if backend.get_backend() == "torch" else "triton or a CUDA device missing"
    from .triton import supports

    return supports(fq, fk, log_g, qw, kw, v, window=window, sinks=sinks, dtype=dtype)


def lizard_attention(fq, fk, log_g, qw, kw, v, *, window, scale, sinks, alpha, eps=1e-6, normalize=True,
                     shared=False):
    """The op from scratch (no carried state, no padding, beta = 1), y [B, H, L, d] in the inputs' dtype.

    With normalize=False the linear part is phi_q_i^T S_i alone (Liger's form; scale fq for its beta);
    with shared=True both branches share one normaliser (alpha unused). fq, fk [B,H,L,F]; log_g
    [B,H,L,1] or [B,H,L,F]; qw [B,H,L,d]; kw, v [B,H_kv,L,d]; sinks [H, M] or None; alpha [H].
    Differentiable in all tensors.
    """
    options = {"window": window, "scale": scale, "sinks": sinks, "alpha": alpha, "eps": eps, "normalize": normalize,
               "shared": shared}
    if unsupported_reason(fq, fk, log_g, qw, kw, v, window=window, sinks=sinks) is None:
        from .triton import lizard_attention_triton

        return lizard_attention_triton(fq, fk, log_g, qw, kw, v, **options)
    return _chunked_from_scratch(fq, fk, log_g, qw, kw, v, **options)


def lizard_attention_continued(fq, fk, log_g, qw, kw, v, state, **options):
    """`lizard_attention` continuing `state` through the kernel: (y, new state); see `continued.py`."""
    from .continued import lizard_attention_continued as continued

    return continued(fq, fk, log_g, qw, kw, v, state, **options)


@torch.no_grad()
def lizard_step(fq, fk, log_g, qw, kw, v, valid, state, *, window, scale, sinks, alpha, eps=1e-6, normalize=True,
                shared=False, in_place=False, out_dtype=torch.float32):
    """`gla_window_step` (beta = 1) through the decode-step kernels: (y in `out_dtype`, new state), or
    None where they do not apply (where the fused kernels would not, or the features, gate or state
    not float32, or window < 2). `in_place`: the new state is written into `state`'s tensors."""
    # The step kernels convert qw, kw and v as they load them: checked as the float32 they become.
    if unsupported_reason(fq, fk, log_g, qw, kw, v, window=window, sinks=sinks, dtype=torch.float32):
        return None
    from .step_triton import lizard_decode_step, step_unsupported

    if step_unsupported(fq, log_g, state, window=window):
        return None
    return lizard_decode_step(fq, fk, log_g, qw, kw, v, valid, state, window=window, scale=scale, sinks=sinks,
                              alpha=alpha, normalize=normalize, shared=shared, eps=eps, in_place=in_place,
                              out_dtype=out_dtype)


def gla_window(fq, fk, log_g, qw, kw, v, valid, state, *, window, scale, sinks, alpha, beta=1.0, normalize=True,
               shared=False, eps=1e-6, chunk=64, start=0, caching=False, dtype=None, can_continue=True,
               unpadded=False, in_place=False):
    """One call of the op in the form that fits it: (y, new state or None).

    `state` is the carried state or None (an empty one); `start` how many tokens came before this
    call; `caching` whether the state after the call is wanted. The kernels take multi-token passes
    from an empty state whose rows are each one run of tokens (left or right padding), with
    `can_continue` and no gradient needed also unpadded passes continuing `state` or filling a cache,
    and single-token steps without gradients. Their operands go in `dtype` (the projections': bf16
    under autocast). `unpadded`: every token is valid (the call had no attention mask), so `valid` is
    not read back from the device. `in_place`: a step may write its new state into `state`'s tensors.
    Elsewhere the PyTorch forms run in float32: the recurrent step for a single token after a state,
    the chunked form otherwise.
    """
    options = {"window": window, "scale": scale, "sinks": sinks, "alpha": alpha, "eps": eps}
    out = _through_kernels(fq, fk, log_g, qw, kw, v, valid, state, start=start, caching=caching,
                           dtype=dtype or qw.dtype, can_continue=can_continue, query_scale=beta, normalize=normalize,
                           shared=shared, unpadded=unpadded, in_place=in_place, **options)
    if out is not None:
        return out
    options |= float32_head_scalars(options)
    operands = [t.float() for t in (fq, fk, log_g, qw, kw, v)]
    options |= {"beta": beta, "normalize": normalize, "shared": shared}
    if state is None:
        B, H, _, F = fq.shape
        state = init_state(B, H, kw.shape[1], F, v.shape[-1], window, device=fq.device)
    elif fq.shape[2] == 1:
        return gla_window_step(*operands, valid, state, **options)
    return gla_window_chunked(*operands, valid, state, **options, chunk=chunk)


def _through_kernels(fq, fk, log_g, qw, kw, v, valid, state, *, start, caching, dtype, can_continue, query_scale,
                     shared, unpadded, in_place, **options):
    """(y in `dtype`, new state or None) through the kernels, or None where they do not apply."""
    if not backend.use_kernels():
        return None
    if query_scale != 1.0 and options.get("normalize", True):
        return None  # beta scales an unnormalised linear part only: folded into the queries below
    if fq.shape[2] == 1:
        if state is None or torch.is_grad_enabled():
            return None
        return lizard_step(fq if query_scale == 1.0 else fq * query_scale, fk, log_g, qw, kw, v, valid, state,
                           shared=shared, in_place=in_place, out_dtype=dtype, **options)
    options |= float32_head_scalars(options)
    if start > 0 and (not can_continue or torch.is_grad_enabled()):
        return None
    # Checked for the operands as they will be cast (the PyTorch feature maps give float32 beside bf16
    # values), before any cast: a pass the kernel does not take copies nothing.
    if unsupported_reason(fq, fk, log_g, qw, kw, v, window=options["window"], sinks=options["sinks"], dtype=dtype):
        return None
    one_run, all_valid, lead = (True, True, None) if unpadded else row_layout(valid)
    if not (all_valid if start > 0 else one_run):
        return None
    operands = ((fq if query_scale == 1.0 else fq * query_scale).to(dtype), fk.to(dtype), log_g, qw.to(dtype),
                kw.to(dtype), v.to(dtype))
    # An unpadded first prefill that fills a cache continues an empty state: the kernel then returns
    # the new state too, instead of `state_after` computing it again over the call.
    fills_cache = caching and all_valid and can_continue and not torch.is_grad_enabled()
    if start > 0 or fills_cache:
        if not options.pop("normalize", True):
            return None  # the continued kernel has no unnormalised form (Liger's passes never continue)
        if start == 0:
            (B, H, _, F), HKV, D = fq.shape, kw.shape[1], qw.shape[-1]
            state = init_state(B, H, HKV, F, D, options["window"], device=fq.device)
        return lizard_attention_continued(*operands, state, shared=shared, **options)
    # Leading padding is rotated to the end of its row: every real token then sees only real tokens
    # before it (padding after them never reaches them), and the outputs are rotated back.
    if lead is None:
        y = lizard_attention(*operands, shared=shared, **options)
    else:
        L = valid.shape[1]
        shift = torch.remainder(torch.arange(L, device=valid.device) + lead[:, None], L)
        y = lizard_attention(*(rotate_rows(t, shift) for t in operands), shared=shared, **options)
        y = rotate_rows(y, torch.argsort(shift, dim=1))
    new_state = None
    if caching:
        new_state = state_after(fk.float(), log_g, kw.float(), v.float(), options["window"], valid)
    return y, new_state


def float32_head_scalars(options: dict) -> dict:
    """`options`' sinks and alpha in float32 (what the multi-token kernels and the PyTorch forms take; a
    bf16 model keeps them in bf16, and only its decode steps take them as they are)."""
    sinks = options["sinks"]
    return {"sinks": None if sinks is None else sinks.float(), "alpha": options["alpha"].float()}


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


def _chunked_from_scratch(fq, fk, log_g, qw, kw, v, *, window, scale, sinks, alpha, eps, normalize, shared):
    # The chunked form mixes its float32 state with the inputs: compute in at least float32.
    dtype = torch.promote_types(qw.dtype, torch.float32)
    B, H, L, F = fq.shape
    state = init_state(B, H, kw.shape[1], F, qw.shape[-1], window, device=fq.device, dtype=dtype)
    valid = torch.ones(B, L, dtype=torch.bool, device=fq.device)
    y, _ = gla_window_chunked(*(t.to(dtype) for t in (fq, fk, log_g, qw, kw, v)), valid, state, window=window,
                              scale=scale, sinks=None if sinks is None else sinks.to(dtype), alpha=alpha.to(dtype),
                              beta=1.0, normalize=normalize, shared=shared, eps=eps)
    return y.to(qw.dtype)
