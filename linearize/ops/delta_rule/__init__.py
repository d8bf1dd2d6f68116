"""A gated delta-rule retrieval memory, in three forms.

    S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T,    o_t = scale * S_t^T q_t

q and k are L2-normalised inside the op; a_t = exp(log_a) in (0, 1], b_t in (0, 1) (`naive.py` has
the contract: shapes, GQA, padding, the state {"S": [B, H_s, d_k, d_v]}). Unlike an additive linear
state, a write replaces what the state held for k_t by v_t (a fraction b_t of the way), so one key
is not diluted among thousands: the memory that keeps a needle past the softmax window.

The forms (the options in one `DeltaRuleOptions`):
  chunk_delta_rule     a multi-token pass from an empty state, differentiable (training, a first prefill)
  continue_delta_rule  a multi-token pass continuing a carried state
  delta_rule_step      one token after a state (decoding)

Each lists its implementations in order of preference (`linearize.ops.backend`):
  fla      fla's `chunk_gated_delta_rule` / `fused_recurrent_gated_delta_rule` (Triton; CUDA tensors,
           fla installed: the `gpu` extra), with q, k normalised and padding made neutral before the call;
           gradients only where fla's backward runs (`fla_backward_refused`)
  torch    `chunk.delta_rule_chunked` for passes, `naive.delta_rule_step_naive` for a token
each tested against `naive.delta_rule_recurrent` in values and gradients (tests/ops/test_delta_rule.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import backend
from ..backend import Form, Implementation
from ..common import accumulation_dtype, repeat_kv
from .chunk import delta_rule_chunked
from .naive import delta_rule_step_naive, init_state, l2_normalize
from .options import DeltaRuleOptions

__all__ = ["FORMS", "DeltaRuleOptions", "chunk_delta_rule", "continue_delta_rule", "delta_rule_step", "fla_backward_refused",
           "fla_importable", "init_state"]


def chunk_delta_rule(q, k, v, log_a, b, options: DeltaRuleOptions, *, valid=None, output_final_state=False):
    """The memory over L tokens from an empty state: (o [B, H, L, d_v], the state after them or None).

    q [B, H, L, d_k]; k [B, H_kv, L, d_k], v [B, H_kv, L, d_v]; log_a, b [B, H_s, L] (H_s = H or
    H_kv states); valid [B, L] (False for padding; None: every token valid). Differentiable in all tensors.
    """
    return CHUNK(_Call(q, k, v, log_a, b, options, valid=valid, output_final_state=output_final_state))


def continue_delta_rule(q, k, v, log_a, b, state, options: DeltaRuleOptions, *, valid=None):
    """The memory over L tokens continuing `state` (None: an empty one): (o, the state after them)."""
    return CONTINUE(_Call(q, k, v, log_a, b, options, state=state, valid=valid, output_final_state=True))


def delta_rule_step(q, k, v, log_a, b, state, options: DeltaRuleOptions, *, valid=None):
    """One token (L = 1) after `state`: (o [B, H, 1, d_v], the new state)."""
    return STEP(_Call(q, k, v, log_a, b, options, state=state, valid=valid, output_final_state=True))


@dataclass(frozen=True, eq=False)
class _Call:
    """One call of a form, as its implementations read it."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    log_a: torch.Tensor
    b: torch.Tensor
    options: DeltaRuleOptions
    state: dict | None = None
    valid: torch.Tensor | None = None
    output_final_state: bool = False

    def carried(self) -> dict:
        if self.state is not None:
            return self.state
        B, Hs, dk, dv = self.q.shape[0], self.log_a.shape[1], self.k.shape[-1], self.v.shape[-1]
        dtype = accumulation_dtype(self.q.dtype)
        return init_state(B, Hs, dk, dv, device=self.q.device, dtype=dtype)


# ----------------------------------------------------------------------------------------------------
# fla's kernels


_fla_importable: bool | None = None


def fla_importable() -> bool:
    global _fla_importable
    if _fla_importable is None:
        try:
            import fla.ops.gated_delta_rule  # noqa: F401

            _fla_importable = True
        except ImportError:
            _fla_importable = False
    return _fla_importable


def fla_backward_refused() -> str | None:
    """Why fla's chunked backward cannot run here, or None: fla 0.6.0 refuses its gated backward with
    Triton >= 3.4, < 3.7.1 on Hopper GPUs (wrong results, its issue #640), read from fla's own flags."""
    from fla.ops.common import chunk_o

    flags = (getattr(chunk_o, name, default) for name, default in
             (("IS_NVIDIA_HOPPER", False), ("TRITON_ABOVE_3_4_0", False), ("TRITON_ABOVE_3_7_1", True)))
    hopper, above_3_4, above_3_7_1 = flags
    if hopper and above_3_4 and not above_3_7_1:
        return "gradients wanted: fla's gated backward refuses Triton < 3.7.1 on Hopper"
    return None


