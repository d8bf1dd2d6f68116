"""Check Lizard's op from the model's q and k (`kernels.lizard_attention_qk`) against the reference.

Reference: the Hedgehog maps (`feature_maps.hedgehog`) and `gla_window_parallel` in float64 on the
same (rounded) inputs, the window on q and k themselves; relative Frobenius errors of y and of the
gradients of q, k, both weights, log g, v, the sinks and alpha, as `check.compare` reports them.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from ..feature_maps import hedgehog
from ..ops import gla_window
from ..ops.common import repeat_kv
from . import lizard_attention_qk, qk_unsupported_reason
from .check import Case, _rel

NAMES = ("y", "q", "k", "w_q", "w_k", "log_g", "v", "sinks", "alpha")
FROZEN = ("q", "k", "v")  # stage 1 trains the feature maps, the gate, sinks and alpha only


def make_inputs(case: Case, device, seed=0):
    """q, k, v and the gate in the case's dtype; Hedgehog weights near the identity map the model starts
    from, plus noise (float32, as the model keeps them), sinks and alpha; and dy."""
    g = torch.Generator(device=device).manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g, device=device)
    B, H, L, half = case.B, case.H, case.L, case.F // 2
    q, k, v = rand(B, H, L, case.D), rand(B, case.HKV, L, case.D), rand(B, case.HKV, L, case.D)
    weights = [torch.eye(case.D, half, device=device) + 0.3 * rand(H, case.D, half) for _ in range(2)]
    log_g = F.logsigmoid(rand(B, H, L, 1 if case.gate == "scalar" else case.F) + case.gate_bias)
    tensors = [q.to(case.dtype), k.to(case.dtype), *weights, log_g, v.to(case.dtype), rand(H, case.sinks),
               torch.linspace(0.5, 1.5, H, device=device)]
    return tensors, rand(B, H, L, case.D).to(case.dtype)


def _output(case: Case, leaves, dtype):
    """y through the op (dtype None; the case's split/tma/chunks_first overrides applied) or the reference."""
    q, k, w_q, w_k, log_g, v, sinks, alpha = leaves
    opts = {"window": case.window, "scale": case.D**-0.5, "sinks": sinks if case.sinks else None, "alpha": alpha,
            "normalize": case.normalize, "shared": case.shared}
    if dtype is None:
        overrides = {name: getattr(case, name) for name in ("tma", "chunks_first") if getattr(case, name) is not None}
        if not overrides:
            return lizard_attention_qk(q, k, w_q, w_k, log_g, v, **opts)
        from .lizard_qk_triton import lizard_attention_qk_triton
        from .lizard_triton import Config

        config = dataclasses.replace(Config.default(q.dtype), **overrides)
        return lizard_attention_qk_triton(q, k, w_q, w_k, log_g, v, **opts, config=config)
    fq, fk = hedgehog(q, w_q), hedgehog(repeat_kv(k, case.H // case.HKV), w_k)
    state = gla_window.init_state(case.B, case.H, case.HKV, case.F, case.D, case.window, device=q.device, dtype=dtype)
    valid = torch.ones(case.B, case.L, dtype=torch.bool, device=q.device)
    return gla_window.gla_window_parallel(fq, fk, log_g, q, k, v, valid, state, beta=1.0, **opts)[0]


def _run(case: Case, tensors, dy, dtype):
    frozen = dtype is None and case.frozen
    leaves = [t.detach().clone().to(dtype or t.dtype).requires_grad_(not (frozen and name in FROZEN))
              for t, name in zip(tensors, NAMES[1:])]
    y = _output(case, leaves, dtype)
    trained = [t for t in leaves if t.requires_grad]
    grads = iter(torch.autograd.grad(y, trained, dy.to(y.dtype), allow_unused=True))  # no sinks: unused
    grads = [next(grads) if t.requires_grad else None for t in leaves]
    return [y] + [torch.zeros_like(t) if g is None else g for t, g in zip(leaves, grads)]


def compare_qk(case: Case, device="cuda", seed=0):
    """Relative errors vs float64, of the op and of the reference run in float32, per output/gradient;
    plus which path ran ("kernel" or the reason not)."""
    tensors, dy = make_inputs(case, device, seed)
    q, k, w_q, _, log_g, v, sinks, _ = tensors
    reason = qk_unsupported_reason(q, k, w_q, log_g, v, window=case.window, sinks=sinks if case.sinks else None)
    ours, exact, fp32 = (_run(case, tensors, dy, dtype) for dtype in (None, torch.float64, torch.float32))
    skip = {"sinks"} if not case.sinks else set()
    skip |= set(FROZEN) if case.frozen else set()
    errors = {name: (_rel(ours[i], exact[i]), _rel(fp32[i], exact[i])) for i, name in enumerate(NAMES)
              if name not in skip}
    return {"path": reason or "kernel", "errors": errors}


@torch.no_grad()
def compare_qk_forward(case: Case, device="cuda", seed=0):
    """`compare_qk` for the output alone, of a forward that keeps nothing for a backward (inference)."""
    tensors, _ = make_inputs(case, device, seed)
    ours, exact, fp32 = (_output(case, [t.to(dtype or t.dtype) for t in tensors], dtype)
                         for dtype in (None, torch.float64, torch.float32))
    return {"errors": {"y": (_rel(ours, exact), _rel(fp32, exact))}}
