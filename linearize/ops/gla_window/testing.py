"""The fused kernel against the reference, case by case: `python -m linearize.ops.gla_window.testing`.

Prints, per case, the relative error (Frobenius) of the output and of every gradient against
`naive.gla_window_parallel` in float64 on the same (rounded) inputs. `compare` is what the tests use
(tests/kernels/test_lizard_triton.py), and what a user runs on a new GPU before trusting the kernels.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from . import chunk_gla_window, naive, unsupported_reason
from .options import GlaWindowOptions

NAMES = ("y", "fq", "fk", "log_g", "qw", "kw", "v", "sinks", "alpha")
FROZEN = ("qw", "kw", "v")  # stage 1: RoPE of frozen projections, and a frozen projection
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 1e-2}


@dataclasses.dataclass(frozen=True)
class Case:
    L: int
    gate: str = "scalar"  # or "vector"
    dtype: torch.dtype = torch.float32
    window: int = 32
    sinks: int = 4
    B: int = 2
    H: int = 4
    HKV: int = 2
    F: int = 64
    D: int = 64
    gate_bias: float = 3.0  # log g = logsigmoid(N(0, 1) + bias): 3 keeps gamma near 1, -4 forgets fast
    split: bool | None = None  # force the chunk-parallel (True) or one-pass (False) kernels; None: the default
    state_block_k: int | None = None  # state rows a program of the split kernels' forward state pass carries
    state_block_v: int | None = None  # and its value columns
    dstate_block_k: int | None = None  # state rows a program of the backward's state pass carries
    dv_block_v: int | None = None  # value columns a program of the backward's dv pass writes
    window_dq_block: int | None = None  # query rows a program of the backward's window dq pass takes
    window_dkv_block: int | None = None  # and key rows of its dk/dv pass
    chunks_first: bool | None = None  # the launch order (Config.chunks_first); None: the default
    fused_backward: bool | None = None  # the split backward's one chunk kernel (Config.fused_backward)
    tma: bool | None = None  # the forward's tiles through tensor descriptors (Config.tma)
    normalize: bool = True  # False: Liger's unnormalised linear part
    shared: bool = False  # one normaliser for both branches (Lizard's `combine="shared"`)
    frozen: bool = False  # the kernel's qw, kw and v need no gradient (stage 1); their errors are not reported
    dy_transposed: bool = False  # dy laid out [B, L, H, D], as the model's o_proj hands it back, viewed [B, H, L, D]


def make_inputs(case: Case, device, seed=0):
    """Hedgehog-like features (non-negative, exp-based) and random gates, in the case's dtype."""
    g = torch.Generator(device=device).manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g, device=device)
    B, H, L = case.B, case.H, case.L
    half = case.F // 2
    u, w = rand(B, H, L, half), rand(B, H, L, half)
    fq = torch.cat([u.softmax(-1), (-u).softmax(-1)], -1)
    fk = torch.cat([w.softmax(-1), (-w).softmax(-1)], -1)
    log_g = F.logsigmoid(rand(B, H, L, 1 if case.gate == "scalar" else case.F) + case.gate_bias)
    qw, kw, v = rand(B, H, L, case.D), rand(B, case.HKV, L, case.D), rand(B, case.HKV, L, case.D)
    # The model computes its gate (and keeps sinks and alpha) in float32.
    tensors = [fq.to(case.dtype), fk.to(case.dtype), log_g] + [t.to(case.dtype) for t in (qw, kw, v)]
    tensors += [rand(H, case.sinks), torch.linspace(0.5, 1.5, H, device=device)]
    dy = rand(B, L, H, case.D).transpose(1, 2) if case.dy_transposed else rand(B, H, L, case.D)
    return tensors, dy.to(case.dtype)


def _output(case, leaves, dtype):
    """y through the kernel (dtype None; the case's Config overrides applied) or the reference op in `dtype`."""
    fq, fk, log_g, qw, kw, v, sinks, alpha = leaves
    opts = GlaWindowOptions(window=case.window, scale=case.D**-0.5, sinks=sinks if case.sinks else None, alpha=alpha,
                            normalize=case.normalize, shared=case.shared)
    overrides = {"split": case.split} if case.split is not None else {}
    for name in ("state_block_k", "state_block_v", "dstate_block_k", "dv_block_v", "window_dq_block",
                 "window_dkv_block", "chunks_first", "fused_backward", "tma"):
        if getattr(case, name) is not None:
            overrides[name] = getattr(case, name)
    if dtype is None and overrides:
        from .triton import Config, lizard_attention_triton

        config = dataclasses.replace(Config.default(fq.dtype), **overrides)
        return lizard_attention_triton(fq, fk, log_g, qw, kw, v, opts, config=config)
    if dtype is None:
        return chunk_gla_window(fq, fk, log_g, qw, kw, v, opts)[0]
    state = naive.init_state(case.B, case.H, case.HKV, case.F, case.D, case.window, device=fq.device, dtype=dtype)
    valid = torch.ones(case.B, case.L, dtype=torch.bool, device=fq.device)
    return naive.gla_window_parallel(fq, fk, log_g, qw, kw, v, valid, state, opts)[0]