def _wants_gradients(call: _Call) -> bool:
    tensors = (call.q, call.k, call.v, call.log_a, call.b) + (() if call.state is None else (call.state["S"],))
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _fla_chunk_supports(call: _Call) -> str | None:
    reason = _fla_supports(call)
    if reason is None and _wants_gradients(call):
        return fla_backward_refused()
    return reason


def _fla_supports(call: _Call) -> str | None:
    if not call.q.is_cuda:
        return "fla's kernels take CUDA tensors"
    if call.q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"fla's kernels take bf16, fp16 or fp32, not {call.q.dtype}"
    if max(call.k.shape[-1], call.v.shape[-1]) > 256:
        return "fla's kernels take head dims up to 256"
    if not fla_importable():
        return "fla is not installed (the `gpu` extra)"
    return None


def _fla_operands(call: _Call):
    """Inputs as fla takes them: [B, T, H, d], every head's own keys, values and gates (fla shares
    keys across value heads, the opposite of GQA), q and k normalised, padding neutral (a = 1, b = 0)."""
    H, Hs, eps = call.q.shape[1], call.log_a.shape[1], call.options.eps
    per_state, per_query = Hs // call.k.shape[1], H // Hs
    log_a, b = call.log_a.float(), call.b
    if call.valid is not None:
        keep = call.valid[:, None, :]
        log_a, b = log_a * keep, b * keep
    q = l2_normalize(call.q.float(), eps).to(call.q.dtype)
    k = repeat_kv(l2_normalize(call.k.float(), eps).to(call.q.dtype), per_state * per_query)
    v = repeat_kv(call.v.to(call.q.dtype), per_state * per_query)
    log_a, b = repeat_kv(log_a, per_query), repeat_kv(b.to(call.q.dtype), per_query)
    state = call.carried()["S"].float()
    return ([t.transpose(1, 2).contiguous() for t in (q, k, v, log_a, b)],
            repeat_kv(state, per_query).contiguous(), per_query)


def _fla_result(call: _Call, o, final, per_query):
    o = o.transpose(1, 2)
    if call.valid is not None:
        o = o * call.valid[:, None, :, None].to(o.dtype)
    new_state = {"S": final[:, ::per_query]} if call.output_final_state else None
    return o, new_state


def _fla_chunk(call: _Call):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    (q, k, v, g, beta), state, per_query = _fla_operands(call)
    o, final = chunk_gated_delta_rule(q=q, k=k, v=v, g=g, beta=beta, scale=call.options.scale, initial_state=state,
                                      output_final_state=call.output_final_state)
    return _fla_result(call, o, final, per_query)


def _fla_recurrent(call: _Call):
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    (q, k, v, g, beta), state, per_query = _fla_operands(call)
    o, final = fused_recurrent_gated_delta_rule(q=q, k=k, v=v, g=g, beta=beta, scale=call.options.scale,
                                                initial_state=state, output_final_state=True)
    return _fla_result(call, o, final, per_query)


def _fla_step_supports(call: _Call) -> str | None:
    if call.q.shape[2] != 1:
        return "more than one token: the chunked kernel"
    if _wants_gradients(call):
        return "gradients wanted: the decode step runs without"
    return _fla_supports(call)


# ----------------------------------------------------------------------------------------------------
# The PyTorch forms


def _chunked(call: _Call):
    o, new_state = delta_rule_chunked(call.q, call.k, call.v, call.log_a, call.b, call.valid, call.carried(),
                                      call.options)
    return o, new_state if call.output_final_state else None


def _step(call: _Call):
    if call.q.shape[2] != 1:
        return _chunked(call)
    return delta_rule_step_naive(call.q, call.k, call.v, call.log_a, call.b, call.valid, call.carried(), call.options)


CHUNK = Form("chunk_delta_rule", (
    Implementation("fla", _fla_chunk_supports, _fla_chunk),
    Implementation("torch", backend.always, _chunked, kernels=False)))
CONTINUE = Form("continue_delta_rule", (
    Implementation("fla", _fla_chunk_supports, _fla_chunk),
    Implementation("torch", backend.always, _chunked, kernels=False)))
STEP = Form("delta_rule_step", (
    Implementation("fla", _fla_step_supports, _fla_recurrent),
    Implementation("torch", backend.always, _step, kernels=False)))
FORMS = {form.name: form for form in (CHUNK, CONTINUE, STEP)}
