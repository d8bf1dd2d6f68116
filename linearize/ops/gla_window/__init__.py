"""Gated linear attention plus a sliding softmax window (Lizard, Liger), in three forms.

    y_i = beta * phi_q_i^T S_i / (phi_q_i^T z_i + eps) + alpha_h * softmax window over (i - w, i] with sinks

The forms (what the attention modules call; the method's options in one `GlaWindowOptions`):
  chunk_gla_window     a multi-token pass from an empty state, differentiable (training, a first prefill)
  continue_gla_window  a multi-token pass continuing a carried state, or filling a cache (inference)
  gla_window_step      one token after a state (decoding)

Each form lists its implementations in order of preference (`linearize.ops.backend.Implementation`);
the backend runs the first it allows that takes the call, the PyTorch one where no kernel does:
  naive.py        `gla_window_parallel` / `gla_window_recurrent_step`: the obviously-correct reference, O(L^2)
  chunk.py        `gla_window_chunked`: the same in chunks, O(L * chunk) memory
  triton.py       the fused Triton forward and backward over a fresh pass (docs/kernels.md)
  continued.py    the fused kernel continuing a carried state (prefill after prefill)
  step_triton.py  one decode step in two kernels
each tested against `naive` in values and gradients.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property

import torch

from .. import backend
from ..backend import Form, Implementation
from .chunk import gla_window_chunked
from .naive import gla_window_recurrent_step, init_state, state_after
from .options import GlaWindowOptions

__all__ = ["FORMS", "GlaWindowOptions", "chunk_gla_window", "continue_gla_window", "gla_window_step", "init_state",
           "unsupported_reason"]


def unsupported_reason(fq, fk, log_g, qw, kw, v, *, window, sinks, dtype=None) -> str | None:
    """None when the fused kernels take these inputs (cast to `dtype` where given), else why not."""
    if not backend.use_kernels():
        return "the backend is torch" if backend.get_backend() == "torch" else "triton or a CUDA device missing"
    from .triton import supports

    return supports(fq, fk, log_g, qw, kw, v, window=window, sinks=sinks, dtype=dtype)


def chunk_gla_window(fq, fk, log_g, qw, kw, v, options: GlaWindowOptions, *, valid=None, dtype=None,
                     output_final_state=False):
    """The op over L tokens from an empty state: (y [B, H, L, d], the state after them or None).

    fq, fk [B,H,L,F]; log_g [B,H,L,1] or [B,H,L,F]; qw [B,H,L,d]; kw, v [B,H_kv,L,d]. `valid` [B, L]
    (False for padding; None: every token valid, known without reading it back from the device);
    `dtype` the kernels' operand dtype (the projections': bf16 under autocast; default qw's);
    `output_final_state` whether the state after the pass is wanted. Differentiable in all tensors.
    The kernels take passes whose rows are each one run of tokens (left or right padding); the
    PyTorch form computes in float32.
    """
    return CHUNK(_Pass(fq, fk, log_g, qw, kw, v, options, valid=valid, dtype=dtype,
                       output_final_state=output_final_state))


def continue_gla_window(fq, fk, log_g, qw, kw, v, options: GlaWindowOptions, *, state=None, valid=None, dtype=None):
    """The op over L tokens continuing `state` (None: an empty one, for a first prefill that fills a
    cache): (y, the state after them). For inference: the kernel continues only unpadded passes
    without gradients, normalised (Lizard's; Liger's go through the PyTorch form). Arguments as
    `chunk_gla_window`'s."""
    return CONTINUE(_Pass(fq, fk, log_g, qw, kw, v, options, state=state, valid=valid, dtype=dtype,
                          output_final_state=True))


def gla_window_step(fq, fk, log_g, qw, kw, v, state, options: GlaWindowOptions, *, valid=None, dtype=None,
                    in_place=False):
    """One token after `state`: (y [B, H, 1, d], the new state). Through the step kernels without
    gradients (y in `dtype`, default qw's; `in_place`: the new state written into `state`'s tensors),
    else the PyTorch recurrence in float32."""
    return STEP(_Pass(fq, fk, log_g, qw, kw, v, options, state=state, valid=valid, dtype=dtype, in_place=in_place))


