"""Check the Lizard kernel against the reference op and time it: `python -m linearize.kernels.check`.

Prints, per case, the relative error (Frobenius) of the output and of every gradient against
`gla_window_parallel` in float64 on the same (rounded) inputs, then median forward and
forward+backward times in ms at B=16, H=32, D=128, L=2K/4K/8K for our kernel and, where installed,
fla's chunk_gla and chunk_simple_gla and PyTorch's causal SDPA. `compare` is also what the tests use.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import functools
import io
import pstats
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ..ops import gla_window
from . import lizard_attention, unsupported_reason

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
    opts = {"window": case.window, "scale": case.D**-0.5, "sinks": sinks if case.sinks else None, "alpha": alpha,
            "normalize": case.normalize, "shared": case.shared}
    overrides = {"split": case.split} if case.split is not None else {}
    for name in ("state_block_k", "state_block_v", "dstate_block_k", "dv_block_v", "window_dq_block",
                 "window_dkv_block", "chunks_first", "fused_backward", "tma"):
        if getattr(case, name) is not None:
            overrides[name] = getattr(case, name)
    if dtype is None and overrides:
        from .lizard_triton import Config, lizard_attention_triton

        config = dataclasses.replace(Config.default(fq.dtype), **overrides)
        return lizard_attention_triton(fq, fk, log_g, qw, kw, v, **opts, config=config)
    if dtype is None:
        return lizard_attention(fq, fk, log_g, qw, kw, v, **opts)
    state = gla_window.init_state(case.B, case.H, case.HKV, case.F, case.D, case.window, device=fq.device, dtype=dtype)
    valid = torch.ones(case.B, case.L, dtype=torch.bool, device=fq.device)
    return gla_window.gla_window_parallel(fq, fk, log_g, qw, kw, v, valid, state, beta=1.0, **opts)[0]


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


# ----------------------------------------------------------------------------------------------------
# Timing


def _median_ms(fn, reps=20, budget_ms=2000.0):
    """Median of up to `reps` timed runs after one warm-up; slow ops stop once `budget_ms` is spent
    (3 runs at least), so the vector gate's long rows don't eat a GPU call."""
    fn()
    torch.cuda.synchronize()
    times = []
    while len(times) < reps and (len(times) < 3 or sum(times) < budget_ms):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _fwd_and_bwd(forward, inputs, profile_to=None):
    """(forward-only ms without autograd, forward+backward ms); with `profile_to` (a path stem), each
    pass's kernels once more under torch.profiler, into `<stem>-fwd.txt` and `<stem>-fwd+bwd.txt`."""
    from ..bench.common import write_profile

    with torch.no_grad():
        fwd = _median_ms(forward)
        if profile_to is not None:
            write_profile(forward, torch.device("cuda"), Path(f"{profile_to}-fwd.txt"), rows=15)
    leaves = [t.requires_grad_() for t in inputs if t.is_floating_point()]
    y = forward()
    dy = torch.randn_like(y)
    del y
    both = lambda: torch.autograd.grad(forward(), leaves, dy)
    both_ms = _median_ms(both)
    if profile_to is not None:
        write_profile(both, torch.device("cuda"), Path(f"{profile_to}-fwd+bwd.txt"), rows=15)
    for t in leaves:
        t.requires_grad_(False)
    return fwd, both_ms


def _bench_ours(B, H, L, D, gate, config=None, shared=False, profile_to=None):
    from .lizard_triton import lizard_attention_triton

    case = Case(L=L, gate=gate, dtype=torch.bfloat16, window=128, sinks=4, B=B, H=H, HKV=H, F=D, D=D)
    (fq, fk, log_g, qw, kw, v, sinks, alpha), _ = make_inputs(case, "cuda")
    inputs = [fq, fk, log_g, qw, kw, v, sinks] + ([] if shared else [alpha])  # the shared form has no alpha
    return _fwd_and_bwd(lambda: lizard_attention_triton(fq, fk, log_g, qw, kw, v, window=128, scale=D**-0.5,
                                                        sinks=sinks, alpha=alpha, shared=shared, config=config),
                         inputs, profile_to)


