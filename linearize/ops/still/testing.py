"""Check the STILL kernels against the reference op (what the tests use).

`compare_still`: a fresh pass, against `naive.still_parallel(fresh=True, keep_state=False)` in
float64 on the same (rounded) inputs, with the feature maps' outputs fq, fk given as tensors, so their
gradients are compared too. Relative Frobenius errors of y and of every gradient, as
`gla_window.testing.compare` reports them.
`compare_continued`: a call continuing a filled state through `still`'s kernel path, against
`still_parallel(fresh=False)` on the same state and inputs: y and every entry of the state after.
`compare_blocks`: a fresh call split into kernel blocks, against one `still_parallel` pass and the
one-call kernel pass (the chunked kernel set aside: `without_chunk_kernel`).
`compare_chunk_kernel`: the chunked form's kernel (`chunk_triton`) against the reference in y, and a
fresh call through `chunk_still`'s dispatch (which implementation ran, y and the state after). `counting_parts` and `state_errors` serve the model-level check
(tests/attention_kernel_check.py `check_still_pieces`), which needs the tests' tiny models.
"""

from __future__ import annotations

import dataclasses

import torch

from .. import backend
from .. import still as dispatch
from ..gla_window.testing import _rel
from . import naive as still
from . import unsupported_reason
from .options import StillOptions
from .routing import fresh_routing

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
    prefix: int = 0  # `compare_continued`: tokens of the first (fresh) call, which fills the state


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


def _options(case: StillCase) -> StillOptions:
    return StillOptions(window=case.window, chunk=case.chunk, per_chunk=case.per_chunk, routing=case.routing,
                        scale=case.D**-0.5, eps=1e-6)


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
            fold, _ = fresh_routing(q.float(), k.float(), v.float(), valid, state, options, start=0)
        from .triton import still_attention_triton

        y = still_attention_triton(q, k, v, fq, fk, gate, fold, valid, scale=options.scale, eps=options.eps)
    else:
        y, _ = still.still_parallel(q, k, v, valid, gate, state, lambda _: fq, lambda _: fk, options, start=0,
                                    fresh=True, keep_state=False)
    trained = [t for t in leaves if t is not None]
    grads = iter(torch.autograd.grad(y, trained, dy.to(y.dtype)))
    return [y] + [None if t is None else next(grads) for t in leaves]


def compare_still(case: StillCase, device="cuda", seed=0):
    """Relative errors vs float64, of the kernels and of the reference op in float32, per output and
    gradient; plus which path ran ("kernel" or the reason not)."""
    tensors, valid, dy = make_inputs(case, device, seed)
    reason = unsupported_reason(tensors[0], tensors[1], case.F, case.dtype)
    ours = _run(case, tensors, valid, dy, None)
    exact = _run(case, tensors, valid, dy, torch.float64)
    fp32 = _run(case, tensors, valid, dy, torch.float32)
    errors = {name: (_rel(ours[i], exact[i]), _rel(fp32[i], exact[i]))
              for i, name in enumerate(NAMES) if exact[i] is not None}
    return {"path": reason or "kernel", "errors": errors}