@dataclass(frozen=True, eq=False)
class _Pass:
    """One call of a form, as its implementations read it."""

    fq: torch.Tensor
    fk: torch.Tensor
    log_g: torch.Tensor
    qw: torch.Tensor
    kw: torch.Tensor
    v: torch.Tensor
    options: GlaWindowOptions
    state: dict | None = None
    valid: torch.Tensor | None = None
    dtype: torch.dtype | None = None
    output_final_state: bool = False
    in_place: bool = False

    @property
    def operand_dtype(self) -> torch.dtype:
        return self.dtype or self.qw.dtype

    @property
    def length(self) -> int:
        return self.fq.shape[2]

    def valid_mask(self) -> torch.Tensor:
        if self.valid is not None:
            return self.valid
        return torch.ones(self.fq.shape[0], self.length, dtype=torch.bool, device=self.fq.device)

    @cached_property
    def layout(self) -> tuple[bool, bool, torch.Tensor | None]:
        """`row_layout` of the validity, read back from the device once a call (never without padding)."""
        return (True, True, None) if self.valid is None else row_layout(self.valid)

    def scaled_fq(self) -> torch.Tensor:
        """fq with beta folded in (the kernels take beta = 1; only where the linear part is unnormalised)."""
        beta = self.options.beta
        return self.fq if beta == 1.0 else self.fq * beta

    def kernel_options(self) -> GlaWindowOptions:
        """The options as the multi-token kernels take them: float32 sinks and alpha, beta folded into fq."""
        return self.options.head_scalars_in(torch.float32).replace(beta=1.0)

    def kernel_operands(self) -> tuple[torch.Tensor, ...]:
        dtype = self.operand_dtype
        return (self.scaled_fq().to(dtype), self.fk.to(dtype), self.log_g, self.qw.to(dtype), self.kw.to(dtype),
                self.v.to(dtype))

    def float32(self) -> tuple[tuple[torch.Tensor, ...], GlaWindowOptions]:
        """Operands and options in float32, as the PyTorch forms take them."""
        return tuple(t.float() for t in (self.fq, self.fk, self.log_g, self.qw, self.kw, self.v)), \
            self.options.head_scalars_in(torch.float32)

    def empty_state(self) -> dict:
        (B, H, _, F), HKV, D = self.fq.shape, self.kw.shape[1], self.qw.shape[-1]
        return init_state(B, H, HKV, F, D, self.options.window, device=self.fq.device)


# ----------------------------------------------------------------------------------------------------
# What each implementation takes


def _multi_token_kernels(call: _Pass) -> str | None:
    """Why the multi-token kernels cannot take the call, checked for the operands as they will be cast
    (the PyTorch feature maps give float32 beside bf16 values) before any cast: a pass the kernels do
    not take copies nothing."""
    if call.length == 1:
        return "one token: the PyTorch form"
    if call.options.beta != 1.0 and call.options.normalize:
        return "beta scales an unnormalised linear part only (folded into the queries)"
    from .triton import supports

    return supports(call.fq, call.fk, call.log_g, call.qw, call.kw, call.v, window=call.options.window,
                    sinks=call.options.sinks, dtype=call.operand_dtype)


def _fresh_kernel_supports(call: _Pass) -> str | None:
    if call.state is not None:
        return "a carried state: the fresh kernel starts from an empty one"
    reason = _multi_token_kernels(call)
    if reason is None and not call.layout[0]:
        return "a row whose valid tokens are not one run"
    return reason


def _continued_kernel_supports(call: _Pass) -> str | None:
    if torch.is_grad_enabled():
        return "gradients wanted: the continued kernel has no backward"
    if not call.options.normalize:
        return "the continued kernel has no unnormalised form"
    reason = _multi_token_kernels(call)
    if reason is None and not call.layout[1]:
        return "padding: the continued kernel takes every token valid"
    return reason


