"""Check the STILL kernels against the reference op: `compare_still` (what the tests use).

Reference: `naive.still_parallel(fresh=True, keep_state=False)` in float64 on the same (rounded)
inputs, with the feature maps' outputs fq, fk given as tensors, so their gradients are compared too.
Relative Frobenius errors of y and of every gradient, as `gla_window.testing.compare` reports them.
"""

from __future__ import annotations

import dataclasses

import torch

from ..gla_window.testing import _rel
from . import naive as still
from . import unsupported_reason

NAMES = ("y", "q", "k", "v", "fq", "fk", "gate")


@dataclasses.dataclass(frozen=True)
class StillCase:
    L: int
    B: int = 2
    H: int = 4
    HKV: int = 2
    D: int = 32
    F: int = 32
    window: int = 16
    chunk: int = 8
    per_chunk: int = 2
    slots: int = 8  # salient slots (budget - window); few, so that the slots overflow and evict
    gate: bool = True
    pad: int = 3  # left padding of the second row
    routing: str = "saliency"
    dtype: torch.dtype = torch.float32


def make_inputs(case: StillCase, device, seed=0):
    """q, k, v (as if rotated), positive features fq, fk, a sigmoid gate, validity; and dy."""
    g = torch.Generator(device=device).manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g, device=device)
    B, H, L = case.B, case.H, case.L
    q, k, v = rand(B, H, L, case.D), rand(B, case.HKV, L, case.D), rand(B, case.HKV, L, case.D)
    fq, fk = rand(B, H, L, case.F).softmax(-1), rand(B, H, L, case.F).softmax(-1)
    tensors = [t.to(case.dtype) for t in (q, k, v, fq, fk)]
    tensors.append(rand(B, H, L, case.D).sigmoid() if case.gate else None)
    valid = torch.ones(B, L, dtype=torch.bool, device=device)
    valid[1:, : case.pad] = False
    return tensors, valid, rand(B, H, L, case.D).to(case.dtype)


def _options(case: StillCase) -> dict:
    return {"window": case.window, "chunk": case.chunk, "per_chunk": case.per_chunk, "routing": case.routing,
            "scale": case.D**-0.5, "eps": 1e-6}


def _run(case, tensors, valid, dy, dtype):
    """Output and gradients, through the kernels (dtype None) or the reference op in `dtype`."""
    leaves = [None if t is None else t.detach().clone().to(dtype or t.dtype).requires_grad_() for t in tensors]
    q, k, v, fq, fk, gate = leaves
    options = _options(case)
    state = still.init_state(case.B, case.H, case.HKV, case.F, case.D, case.window, case.slots, device=q.device,
                             dtype=dtype or torch.float32)
    if dtype is None:
        with torch.no_grad():
            # Routing in float32, as the model runs it (its q, k come rotated in float32).
            fold, _ = still.fresh_routing(q.float(), k.float(), v.float(), valid, state, start=0, **options)
        from .triton import still_attention_triton

        y = still_attention_triton(q, k, v, fq, fk, gate, fold, valid, scale=options["scale"], eps=options["eps"])
    else:
        y, _ = still.still_parallel(q, k, v, valid, gate, state, lambda _: fq, lambda _: fk, start=0, **options,
                                    fresh=True, keep_state=False)
    trained = [t for t in leaves if t is not None]
    grads = iter(torch.autograd.grad(y, trained, dy.to(y.dtype)))
    return [y] + [None if t is None else next(grads) for t in leaves]


def compare_still(case: StillCase, device="cuda", seed=0):
    """Relative errors vs float64, of the kernels and of the reference op in float32, per output and
    gradient; plus which path ran ("kernel" or the reason not)."""
    tensors, valid, dy = make_inputs(case, device, seed)
    reason = unsupported_reason(tensors[0], tensors[1], case.F)
    ours = _run(case, tensors, valid, dy, None)
    exact = _run(case, tensors, valid, dy, torch.float64)
    fp32 = _run(case, tensors, valid, dy, torch.float32)
    errors = {name: (_rel(ours[i], exact[i]), _rel(fp32[i], exact[i]))
              for i, name in enumerate(NAMES) if exact[i] is not None}
    return {"path": reason or "kernel", "errors": errors}
