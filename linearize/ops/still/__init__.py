"""STILL: Self-Saliency routing into a fixed softmax budget plus an NP-Map gated linear state, in three forms.

The forms (what the attention module calls; the method's options in one `StillOptions`):
  chunk_still     L tokens from an empty state (`init_state`'s), differentiable (training, a first prefill)
  continue_still  L tokens continuing a carried state (inference)
  still_step      one token after a state (decoding; `linearize.decode` may swap in a compiled one)

Each multi-token form lists its implementations in order of preference
(`linearize.ops.backend.Implementation`): where the backend allows the kernels and they take the
inputs, a fresh call without gradients through the chunked form's kernel (blocks of queries carrying
the linear state, linear in L), any other call without gradients through the kernels in blocks of
KERNEL_BLOCK tokens (the first block fresh when the call is, each next one continuing from the state
the previous left, so a prefill's cost grows linearly with its length), or a fresh pass in one
differentiable call when gradients are wanted; else, in
PyTorch, a fresh call in the chunked form (blocks of queries carrying the linear state, differentiable)
and any other call (a continued one) in the naive form in blocks of MAX_PARALLEL tokens.
  routing.py  the routing every form shares (which keys take the softmax slots, and when each folds
              into the linear state); `fresh_routing` and `continued_routing` (the fold times of a
              fresh or a continued call, and the state after it) for the kernels
  naive.py    `still_parallel` (the reference), `still_step` (one decode step)
  chunked.py  the attention of a fresh pass given the fold times, in blocks of C queries: the window,
              the salient slot holders and the linear state carried between blocks, so its work
              grows linearly with L (PyTorch, differentiable; a kernel's blueprint)
  chunk_triton.py  that attention's forward in one fused kernel a block (fresh calls, no gradients)
  triton.py   the attention over a sequence given each key's fold time, in fused kernels: a fresh
              pass (differentiable), or the forward's parts for a continued call (inference only)
each tested against `naive.still_parallel` in values (and gradients where they have any).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .. import backend
from ..backend import Form, Implementation
from ..common import repeat_kv
from .naive import init_state, still_parallel, still_step
from .options import StillOptions
from .routing import continued_routing, fresh_routing

MAX_PARALLEL = 2048  # tokens per call of the parallel form: it holds [L, K + W + L] scores per head
# Tokens per kernel call for calls without gradients: a call's cost grows with the square of its keys
# (slots, window and new tokens), so long inputs go in blocks, each carrying the state on.
KERNEL_BLOCK = 8192

__all__ = ["CHUNK_KERNEL_ON_GPU", "FORMS", "KERNEL_BLOCK", "MAX_PARALLEL", "StillOptions", "chunk_still", "continue_still", "init_state",
           "still_step", "unsupported_reason"]


def unsupported_reason(q, k, features: int, dtype: torch.dtype | None = None) -> str | None:
    """None when the kernels (fresh and continued calls, their operands in `dtype`, default q's) take
    these inputs, else why not."""
    if not backend.use_kernels():
        return "the backend is torch" if backend.get_backend() == "torch" else "triton or a CUDA device missing"
    from .triton import supports

    return supports(q, k, features, dtype)


def chunk_still(q, k, v, valid, gate, state, phi_q, phi_k, options: StillOptions, *, dtype=None,
                output_final_state=False):
    """(y, the state after the call or None) over the first L tokens of a sequence; `state` is
    `init_state`'s. q [B,H,L,d] and k [B,H_kv,L,d] carry RoPE; gate [B,H,L,d] or None; phi_q, phi_k the
    feature maps; `dtype` the kernels' operand dtype (the projections'; default q's);
    `output_final_state` whether the state after the call is wanted. Differentiable."""
    return CHUNK(_Call(q, k, v, valid, gate, state, phi_q, phi_k, options, start=0, fresh=True,
                       caching=output_final_state, dtype=dtype))


def continue_still(q, k, v, valid, gate, state, phi_q, phi_k, options: StillOptions, *, start, caching=True,
                   dtype=None):
    """(y, the state after the call or None) over L tokens continuing `state`, the first at absolute
    position `start`; `caching` whether the state after the call is wanted. Arguments as `chunk_still`'s."""
    return CONTINUE(_Call(q, k, v, valid, gate, state, phi_q, phi_k, options, start=start, fresh=False,
                          caching=caching, dtype=dtype))


@dataclass(frozen=True, eq=False)
class _Call:
    """One call of a multi-token form, as its implementations read it."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    valid: torch.Tensor
    gate: torch.Tensor | None
    state: dict
    phi_q: object
    phi_k: object
    options: StillOptions
    start: int
    fresh: bool
    caching: bool
    dtype: torch.dtype | None

    @property
    def operand_dtype(self) -> torch.dtype:
        return self.dtype or self.q.dtype

    def tensors(self) -> tuple:
        return self.q, self.k, self.v, self.valid, self.gate, self.state


def _kernels_supported(call: _Call) -> str | None:
    from .triton import supports

    return supports(call.q, call.k, call.phi_q.out_dim, call.operand_dtype)


def _kernels_without_gradients(call: _Call) -> str | None:
    if _wants_gradients(call.q, call.k, call.v, call.gate, call.phi_q, call.phi_k):
        return "gradients wanted: only the fresh pass's kernels have a backward"
    return _kernels_supported(call)


# The chunked kernel is checked in the Triton interpreter only: on a GPU it waits for its compiled check
# (`pytest -m gpu tests/kernels/test_still_chunk_triton.py`, which sets this) before it takes prefills.
CHUNK_KERNEL_ON_GPU = "LINEARIZE_STILL_CHUNK_KERNEL"


def _chunk_kernel_supported(call: _Call) -> str | None:
    reason = _fresh_only(call) or _kernels_without_gradients(call)
    if reason is None and call.q.is_cuda and os.environ.get(CHUNK_KERNEL_ON_GPU) != "1":
        return f"not yet checked compiled on a GPU (set {CHUNK_KERNEL_ON_GPU}=1 to use it)"
    return reason


def _chunk_kernel_pass(call: _Call):
    """A fresh pass without gradients: the routing in PyTorch (`fresh_routing`, which gives the state
    after it when caching), the attention in the chunked form's kernel (`chunk_triton`), operands in
    the call's dtype. No blocks of KERNEL_BLOCK tokens: its work and memory grow linearly with L."""
    from .chunk_triton import still_chunk_triton

    q, k, options = call.q, call.k, call.options
    with torch.no_grad():
        fq = call.phi_q(q)
        fk = call.phi_k(repeat_kv(k, q.shape[1] // k.shape[1]))
        fold, next_state = fresh_routing(q, k, call.v, call.valid, call.state, options, start=call.start,
                                         fk=fk if call.caching else None)
        dtype = call.operand_dtype
        y = still_chunk_triton(q.to(dtype), k.to(dtype), call.v.to(dtype), fq, fk, call.gate, fold, call.valid,
                               options, slots=call.state["sal_used"].shape[-1])
    return y, next_state


def _kernel_blocks(call: _Call):
    """The kernels in blocks of KERNEL_BLOCK tokens (no gradients)."""
    def through_kernels(*block, start, fresh, keep):
        run = _fresh_pass_through_kernels if fresh else _continued_through_kernels
        return run(*block, call.phi_q, call.phi_k, call.options, start=start, caching=keep, dtype=call.operand_dtype)

    return _in_blocks(KERNEL_BLOCK, through_kernels, *call.tensors(), start=call.start, fresh=call.fresh,
                      caching=call.caching)


def _fresh_pass(call: _Call):
    """Training: one differentiable pass (the continued calls' kernels have no backward)."""
    return _fresh_pass_through_kernels(*call.tensors(), call.phi_q, call.phi_k, call.options, start=call.start,
                                       caching=call.caching, dtype=call.operand_dtype)


def _fresh_only(call: _Call) -> str | None:
    return None if call.fresh else "a continued call: the chunked form starts from an empty state"


def _chunked_pass(call: _Call):
    """A fresh pass in blocks of `chunked.CHUNK` queries (`chunked.still_chunked`), differentiable:
    the routing in PyTorch (`fresh_routing`, which gives the state after it when caching), then the
    attention with the linear state carried from block to block."""
    from .chunked import still_chunked

    q, k, options = call.q, call.k, call.options
    fq = call.phi_q(q)
    fk = call.phi_k(repeat_kv(k, q.shape[1] // k.shape[1]))
    with torch.no_grad():
        fold, next_state = fresh_routing(q, k, call.v, call.valid, call.state, options, start=call.start,
                                         fk=fk.detach() if call.caching else None)
    y = still_chunked(q, k, call.v, fq, fk, call.gate, fold, call.valid, options,
                      slots=call.state["sal_used"].shape[-1])
    return y, next_state


def _parallel_blocks(call: _Call):
    """The naive form; long inputs in blocks too (the same results, bounded memory)."""
    def parallel(*block, start, fresh, keep):
        return still_parallel(*block, call.phi_q, call.phi_k, call.options, start=start, fresh=fresh,
                              keep_state=keep)

    return _in_blocks(MAX_PARALLEL, parallel, *call.tensors(), start=call.start, fresh=call.fresh,
                      caching=call.caching)


CHUNK = Form("chunk_still", (
    Implementation("triton-chunked", _chunk_kernel_supported, _chunk_kernel_pass),
    Implementation("triton", _kernels_without_gradients, _kernel_blocks),
    Implementation("triton-differentiable", _kernels_supported, _fresh_pass),
    Implementation("torch-chunked", _fresh_only, _chunked_pass, kernels=False),
    Implementation("torch", backend.always, _parallel_blocks, kernels=False)))
CONTINUE = Form("continue_still", (
    Implementation("triton", _kernels_without_gradients, _kernel_blocks),
    Implementation("torch", backend.always, _parallel_blocks, kernels=False)))
FORMS = {form.name: form for form in (CHUNK, CONTINUE)}


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


def _continued_through_kernels(q, k, v, valid, gate, state, phi_q, phi_k, options, *, start, caching, dtype):
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
        keys, values, key_valid, fold, fk, next_state = continued_routing(q, k, v, valid, state, phi_k, options,
                                                                          start=start, keep_state=caching)
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
            fold.reshape(rows, 1, -1), key_valid.reshape(rows, -1), scale=options.scale, eps=options.eps)
        y_soft, y_lin = (t.view(B, H, -1, t.shape[-1])[:, :, P:] for t in (y_soft, y_lin))
        den = den.view(B, H, -1)[:, :, P:, None]
        fq = fq.float()
        lin = den * y_lin + fq @ state["S"].float()
        if gate is not None:
            lin = gate.float() * lin
        y = (den * y_soft + lin) / (den + (fq * state["z"].float()[:, :, None, :]).sum(-1, keepdim=True))
    return y.to(dtype), next_state


def _fresh_pass_through_kernels(q, k, v, valid, gate, state, phi_q, phi_k, options, *, start, caching, dtype):
    """The routing in PyTorch (`fresh_routing`), the attention in one fused pass over the whole input,
    its GEMMs in `dtype`; and the state after it when caching (a prompt's prefill: no [L, L] scores,
    so no blocks of MAX_PARALLEL tokens either)."""
    from .triton import still_attention_triton

    fq = phi_q(q)
    fk = phi_k(repeat_kv(k, q.shape[1] // k.shape[1]))
    with torch.no_grad():
        fold, next_state = fresh_routing(q, k, v, valid, state, options, start=start,
                                         fk=fk.detach() if caching else None)
    y = still_attention_triton(q.to(dtype), k.to(dtype), v.to(dtype), fq, fk, gate, fold, valid,
                               scale=options.scale, eps=options.eps)
    return y, next_state