def _step_kernel_supports(call: _Pass) -> str | None:
    if torch.is_grad_enabled():
        return "gradients wanted: the step kernels have no backward"
    if call.options.beta != 1.0 and call.options.normalize:
        return "beta scales an unnormalised linear part only (folded into the queries)"
    if call.state is None:
        return "no carried state"
    from .step_triton import step_unsupported
    from .triton import supports

    # The step kernels convert qw, kw and v as they load them: checked as the float32 they become.
    return (supports(call.fq, call.fk, call.log_g, call.qw, call.kw, call.v, window=call.options.window,
                     sinks=call.options.sinks, dtype=torch.float32)
            or step_unsupported(call.fq, call.log_g, call.state, window=call.options.window))


# ----------------------------------------------------------------------------------------------------
# The implementations


def _fresh_kernel(call: _Pass):
    """The fused kernels over a fresh pass, and the state after it where wanted. Leading padding is
    rotated to the end of its row: every real token then sees only real tokens before it (padding
    after them never reaches them), and the outputs are rotated back."""
    from .triton import lizard_attention_triton

    operands, options = call.kernel_operands(), call.kernel_options()
    lead = call.layout[2]
    if lead is None:
        y = lizard_attention_triton(*operands, options)
    else:
        L = call.length
        shift = torch.remainder(torch.arange(L, device=lead.device) + lead[:, None], L)
        y = lizard_attention_triton(*(rotate_rows(t, shift) for t in operands), options)
        y = rotate_rows(y, torch.argsort(shift, dim=1))
    new_state = None
    if call.output_final_state:
        new_state = state_after(call.fk.float(), call.log_g, call.kw.float(), call.v.float(), call.options.window,
                                call.valid)
    return y, new_state


def _continued_kernel(call: _Pass):
    """The fused kernel continuing the carried state (an empty one for a first prefill: the kernel then
    returns the new state too, instead of `state_after` computing it again over the call)."""
    from .continued import lizard_attention_continued

    state = call.state if call.state is not None else call.empty_state()
    return lizard_attention_continued(*call.kernel_operands(), state, call.kernel_options())


def _step_kernel(call: _Pass):
    from .step_triton import lizard_decode_step

    fq, (fk, log_g, qw, kw, v) = call.scaled_fq(), (call.fk, call.log_g, call.qw, call.kw, call.v)
    with torch.no_grad():
        return lizard_decode_step(fq, fk, log_g, qw, kw, v, call.valid_mask(), call.state,
                                  call.options.replace(beta=1.0), in_place=call.in_place,
                                  out_dtype=call.operand_dtype)


def _chunked(call: _Pass):
    """The chunked PyTorch form in float32, from the carried state or an empty one."""
    operands, options = call.float32()
    state = call.state if call.state is not None else call.empty_state()
    y, new_state = gla_window_chunked(*operands, call.valid_mask(), state, options)
    return y, new_state if call.output_final_state else None


def _recurrent(call: _Pass):
    """The PyTorch recurrence for one token in float32 (the chunked form from an empty state)."""
    if call.state is None or call.length != 1:
        return _chunked(dataclasses.replace(call, output_final_state=True))
    operands, options = call.float32()
    return gla_window_recurrent_step(*operands, call.valid_mask(), call.state, options)


CHUNK = Form("chunk_gla_window", (
    Implementation("triton", _fresh_kernel_supports, _fresh_kernel),
    Implementation("torch", backend.always, _chunked, kernels=False)))
CONTINUE = Form("continue_gla_window", (
    Implementation("triton-continued", _continued_kernel_supports, _continued_kernel),
    Implementation("triton-fresh", _fresh_kernel_supports, _fresh_kernel),
    Implementation("torch", backend.always, _chunked, kernels=False)))
STEP = Form("gla_window_step", (
    Implementation("triton", _step_kernel_supports, _step_kernel),
    Implementation("torch", backend.always, _recurrent, kernels=False)))
FORMS = {form.name: form for form in (CHUNK, CONTINUE, STEP)}


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
