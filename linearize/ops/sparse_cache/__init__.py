"""Gated linear attention, a sliding softmax window and a sparse cache of the tokens the linear state
recalls worst (LoLA's sparse caching, McDermott et al. 2025), in three forms.

    y_t = combine(phi_q^T S_t, softmax over window (t - w, t] + cached keys + sinks)

Tokens leave the window in order; each is scored by the linear state's recall error for it as it
leaves, and the cache holds, per KV head, the `slots` highest of the tokens that have left, ranked by
(score, position), the newer winning ties (`naive.py` has the exact rule, the combining and the
shapes, as `linearize.ops.gla_window`'s).

The forms (the options in one `SparseCacheOptions`):
  chunk_sparse_cache     a multi-token pass from an empty state, differentiable (training, a first prefill)
  continue_sparse_cache  a multi-token pass continuing a carried state (a prompt prefilled in pieces)
  sparse_cache_step      one token after a state (decoding), on a state of constant size

Each lists its implementations (`linearize.ops.backend`); PyTorch only so far:
  naive.py      `sparse_cache_naive`: the reference over the whole history, token by token
  parallel.py   `sparse_cache_parallel`, the two pass forms: every token's score from one chunked
                linear pass, each key's eviction from a ranking (`linearize.ops.ranking`), then the
                window and cache attention over each key's visible interval in blocks of queries,
                O(L * (window + slots + chunk)); it leaves the decode state
  recurrent.py  `sparse_cache_step_recurrent` on the constant state (the step form), and
                `sparse_cache_loop`, passes as a loop of those steps, O(L * (window + slots)) one
                token at a time (the decode state's check)
tested against `naive` in values and gradients, and the state against the loop's
(tests/ops/test_sparse_cache.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import backend
from ..backend import Form, Implementation
from ..common import accumulation_dtype
from .naive import sparse_cache_naive
from .options import SparseCacheOptions
from .parallel import sparse_cache_parallel
from .recurrent import init_state, sparse_cache_loop

__all__ = ["FORMS", "SparseCacheOptions", "chunk_sparse_cache", "continue_sparse_cache", "init_state",
           "sparse_cache_naive", "sparse_cache_step"]


def chunk_sparse_cache(fq, fk, log_g, qw, kw, v, options: SparseCacheOptions, *, valid=None,
                       output_final_state=False):
    """The op over L tokens from an empty state: (y [B, H, L, d] in qw's dtype, the state after them or
    None). fq, fk [B, H, L, F]; log_g [B, H, L, 1 or F]; qw [B, H, L, d]; kw, v [B, H_kv, L, d];
    `valid` [B, L] (False for padding; None: every token valid). Differentiable in every tensor;
    computed in float32 (float64 for float64 inputs)."""
    return CHUNK(_Call(fq, fk, log_g, qw, kw, v, options, valid=valid, output_final_state=output_final_state))


def continue_sparse_cache(fq, fk, log_g, qw, kw, v, options: SparseCacheOptions, *, state=None, valid=None):
    """The op over L tokens continuing `state` (None: an empty one): (y, the state after them), the
    parallel form from the carried state. Computed in the state's dtype."""
    return CONTINUE(_Call(fq, fk, log_g, qw, kw, v, options, state=state, valid=valid, output_final_state=True))


def sparse_cache_step(fq, fk, log_g, qw, kw, v, state, options: SparseCacheOptions, *, valid=None):
    """One token (L = 1) after `state`: (y [B, H, 1, d], the new state of the same shapes)."""
    return STEP(_Call(fq, fk, log_g, qw, kw, v, options, state=state, valid=valid, output_final_state=True))


@dataclass(frozen=True, eq=False)
class _Call:
    """One call of a form, as its implementations read it."""

    fq: torch.Tensor
    fk: torch.Tensor
    log_g: torch.Tensor
    qw: torch.Tensor
    kw: torch.Tensor
    v: torch.Tensor
    options: SparseCacheOptions
    state: dict | None = None
    valid: torch.Tensor | None = None
    output_final_state: bool = False

    def carried(self) -> dict:
        if self.state is not None:
            return self.state
        (B, H, _, F), H_kv, d = self.fq.shape, self.kw.shape[1], self.v.shape[-1]
        dtype = accumulation_dtype(self.qw.dtype)
        return init_state(B, H, H_kv, F, d, self.options, device=self.fq.device, dtype=dtype)

    def valid_mask(self) -> torch.Tensor:
        if self.valid is not None:
            return self.valid
        return torch.ones(self.fq.shape[0], self.fq.shape[2], dtype=torch.bool, device=self.fq.device)


def _operands(call: _Call):
    """The call's state, tensors and options in the state's dtype (float32, float64 for float64 inputs)."""
    state = call.carried()
    work = state["S"].dtype
    operands = [t.to(work) for t in (call.fq, call.fk, call.log_g, call.qw, call.kw, call.v)]
    options = call.options.replace(branches=call.options.branches.head_scalars_in(work))
    return state, operands, options


def _parallel(call: _Call):
    state, operands, options = _operands(call)
    y, new_state = sparse_cache_parallel(*operands, call.valid_mask(), state, options)
    return y.to(call.qw.dtype), new_state if call.output_final_state else None


def _loop(call: _Call):
    state, operands, options = _operands(call)
    y, new_state = sparse_cache_loop(*operands, call.valid_mask(), state, options)
    return y.to(call.qw.dtype), new_state if call.output_final_state else None


CHUNK = Form("chunk_sparse_cache", (Implementation("torch", backend.always, _parallel, kernels=False),))
CONTINUE = Form("continue_sparse_cache", (Implementation("torch", backend.always, _parallel, kernels=False),))
STEP = Form("sparse_cache_step", (Implementation("torch", backend.always, _loop, kernels=False),))
FORMS = {form.name: form for form in (CHUNK, CONTINUE, STEP)}