class FeatureMap(torch.nn.Module):
    """A fixed positive feature map, softmax(x W) [.., F] (the kernels' paths read `out_dim`, and the
    continued path applies phi_k to the state's stored keys, so a map rather than given outputs)."""

    def __init__(self, D, F, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.register_buffer("weight", torch.randn(D, F, generator=g) * D**-0.5)
        self.out_dim = F

    def forward(self, x):
        return (x @ self.weight.to(x.device, x.dtype)).softmax(-1)


def state_errors(ours: dict, ref: dict) -> dict:
    """Same entries, integer and boolean ones equal, the largest relative error of the float ones."""
    return {"state_names": sorted(ours) == sorted(ref),
            "state_exact": all(torch.equal(ours[n], ref[n]) for n in ref if not ref[n].is_floating_point()),
            "state": max(_rel(ours[n], ref[n]) for n in ref if ref[n].is_floating_point() and ref[n].norm() > 0)}


def counting_parts(calls: list):
    """Count `still_attention_parts` calls (the continued kernel path) while the context is open."""
    import contextlib

    from . import triton as kernels

    @contextlib.contextmanager
    def counting():
        parts = kernels.still_attention_parts
        kernels.still_attention_parts = lambda *a, **k: calls.append(1) or parts(*a, **k)
        try:
            yield
        finally:
            kernels.still_attention_parts = parts

    return counting()


def compare_continued(case: StillCase, device="cpu", seed=0, requires_grad=False):
    """A fresh call over `case.prefix` tokens fills a state (the reference's); a call over the next
    `case.L` continues it, through `continue_still` (the kernels, operands in `case.dtype`) and through
    `still_parallel(fresh=False)` in float32. Relative error of y, the state's errors, the path, and
    how many kernel calls ran. `requires_grad`: q needs a gradient in the call through `continue_still` (which
    then takes the reference, the kernels' continued form having no backward)."""
    case_all = dataclasses.replace(case, L=case.prefix + case.L, dtype=torch.float32)
    (q, k, v, _, _, gate), valid, _ = make_inputs(case_all, device, seed)
    phi_q, phi_k = FeatureMap(case.D, case.F, seed + 1).to(device), FeatureMap(case.D, case.F, seed + 2).to(device)
    options = _options(case)
    first, rest = slice(0, case.prefix), slice(case.prefix, None)

    def part(s):
        return q[:, :, s], k[:, :, s], v[:, :, s], valid[:, s], None if gate is None else gate[:, :, s]

    state = naive_init(case, device)
    calls = []
    with torch.no_grad():
        _, state = still.still_parallel(*part(first), state, phi_q, phi_k, options, start=0, fresh=True)
        ref_y, ref_state = still.still_parallel(*part(rest), state, phi_q, phi_k, options, start=case.prefix)
        inputs = part(rest)
        with counting_parts(calls), torch.set_grad_enabled(requires_grad):
            inputs = (inputs[0].clone().requires_grad_(requires_grad), *inputs[1:])
            y, new_state = dispatch.continue_still(*inputs, state, phi_q, phi_k, options, start=case.prefix,
                                                   caching=True, dtype=case.dtype)
    reason = unsupported_reason(q, k, case.F, case.dtype)
    return {"path": reason or "kernel", "calls": len(calls), "y": _rel(y.detach(), ref_y), "dtype": str(y.dtype),
            "differentiable": y.requires_grad,
            **state_errors(new_state, ref_state)}


def compare_chunk_kernel(case: StillCase, device="cpu", seed=0, launch=None):
    """The chunked kernel (`launch` its tiles, default `chunk_launch`'s) on the case's inputs against
    `still_parallel(fresh=True, keep_state=False)` in float64: y's relative error beside float32
    PyTorch's (`errors`, as `compare_still`'s); then a caching fresh call through `chunk_still` with
    fixed feature maps, against `still_parallel` in float32 (y, every state entry) and the
    implementation it ran."""
    from .chunk_triton import still_chunk_triton

    tensors, valid, _ = make_inputs(case, device, seed)
    q, k, v, fq, fk, gate = tensors
    options = _options(case)
    with torch.no_grad():
        fold, _ = fresh_routing(q.float(), k.float(), v.float(), valid, naive_init(case, device), options, start=0)
        ours = still_chunk_triton(q, k, v, fq, fk, gate, fold, valid, options, slots=case.slots, launch=launch)

        def reference(dtype):
            t = [None if x is None else x.to(dtype) for x in tensors]
            state = still.init_state(case.B, case.H, case.HKV, case.F, case.D, case.window, case.slots, device=device,
                                     dtype=dtype)
            y, _ = still.still_parallel(t[0], t[1], t[2], valid, t[5], state, lambda _: t[3], lambda _: t[4], options,
                                        start=0, fresh=True, keep_state=False)
            return y

        exact = reference(torch.float64)
        errors = {"y": (_rel(ours, exact), _rel(reference(torch.float32), exact))}

        (q, k, v, _, _, gate), valid, _ = make_inputs(dataclasses.replace(case, dtype=torch.float32), device, seed)
        phi_q, phi_k = FeatureMap(case.D, case.F, seed + 1).to(device), FeatureMap(case.D, case.F, seed + 2).to(device)
        inputs = (q, k, v, valid, gate, naive_init(case, device), phi_q, phi_k)
        ref_y, ref_state = still.still_parallel(*inputs, options, start=0, fresh=True)
        with backend.recording() as ran:
            y, new_state = dispatch.chunk_still(*inputs, options, dtype=case.dtype, output_final_state=True)
    reason = unsupported_reason(q, k, case.F, case.dtype)
    return {"path": reason or "kernel", "errors": errors, "ran": [impl for _, impl in ran], "dtype": str(y.dtype),
            "dispatched": _rel(y, ref_y), **state_errors(new_state, ref_state)}


def without_chunk_kernel():
    """`chunk_still` without the chunked kernel while the context is open: fresh calls without
    gradients take the kernels in blocks of KERNEL_BLOCK tokens, as where the chunked kernel refuses."""
    import contextlib

    @contextlib.contextmanager
    def context():
        form = dispatch.CHUNK
        dispatch.CHUNK = backend.Form(form.name, tuple(i for i in form.implementations if i.name != "triton-chunked"))
        try:
            yield
        finally:
            dispatch.CHUNK = form

    return context()


def compare_blocks(case: StillCase, block: int, device="cpu", seed=0):
    """A fresh call over `case.L` tokens through `chunk_still` with KERNEL_BLOCK = `block`, against one
    `still_parallel` fresh pass and against the one-call kernel pass: relative errors of y and of the
    state after, how many fresh and continued kernel calls the caching call ran, and a scoring call's
    y (caching off) and whether it returned a state."""
    from . import triton as kernels

    (q, k, v, _, _, gate), valid, _ = make_inputs(dataclasses.replace(case, dtype=torch.float32), device, seed)
    phi_q, phi_k = FeatureMap(case.D, case.F, seed + 1).to(device), FeatureMap(case.D, case.F, seed + 2).to(device)
    options = _options(case)
    inputs = (q, k, v, valid, gate, naive_init(case, device), phi_q, phi_k)
    fresh_calls, calls = [], []
    one_call = kernels.still_attention_triton
    kept = dispatch.KERNEL_BLOCK
    with torch.no_grad():
        ref_y, ref_state = still.still_parallel(*inputs, options, start=0, fresh=True)
        old_y, old_state = dispatch._fresh_pass_through_kernels(*inputs, options, start=0, caching=True,
                                                                dtype=case.dtype)
        kernels.still_attention_triton = lambda *a, **k: fresh_calls.append(1) or one_call(*a, **k)
        dispatch.KERNEL_BLOCK = block
        try:
            with counting_parts(calls), without_chunk_kernel():
                y, new_state = dispatch.chunk_still(*inputs, options, dtype=case.dtype, output_final_state=True)
            fresh_count = len(fresh_calls)
            # A scoring pass: no state kept after the last block.
            with without_chunk_kernel():
                y_scored, no_state = dispatch.chunk_still(*inputs, options, dtype=case.dtype)
        finally:
            dispatch.KERNEL_BLOCK = kept
            kernels.still_attention_triton = one_call
    vs_ref, vs_old = state_errors(new_state, ref_state), state_errors(new_state, old_state)
    return {"fresh_calls": fresh_count, "calls": len(calls), "y": _rel(y, ref_y), "y_old": _rel(y, old_y),
            "y_scored": _rel(y_scored, ref_y), "scored_state": no_state is not None,
            "state_names": vs_ref["state_names"], "state_exact": vs_ref["state_exact"] and vs_old["state_exact"],
            "state": vs_ref["state"], "state_old": vs_old["state"]}


def naive_init(case: StillCase, device):
    """The empty float32 state for the case's shapes."""
    return still.init_state(case.B, case.H, case.HKV, case.F, case.D, case.window, case.slots, device=device)
