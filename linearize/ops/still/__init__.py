"""STILL: Self-Saliency routing into a fixed softmax budget plus an NP-Map gated linear state: the one
dispatch point.

Forms, each tested against `naive.still_parallel` in values (and gradients where they have any):
  routing.py  the routing every form shares (which keys take the softmax slots, and when each folds
              into the linear state); `fresh_routing` and `continued_routing` (the fold times of a
              fresh or a continued call, and the state after it) for the kernels
  naive.py    `still_parallel` (the reference), `still_step` (one decode step)
  triton.py   the attention over a sequence given each key's fold time, in fused kernels: a fresh
              pass (differentiable), or the forward's parts for a continued call (inference only)

`still` is what the attention module calls: the step for one token after a state; where the backend
(`linearize.ops.backend`) allows the kernels and they take the inputs, the kernels in blocks of
KERNEL_BLOCK tokens (the first one fresh when the call is, each next one continuing from the state
the previous left, so a prefill's cost grows linearly with its length), or a fresh pass in one
differentiable call when gradients are wanted; the naive form in blocks of MAX_PARALLEL tokens
otherwise (which includes a continued call that needs gradients).
"""

from __future__ import annotations

import torch

from .. import backend
from ..common import repeat_kv
from .naive import init_state, still_parallel, still_step
from .routing import continued_routing, fresh_routing

MAX_PARALLEL = 2048  # tokens per call of the parallel form: it holds [L, K + W + L] scores per head
# Tokens per kernel call for calls without gradients: a call's cost grows with the square of its keys
# (slots, window and new tokens), so long inputs go in blocks, each carrying the state on.
KERNEL_BLOCK = 8192

__all__ = ["KERNEL_BLOCK", "MAX_PARALLEL", "init_state", "still", "still_step", "unsupported_reason"]


def unsupported_reason(q, k, features: int, dtype: torch.dtype | None = None) -> str | None:
    """None when the kernels (fresh and continued calls, their operands in `dtype`, default q's) take
    these inputs, else why not."""
    if not backend.use_kernels():
        return "the backend is torch" if backend.get_backend() == "torch" else "triton or a CUDA device missing"
    from .triton import supports

    return supports(q, k, features, dtype)


def still(q, k, v, valid, gate, state, phi_q, phi_k, *, fresh, start, caching, dtype=None, step=still_step,
          **options):
    """(y, new state) over L new tokens continuing `state` (`init_state`'s when `fresh`).

    q [B,H,L,d] and k [B,H_kv,L,d] carry RoPE; gate [B,H,L,d] or None; phi_q, phi_k the feature maps.
    `options` are the forms' (window, chunk, per_chunk, routing, scale, eps); `caching` whether the
    state after the call is wanted; `dtype` the kernels' operand dtype (the projections'); `step`
    the one-token form (the decoder may swap in a compiled one).
    """
    L = q.shape[2]
    if not fresh and L == 1:
        return step(q, k, v, valid, gate, state, phi_q, phi_k, **options)
    dtype = dtype or q.dtype
    if unsupported_reason(q, k, phi_q.out_dim, dtype) is None:
        if not _wants_gradients(q, k, v, gate, phi_q, phi_k):
            def through_kernels(*block, start, fresh, keep):
                run = _fresh_pass_through_kernels if fresh else _continued_through_kernels
                return run(*block, phi_q, phi_k, start=start, caching=keep, dtype=dtype, **options)

            return _in_blocks(KERNEL_BLOCK, through_kernels, q, k, v, valid, gate, state, start=start, fresh=fresh,
                              caching=caching)
        if fresh:
            # Training: one differentiable pass (the continued calls' kernels have no backward).
            return _fresh_pass_through_kernels(q, k, v, valid, gate, state, phi_q, phi_k, start=start,
                                               caching=caching, dtype=dtype, **options)

    # Long inputs go through the parallel form in blocks too (the same results, bounded memory).
    def parallel(*block, start, fresh, keep):
        return still_parallel(*block, phi_q, phi_k, **options, start=start, fresh=fresh, keep_state=keep)

    return _in_blocks(MAX_PARALLEL, parallel, q, k, v, valid, gate, state, start=start, fresh=fresh, caching=caching)


