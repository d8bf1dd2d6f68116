"""STILL: Self-Saliency routing into a fixed softmax budget plus an NP-Map gated linear state: the one
dispatch point.

Forms, each tested against `naive.still_parallel` in values and gradients:
  naive.py    `still_parallel` (the reference, and the routing every form shares), `still_step` (one
              decode step), `fresh_routing` (the fold times of a fresh pass)
  triton.py   the attention of a fresh pass in fused kernels, given `fresh_routing`'s fold times

`still` is what the attention module calls: the step for one token after a state, the kernels for a
fresh pass where the backend (`linearize.ops.backend`) allows them and they take the inputs, and the
naive form in blocks of MAX_PARALLEL tokens otherwise.
"""

from __future__ import annotations

import torch

from .. import backend
from ..common import repeat_kv
from .naive import fresh_routing, init_state, still_parallel, still_step

MAX_PARALLEL = 2048  # tokens per call of the parallel form: it holds [L, K + W + L] scores per head

__all__ = ["MAX_PARALLEL", "init_state", "still", "still_step", "unsupported_reason"]


def unsupported_reason(q, k, features: int) -> str | None:
    """None when the fresh-pass kernels take these inputs, else why not."""
    if not backend.use_kernels():
        return "the backend is torch" if backend.get_backend() == "torch" else "triton or a CUDA device missing"
    from .triton import supports

    return supports(q, k, features)


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
    if fresh and unsupported_reason(q, k, phi_q.out_dim) is None:
        return _fresh_pass_through_kernels(q, k, v, valid, gate, state, phi_q, phi_k, start=start, caching=caching,
                                           dtype=dtype or q.dtype, **options)
    # Long inputs go through the parallel form in blocks, each continuing from the state the previous
    # one left (the same results, bounded memory).
    outputs = []
    for lo in range(0, L, MAX_PARALLEL):
        part = slice(lo, lo + MAX_PARALLEL)
        y, state = still_parallel(q[:, :, part], k[:, :, part], v[:, :, part], valid[:, part],
                                  None if gate is None else gate[:, :, part], state, phi_q, phi_k, **options,
                                  start=start + lo, fresh=fresh and lo == 0,
                                  keep_state=caching or lo + MAX_PARALLEL < L)
        outputs.append(y)
    return torch.cat(outputs, 2), state


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