def _bench_fla(B, H, L, D, which):
    if which == "chunk_gla":
        from fla.ops.gla import chunk_gla as op
    else:
        from fla.ops.simple_gla import chunk_simple_gla as op
    q, k, v = (torch.randn(B, L, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    g_shape = (B, L, H, D) if which == "chunk_gla" else (B, L, H)
    g = F.logsigmoid(torch.randn(g_shape, device="cuda") + 3)
    return _fwd_and_bwd(lambda: op(q=q, k=k, v=v, g=g, scale=D**-0.5)[0], [q, k, v, g])


def _bench_sdpa(B, H, L, D):
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    return _fwd_and_bwd(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), [q, k, v])


def run_bench(lengths, B=16, H=32, D=128):
    from .lizard_triton import Config

    one_pass = dataclasses.replace(Config.default(torch.bfloat16), split=False)
    # The rows the targets compare come first: a call's time limit cuts the list from its end.
    rows = [("lizard scalar gate (w=128, M=4)", lambda L: _bench_ours(B, H, L, D, "scalar")),
            ("lizard scalar gate, shared normaliser", lambda L: _bench_ours(B, H, L, D, "scalar", shared=True)),
            ("fla chunk_gla", lambda L: _bench_fla(B, H, L, D, "chunk_gla")),
            ("fla chunk_simple_gla", lambda L: _bench_fla(B, H, L, D, "chunk_simple_gla")),
            ("SDPA causal", lambda L: _bench_sdpa(B, H, L, D)),
            ("lizard scalar gate, one pass", lambda L: _bench_ours(B, H, L, D, "scalar", one_pass)),
            ("lizard vector gate (w=128, M=4)", lambda L: _bench_ours(B, H, L, D, "vector")),
            ("lizard vector gate, one pass", lambda L: _bench_ours(B, H, L, D, "vector", one_pass))]
    print(f"\nmedian ms, bf16, B={B} H={H} D={D} (forward / forward+backward)")
    print(f"{'':<34}" + "".join(f"{'L=' + str(L):>20}" for L in lengths))
    for name, bench in rows:
        cells = []
        for L in lengths:
            try:
                fwd, both = bench(L)
                cells.append(f"{fwd:8.2f} / {both:8.2f}")
            except Exception as e:  # noqa: BLE001 - fla missing, out of memory...: report, go on
                cells.append(f"{type(e).__name__:>19}")
            torch.cuda.empty_cache()
        print(f"{name:<34}" + "".join(f"{c:>20}" for c in cells), flush=True)


def _host_ms(fn, reps=20):
    """Median host time of a call (Python and launches, the GPU idle and waiting at the start)."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize()
    return sorted(times)[reps // 2]


def _host_profile(fn, calls=50, rows=20) -> str:
    """The host's time in `fn` by function (cProfile, own time first) over `calls` calls."""
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        fn()
    profile.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(rows)
    return out.getvalue()


def _our_forward(B, L, H, D):
    """Our forward on random Table 3 style inputs (bf16, scalar gate, 4 sinks, F = D, no GQA): a
    function of (config, window) giving a call of it, for the timings that run it without autograd."""
    from .lizard_triton import lizard_attention_triton

    case = Case(L=L, dtype=torch.bfloat16, window=128, sinks=4, B=B, H=H, HKV=H, F=D, D=D)
    (fq, fk, log_g, qw, kw, v, sinks, alpha), _ = make_inputs(case, "cuda")

    def forward(config=None, window=128):
        return functools.partial(lizard_attention_triton, fq, fk, log_g, qw, kw, v, window=window, scale=D**-0.5,
                                 sinks=sinks, alpha=alpha, config=config)

    return forward


def run_host(lengths, B=16, H=32, D=128):
    """Where a lone forward's time goes: our forward (bf16, scalar gate, no autograd) timed by CUDA
    events as `bench kernels` times it, the host's share of one call, and the same forward replayed
    from a CUDA graph (its kernels alone, no host work before them); then, at the first length, the
    host's time by function."""
    print(f"\nour forward, bf16 scalar gate, B={B} H={H} D={D}: events / host / graph replay ms")
    for L in lengths:
        forward = _our_forward(B, L, H, D)()
        with torch.no_grad():
            events, host = _median_ms(forward), _host_ms(forward)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                forward()
            replay = _median_ms(graph.replay)
        print(f"L={L}: {events:.3f} / {host:.3f} / {replay:.3f}", flush=True)
        if L == lengths[0]:
            with torch.no_grad():
                profile = _host_profile(forward)
        del graph
        torch.cuda.empty_cache()
    print(f"\nthe host's time in 50 forwards at L={lengths[0]}, by function:\n{profile}", flush=True)


def sweep_configs():
    """The configurations `--sweep` times: the default, then one change at a time (the backward's
    per-pass dq, dk and dv kernels instead of the fused chunk kernel; the heads first in the launch
    order, where the window's neighbouring tiles miss L2; then kernel families' blocks at their
    previous or next size: the forward's value columns, which at 64 double its programs and its score
    GEMMs; the backward window passes'; the state passes' rows, forward and backward; no software
    pipelining). `stages=3` needs more shared memory than an H200 has, and 8 warps were ~1.7x slower
    (the thirteenth and twenty-second sessions' sweeps; the fused chunk kernel alone at 8 warps, 2.18
    ms against 1.47 at 4, the twenty-third's). The earlier sweeps and what they chose are in
    docs/kernels.md."""
    from .lizard_triton import Config

    default = Config.default(torch.bfloat16)
    change = functools.partial(dataclasses.replace, default)
    return [default, change(fused_backward=False), change(chunks_first=False),
            change(block_v=64), change(window_dq_block=32), change(window_dkv_block=64), change(state_block_k=64),
            change(dstate_block_k=128), change(stages=1)]


def forward_sweep_rows():
    """(label, Config, window) rows of `--sweep-forward`: the default; its chunk kernel capped at 128
    registers (four programs an SM, spilling) and without a cap (two programs an SM, not three);
    through pointer loads instead of tensor descriptors (TMA); the window at two key blocks and at one
    (what each of its three 64-key blocks costs: docs/kernels.md)."""
    from .lizard_triton import Config

    default = Config.default(torch.bfloat16)
    change = functools.partial(dataclasses.replace, default)
    return [("default", default, 128), ("128 registers", change(forward_registers=128), 128),
            ("no register cap", change(forward_registers=None), 128), ("pointer loads", change(tma=False), 128),
            ("window 64 (two key blocks)", default, 64), ("window 1 (the diagonal block)", default, 1)]


def _kernel_ms(fn, calls=5) -> dict[str, float]:
    """Each kernel's mean device ms a call of `fn`, from torch.profiler over `calls` calls."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return {e.key: e.self_device_time_total / calls / 1e3 for e in prof.key_averages() if e.self_device_time_total}


def _forward_row(label: str, forward) -> str:
    """One `--sweep-forward` row: CUDA events / graph replay ms, then each kernel's ms."""
    try:
        with torch.no_grad():
            events = _median_ms(forward)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                forward()
            replay = _median_ms(graph.replay)
            kernels = _kernel_ms(forward)
        del graph
        parts = ", ".join(f"{name} {ms:.3f}" for name, ms in sorted(kernels.items()))
        return f"{label}: {events:.3f} / {replay:.3f} ({parts})"
    except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: report, go on
        return f"{label}: {type(e).__name__}: {str(e)[:80]}"


def fla_tuned_configs() -> list[str]:
    """The block configurations fla's autotuner picked for its chunked forward's kernels, per key."""
    from fla.ops.common import chunk_h, chunk_o
    from triton.runtime.autotuner import Autotuner

    lines = []
    for module in (chunk_h, chunk_o):
        for name, fn in vars(module).items():
            while not isinstance(fn, Autotuner) and hasattr(fn, "fn"):  # under heuristics wrappers
                fn = fn.fn
            if isinstance(fn, Autotuner):
                lines += [f"{name} {key}: {config}" for key, config in fn.cache.items()]
    return lines


def run_forward_sweep(lengths, batches=(16,), H=32, D=128):
    """Time our forward alone (bf16, scalar gate, no autograd) at each `forward_sweep_rows` row: CUDA
    events as `bench kernels` times a call, a CUDA graph's replay (the kernels alone) and each kernel's
    share, from the profiler; then, where fla is installed, its chunk_simple_gla forward the same way
    (the 1.3x target's baseline: which of its kernels our state pass and chunk kernel stand against)."""
    from ..bench.kernels import fla_unavailable, make_fla

    baseline = fla_unavailable(torch.device("cuda")) is None
    print(f"\nforward sweep, bf16 scalar gate, H={H} D={D}: events / graph replay ms, then each kernel's ms")
    for B, L in zip(batches, lengths):
        ours = _our_forward(B, L, H, D)
        for label, cfg, window in forward_sweep_rows():
            print(_forward_row(f"B={B} L={L} {label}", ours(cfg, window)), flush=True)
        del ours  # its inputs, before fla's
        if baseline:
            forward, _ = make_fla(simple=True)(B, H, L, D, torch.device("cuda"), torch.bfloat16)
            print(_forward_row(f"B={B} L={L} fla chunk_simple_gla", forward), flush=True)
            del forward
        torch.cuda.empty_cache()
    if baseline:
        print("\nfla's tuned configurations:\n" + "\n".join(fla_tuned_configs()), flush=True)


def state_sweep_configs():
    """Configurations `--sweep-states` times: the forward state pass's blocks (rows x value columns),
    warps and pipelining, fla's chunk_fwd_h autotuning space (32 and 64 rows and columns, 1-8 warps,
    2-4 stages; 1 warp left out) and ours (128 rows and columns); the rest as the bf16 default."""
    from .lizard_triton import Config

    default = Config.default(torch.bfloat16)
    blocks = [(128, 128), (128, 64), (64, 128), (64, 64), (64, 32), (32, 64), (32, 32)]
    return [dataclasses.replace(default, state_block_k=k, state_block_v=v, state_warps=w, state_stages=st)
            for k, v in blocks for w in (2, 4, 8) for st in (2, 3, 4)
            if k * v // (32 * w) <= 256]  # at most 256 float32 state registers a thread: no sense past that


def run_state_sweep(L, B, H=32, D=128):
    """Time the forward state pass alone (`_fwd_states_kernel`, from the profiler) at each
    `state_sweep_configs` row, fastest first."""
    ours = _our_forward(B, L, H, D)
    print(f"\nforward state pass, bf16 scalar gate, B={B} H={H} D={D} L={L}: ms (rows x columns, warps, stages)")
    rows = []
    for cfg in state_sweep_configs():
        label = f"{cfg.state_block_k} x {cfg.state_block_v}, {cfg.state_warps} warps, {cfg.state_stages} stages"
        forward = ours(cfg)
        try:
            with torch.no_grad():
                forward()
                ms = next(ms for name, ms in _kernel_ms(forward, calls=10).items() if "_fwd_states_kernel" in name)
        except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: report, go on
            print(f"{label}: {type(e).__name__}: {str(e)[:80]}", flush=True)
            continue
        print(f"{label}: {ms:.3f}", flush=True)
        rows.append((ms, label))
    print("\nfastest:\n" + "\n".join(f"{ms:.3f} {label}" for ms, label in sorted(rows)[:8]), flush=True)


def compiled_kernels():
    """(name, Triton's compiled kernel) for every variant of the Lizard kernels compiled in this process."""
    from triton.runtime.jit import JITFunction

    from . import lizard_triton

    for name, fn in vars(lizard_triton).items():
        if isinstance(fn, JITFunction) and name.endswith("_kernel"):
            for kernel_cache, *_ in fn.device_caches.values():
                for compiled in kernel_cache.values():
                    yield name, compiled


def write_resources(path: Path, skip: set) -> None:
    """Registers, spills and shared memory of the kernels compiled since `skip` was last updated (ids of
    those already written): what decides how many programs share an SM."""
    lines = []
    for name, compiled in compiled_kernels():
        if id(compiled) in skip:
            continue
        skip.add(id(compiled))
        meta = compiled.metadata
        lines.append(f"{name}: {getattr(compiled, 'n_regs', '?')} registers/thread, "
                     f"{getattr(compiled, 'n_spills', '?')} spilled, {meta.shared} B shared memory, "
                     f"{meta.num_warps} warps, {meta.num_stages} stages")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(sorted(lines)) + "\n")


def run_sweep(L, B=16, H=32, D=128, profile_dir=None):
    """Time block configurations of our kernel (bf16, scalar gate) to pick Config defaults; with
    `profile_dir`, each one's profile and its kernels' resources (`write_resources`) go there."""
    print(f"\nconfig sweep, bf16 scalar gate, B={B} H={H} D={D} L={L}: forward / forward+backward ms")
    written = set()
    for i, cfg in enumerate(sweep_configs()):
        try:
            profile_to = None if profile_dir is None else profile_dir / f"sweep{i}"
            fwd, both = _bench_ours(B, H, L, D, "scalar", cfg, profile_to=profile_to)
            print(f"{cfg}: {fwd:8.2f} / {both:8.2f}", flush=True)
        except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: report, go on
            print(f"{cfg}: {type(e).__name__}: {str(e)[:80]}", flush=True)
        if profile_dir is not None:
            write_resources(profile_dir / f"sweep{i}-resources.txt", written)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--no-check", action="store_true", help="skip the correctness cases")
    parser.add_argument("--no-bench", action="store_true", help="skip the timings")
    parser.add_argument("--sweep", action="store_true", help="also time block configurations at the first length")
    parser.add_argument("--sweep-forward", action="store_true",
                        help="time the forward alone at `forward_sweep_rows` (--lengths, with --batches)")
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 16, 16])
    parser.add_argument("--sweep-states", action="store_true",
                        help="time the forward state pass alone at `state_sweep_configs` (first length and batch)")
    parser.add_argument("--host", action="store_true",
                        help="also split our forward's time between the host and the GPU (`run_host`)")
    parser.add_argument("--profile", type=Path, metavar="DIR",
                        help="write the kernels of our forward and forward+backward at the first length, as "
                             "torch.profiler tables, into DIR (each swept configuration, else the default)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    if not args.no_check:
        run_checks("cuda")
    if not args.no_bench:
        run_bench(args.lengths)
    if args.host:
        run_host(args.lengths)
    if args.sweep_forward:
        run_forward_sweep(args.lengths, args.batches)
    if args.sweep_states:
        run_state_sweep(args.lengths[0], args.batches[0])
    if args.sweep:
        run_sweep(args.lengths[0], profile_dir=args.profile)
    elif args.profile is not None:
        _bench_ours(16, 32, args.lengths[0], 128, "scalar", profile_to=args.profile / "default")


if __name__ == "__main__":
    main()
