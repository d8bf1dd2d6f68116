"""Time the Lizard kernel, sweep its tunings, profile it: `python -m experiments.kernel_check` (repo root).

Runs `linearize.ops.gla_window.testing`'s correctness cases, then median forward and forward+backward
times in ms at B=16, H=32, D=128, L=2K/4K/8K for our kernel and, where installed, fla's chunk_gla and
chunk_simple_gla and PyTorch's causal SDPA; with flags, the block-configuration sweeps, the host-side
profile and the per-kernel timings behind docs/kernels.md.
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

from linearize.ops.gla_window import GlaWindowOptions
from linearize.ops.gla_window.testing import Case, make_inputs, run_checks

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
    from linearize.bench.common import write_profile

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
    from linearize.ops.gla_window.triton import lizard_attention_triton

    case = Case(L=L, gate=gate, dtype=torch.bfloat16, window=128, sinks=4, B=B, H=H, HKV=H, F=D, D=D)
    (fq, fk, log_g, qw, kw, v, sinks, alpha), _ = make_inputs(case, "cuda")
    inputs = [fq, fk, log_g, qw, kw, v, sinks] + ([] if shared else [alpha])  # the shared form has no alpha
    options = GlaWindowOptions(window=128, scale=D**-0.5, sinks=sinks, alpha=alpha, shared=shared)
    return _fwd_and_bwd(lambda: lizard_attention_triton(fq, fk, log_g, qw, kw, v, options, config=config),
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
    from linearize.ops.gla_window.triton import Config

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
    from linearize.ops.gla_window.triton import lizard_attention_triton

    case = Case(L=L, dtype=torch.bfloat16, window=128, sinks=4, B=B, H=H, HKV=H, F=D, D=D)
    (fq, fk, log_g, qw, kw, v, sinks, alpha), _ = make_inputs(case, "cuda")

    def forward(config=None, window=128):
        options = GlaWindowOptions(window=window, scale=D**-0.5, sinks=sinks, alpha=alpha)
        return functools.partial(lizard_attention_triton, fq, fk, log_g, qw, kw, v, options, config=config)

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
    pipelining). `stages=3` needs more shared memory than an H200 has, and 8 warps are ~1.7x slower
    in the H200 sweeps (the fused chunk kernel alone at 8 warps: 2.18 ms against 1.47 at 4). The
    sweeps and what they chose are in docs/kernels.md."""
    from linearize.ops.gla_window.triton import Config

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
    from linearize.ops.gla_window.triton import Config

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
    from linearize.bench.kernels import fla_unavailable, make_fla

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
    from linearize.ops.gla_window.triton import Config

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

    from linearize.ops.gla_window import triton as lizard_triton

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


def features_sweep_rows(walking: int) -> list[tuple[str, dict]]:
    """(label, `run_features_sweep` options): the weights in bf16 (one tensor-core pass) or float32
    (3xTF32, the other form of the product), each with a program per block of 64
    tokens (the default) and with `walking` programs per head, each walking several blocks with the
    weights loaded once (they spill registers holding them: `experiments.kernel_resources`)."""
    return [(f"{dtype} weights, {label}", {"weight_dtype": getattr(torch, dtype), "programs": programs})
            for dtype in ("bfloat16", "float32") for label, programs in
            (("a program a block", None), (f"{walking} programs a head, walking", walking))]


def run_features_sweep(lengths, H=32, HKV=8, D=128, F=64):
    """The features kernel alone at the Llama-3-8B shape, batch 1, bf16 q and k (the projections'):
    median ms of `lizard_features` with RoPE for each of `features_sweep_rows`, at each length."""
    from linearize.ops.features.triton import lizard_features

    sms = torch.cuda.get_device_properties(0).multi_processor_count

    for L in lengths:
        q = torch.randn(1, L, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        k = torch.randn(1, L, HKV, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        angles = torch.randn(1, L, D, device="cuda")
        rope = (angles.cos(), angles.sin())
        print(f"\nfeatures kernel, L={L}, H={H}, H_kv={HKV}, d={D}, f={F}")
        for label, options in features_sweep_rows(-(-8 * sms // H)):  # 8 programs an SM
            w_q, w_k = ((0.05 * torch.randn(H, D, F, device="cuda")).to(options["weight_dtype"]) for _ in range(2))
            run = functools.partial(lizard_features, q, k, w_q, w_k, rope, torch.bfloat16,
                                    programs=options["programs"])
            with torch.no_grad():
                ms = _median_ms(run)
            print(f"  {label:40s} {ms:8.3f} ms")


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
    parser.add_argument("--sweep-features", action="store_true",
                        help="time the features kernel alone at the Llama-3-8B shape (`features_sweep_rows`, --lengths)")
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
    if args.sweep_features:
        run_features_sweep(args.lengths)
    if args.sweep_states:
        run_state_sweep(args.lengths[0], args.batches[0])
    if args.sweep:
        run_sweep(args.lengths[0], profile_dir=args.profile)
    elif args.profile is not None:
        _bench_ours(16, 32, args.lengths[0], 128, "scalar", profile_to=args.profile / "default")


if __name__ == "__main__":
    main()