def _run(case, tensors, dy, dtype):
    """Output and gradients, through the kernel (dtype None) or the reference op in `dtype`."""
    frozen = dtype is None and case.frozen
    leaves = [t.detach().clone().to(dtype or t.dtype).requires_grad_(not (frozen and name in FROZEN))
              for t, name in zip(tensors, NAMES[1:])]
    y = _output(case, leaves, dtype)
    trained = [t for t in leaves if t.requires_grad]
    grads = iter(torch.autograd.grad(y, trained, dy.to(y.dtype), allow_unused=True))
    grads = [next(grads) if t.requires_grad else None for t in leaves]
    return [y] + [torch.zeros_like(t) if g is None else g for t, g in zip(leaves, grads)]


def _rel(a, b):
    # Gradients that vanish exactly (d log g at L = 1) are compared in absolute terms.
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-5)).item()


def compare(case: Case, device="cuda", seed=0):
    """Relative errors vs float64, of the kernel and of the reference op run in float32 (the yardstick
    for ill-conditioned cases), per output/gradient; plus which path ran ("kernel" or the reason not)."""
    tensors, dy = make_inputs(case, device, seed)
    reason = unsupported_reason(*tensors[:6], window=case.window, sinks=tensors[6] if case.sinks else None)
    ours = _run(case, tensors, dy, None)
    exact = _run(case, tensors, dy, torch.float64)
    fp32 = _run(case, tensors, dy, torch.float32)
    names = [n for n in NAMES if (n != "sinks" or case.sinks) and not (case.frozen and n in FROZEN)]
    keep = [i for i, n in enumerate(NAMES) if n in names]
    errors = {NAMES[i]: (_rel(ours[i], exact[i]), _rel(fp32[i], exact[i])) for i in keep}
    return {"path": reason or "kernel", "errors": errors}


@torch.no_grad()
def compare_forward(case: Case, device="cuda", seed=0):
    """`compare` for the output alone, of a forward that keeps nothing for a backward (inference,
    prefill): the forward kernel's variant that saves nothing."""
    tensors, _ = make_inputs(case, device, seed)
    reason = unsupported_reason(*tensors[:6], window=case.window, sinks=tensors[6] if case.sinks else None)
    ours, exact, fp32 = (_output(case, [t.to(dtype or t.dtype) for t in tensors], dtype)
                         for dtype in (None, torch.float64, torch.float32))
    return {"path": reason or "kernel", "errors": {"y": (_rel(ours, exact), _rel(fp32, exact))}}


def within_tolerance(case, errors) -> bool:
    """Each error below the dtype of the case's inputs allows (a `Case` or `still_check.StillCase`), or within 4x
    of float32 PyTorch where that is worse."""
    tol = TOLERANCE[case.dtype]
    return all(err <= max(tol, 4 * err32) for err, err32 in errors.values())


CHECK_CASES = [
    Case(L=1), Case(L=63, window=64), Case(L=100, sinks=0), Case(L=257, window=64, gate="vector"),
    Case(L=1000, window=128, F=128, D=128), Case(L=600, window=256, sinks=8, F=128, D=128, gate="vector"),
    Case(L=257, dtype=torch.bfloat16, window=64), Case(L=1000, dtype=torch.bfloat16, window=128, F=128, D=128),
    Case(L=600, dtype=torch.bfloat16, window=128, F=128, D=128, gate="vector"),
    Case(L=517, dtype=torch.float16, window=32, sinks=0),
    Case(L=1000, dtype=torch.bfloat16, window=128, F=128, D=128, split=False),
    Case(L=600, window=256, sinks=8, F=128, D=128, gate="vector", split=True),
    Case(L=1000, dtype=torch.bfloat16, window=64, sinks=0, F=64, D=64, normalize=False),
    Case(L=1000, dtype=torch.bfloat16, window=256, F=128, D=64, shared=True),  # twice SmolLM2's features
]


def run_checks(device):
    print(f"{'case':<58} {'path':<8} {'worst':<6} {'max rel err':>11}  ok")
    for case in CHECK_CASES:
        out = compare(case, device)
        worst = max(out["errors"], key=lambda n: out["errors"][n][0])
        label = (f"L={case.L} {case.gate} {str(case.dtype)[6:]} w={case.window} M={case.sinks} "
                 f"H={case.H}/{case.HKV} F={case.F} D={case.D}"
                 + {None: "", True: " split", False: " one-pass"}[case.split]
                 + ("" if case.normalize else " unnormalised"))
        path = "kernel" if out["path"] == "kernel" else "fallback"
        print(f"{label:<58} {path:<8} {worst:<6} {out['errors'][worst][0]:>11.2e}  "
              f"{within_tolerance(case, out['errors'])}")


if __name__ == "__main__":
    run_checks("cuda" if torch.cuda.is_available() else "cpu")