def _in_blocks(size, run, q, k, v, valid, gate, state, *, start, fresh, caching):
    """`run(q, k, v, valid, gate, state, start=, fresh=, keep=)` over blocks of `size` tokens, each
    continuing from the state the previous one left (only the first fresh, when `fresh` is; the state
    kept after every block but the last, and after that one when `caching`): (y, the state after)."""
    L = q.shape[2]
    outputs = []
    for lo in range(0, L, size):
        part = slice(lo, lo + size)
        y, state = run(q[:, :, part], k[:, :, part], v[:, :, part], valid[:, part],
                       None if gate is None else gate[:, :, part], state,
                       start=start + lo, fresh=fresh and lo == 0, keep=caching or lo + size < L)
        outputs.append(y)
    return (outputs[0] if len(outputs) == 1 else torch.cat(outputs, 2)), state


def _wants_gradients(q, k, v, gate, phi_q, phi_k) -> bool:
    """Whether autograd would record the call: an input or a feature map's parameter needs a gradient."""
    if not torch.is_grad_enabled():
        return False
    if any(t is not None and t.requires_grad for t in (q, k, v, gate)):
        return True
    return any(p.requires_grad for phi in (phi_q, phi_k) if isinstance(phi, torch.nn.Module) for p in phi.parameters())


def _continued_through_kernels(q, k, v, valid, gate, state, phi_q, phi_k, *, start, caching, dtype, **options):
    """A call continuing `state` (inference only): the routing in PyTorch (`continued_routing`), the
    attention over the combined sequence (slots, window, new tokens) in the fresh pass's forward
    kernel, with zero queries for the P keys before the new tokens (their rows are dropped); the keys
    folded before the call, held in S and z, join outside the kernel, with the published form's
    conventions (`still_parallel`): only the softmax terms carry the row max, eps once in the
    denominator, the gate on the whole linear numerator:

      y = (acc_soft + g * (acc_lin + fq . S)) / (den + fq . z),  acc = y_part * den, den with eps.
    """
    from .triton import still_attention_parts

    B, H, L, _ = q.shape
    n_rep = H // k.shape[1]
    with torch.no_grad():
        keys, values, key_valid, fold, fk, next_state = continued_routing(q, k, v, valid, state, phi_k, start=start,
                                                                          keep_state=caching, **options)
        fq = phi_q(q)
        P = keys.shape[2] - L
        # Unused slots are invalid in one KV head and maybe not in another, where the kernel reads
        # validity per batch row: each KV head runs as a batch row of its n_rep query heads.
        rows = B * k.shape[1]

        def prefixed(t):  # zero rows for the P keys before the new tokens, one batch row per KV head
            t = torch.cat([t.new_zeros(*t.shape[:2], P, t.shape[3]), t], dim=2)
            return t.reshape(rows, n_rep, *t.shape[2:])

        y_soft, y_lin, den = still_attention_parts(
            prefixed(q.to(dtype)), keys.to(dtype).reshape(rows, 1, *keys.shape[2:]),
            values.to(dtype).reshape(rows, 1, *values.shape[2:]), prefixed(fq), fk.reshape(rows, n_rep, *fk.shape[2:]),
            fold.reshape(rows, 1, -1), key_valid.reshape(rows, -1), scale=options["scale"], eps=options["eps"])
        y_soft, y_lin = (t.view(B, H, -1, t.shape[-1])[:, :, P:] for t in (y_soft, y_lin))
        den = den.view(B, H, -1)[:, :, P:, None]
        fq = fq.float()
        lin = den * y_lin + fq @ state["S"].float()
        if gate is not None:
            lin = gate.float() * lin
        y = (den * y_soft + lin) / (den + (fq * state["z"].float()[:, :, None, :]).sum(-1, keepdim=True))
    return y.to(dtype), next_state


def _fresh_pass_through_kernels(q, k, v, valid, gate, state, phi_q, phi_k, *, start, caching, dtype, **options):
    """The routing in PyTorch (`fresh_routing`), the attention in one fused pass over the whole input,
    its GEMMs in `dtype`; and the state after it when caching (a prompt's prefill: no [L, L] scores,
    so no blocks of MAX_PARALLEL tokens either)."""
    from .triton import still_attention_triton

    fq = phi_q(q)
    fk = phi_k(repeat_kv(k, q.shape[1] // k.shape[1]))
    with torch.no_grad():
        fold, next_state = fresh_routing(q, k, v, valid, state, start=start, **options,
                                         fk=fk.detach() if caching else None)
    y = still_attention_triton(q.to(dtype), k.to(dtype), v.to(dtype), fq, fk, gate, fold, valid,
                               scale=options["scale"], eps=options["eps"])
    return y, next_state
