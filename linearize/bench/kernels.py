"""`linearize bench kernels`: the Lizard attention op against fla's GLA kernels and causal SDPA.

Shapes are the Lizard paper's Table 3 (H=32, D=128; B=16 at L=2K/4K/8K, B=32 at L=8K), bf16.
"fwd" is an inference forward (no_grad); "fwd+bwd" is a forward then the gradients of every input.
Each op states the FLOPs it is credited with (`Op.formula`); TFLOP/s divide them by the median time, and the
peak they are compared with is a bf16 8192³ matmul measured in the same run.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from matplotlib.figure import Figure  # no pyplot: Figure.savefig renders with Agg, no display needed

from ..figures import save_png
from ..ops import gla_window
from ..ops.gla_window import GlaWindowOptions
from ..ops.gla_window.chunk import gla_window_chunked
from ..ops.gla_window.naive import init_state
from .common import (
    cell,
    default_device,
    failure,
    free_memory,
    new_results,
    number,
    record_row,
    size_label,
    time_ms,
    write_outputs,
)

CHUNK = 64  # fla's default chunk and gla_window_chunked's
WINDOW = 128
SINKS = 4
MODES = ("fwd", "fwd+bwd")
# Issue 6's targets for the fused Lizard op: (pass, fla op, largest time ratio) at every Table 3 shape.
TARGETS = (("fwd", "fla chunk_gla", 0.5), ("fwd+bwd", "fla chunk_gla", 0.5), ("fwd", "fla chunk_simple_gla", 1.3))

FULL = {"shapes": [(16, 32, 2048, 128), (16, 32, 4096, 128), (16, 32, 8192, 128), (32, 32, 8192, 128)],
        "warmup": 3, "iters": 10, "peak_n": 8192}
QUICK = {"shapes": [(1, 2, 128, 32), (1, 2, 256, 32)], "warmup": 1, "iters": 2, "peak_n": 256}


def sdpa_flops(B, H, L, D) -> float:
    return 2.0 * B * H * L * L * D


def gla_flops(B, H, L, D) -> float:
    return float(B * H * L * (4 * CHUNK * D + 4 * D * D))


def lizard_flops(B, H, L, D) -> float:
    return gla_flops(B, H, L, D) + 8.0 * B * H * L * WINDOW * D


SDPA_FORMULA = "fwd 2·B·H·L²·D (QKᵀ and PV over half the square); bwd 2.5× fwd (FlashAttention's count)"
GLA_FORMULA = (f"fwd B·H·L·(4·C·D + 4·D²), C = {CHUNK}: intra-chunk QKᵀ and AV, inter-chunk Q·S and the "
               "state update; bwd 2× fwd")
LIZARD_FORMULA = (f"the chunked-GLA count with F = D features + B·H·L·8·w·D, w = {WINDOW}: window blocks, each "
                  "query scores 2w keys and sums 2w values; bwd 2× fwd")


@dataclass
class Op:
    key: str  # what `--ops` calls it
    name: str
    flops: Callable[..., float]  # forward FLOPs of (B, H, L, D)
    backward_factor: float  # backward FLOPs / forward FLOPs
    formula: str
    make: Callable  # (B, H, L, D, device, dtype) -> (forward(), inputs that get gradients)
    unavailable: Callable[[torch.device], str | None]  # why it cannot run here, or None


def make_sdpa(B, H, L, D, device, dtype):
    q, k, v = (torch.randn(B, H, L, D, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), [q, k, v]


def make_fla(simple: bool):
    def make(B, H, L, D, device, dtype):
        from fla.ops.gla import chunk_gla
        from fla.ops.simple_gla import chunk_simple_gla

        q, k, v = (torch.randn(B, L, H, D, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
        # Log-space gates as fla's GLA layer makes them (logsigmoid / 16): one per head, or one per key feature.
        gate_shape = (B, L, H) if simple else (B, L, H, D)
        g = (F.logsigmoid(torch.randn(gate_shape, device=device)) / 16).to(dtype).requires_grad_()
        op = chunk_simple_gla if simple else chunk_gla
        return lambda: op(q, k, v, g=g, scale=D**-0.5)[0], [q, k, v, g]

    return make


def lizard_inputs(B, H, L, D, device, dtype):
    """Feature-mapped inputs with F = D, a scalar gate, 4 sinks and no GQA; the first six get gradients."""

    def grad_leaf(x):
        return x.to(dtype).requires_grad_()

    fq, fk = (grad_leaf(torch.rand(B, H, L, D, device=device)) for _ in range(2))  # positive, like phi's output
    log_g = grad_leaf(F.logsigmoid(torch.randn(B, H, L, 1, device=device) + 6))  # near the gate's init
    qw, kw, v = (grad_leaf(torch.randn(B, H, L, D, device=device)) for _ in range(3))
    options = GlaWindowOptions(window=WINDOW, scale=D**-0.5, sinks=torch.zeros(H, SINKS, device=device, dtype=dtype),
                               alpha=torch.ones(H, device=device, dtype=dtype))
    return [fq, fk, log_g, qw, kw, v], options


def make_lizard_chunked(B, H, L, D, device, dtype):
    """The PyTorch op as the model calls it: an empty carried state, every token valid."""
    inputs, options = lizard_inputs(B, H, L, D, device, dtype)
    valid = torch.ones(B, L, dtype=torch.bool, device=device)
    state = init_state(B, H, H, D, D, WINDOW, device=device, dtype=dtype)
    return lambda: gla_window_chunked(*inputs, valid, state, options)[0], inputs


class Unsupported(Exception):
    """The op cannot take these inputs: the row is skipped, with this reason."""


def make_lizard_triton(B, H, L, D, device, dtype):
    inputs, options = lizard_inputs(B, H, L, D, device, dtype)
    # chunk_gla_window falls back to the PyTorch op on inputs its kernel does not take: never time that here.
    reason = gla_window.unsupported_reason(*inputs, window=options.window, sinks=options.sinks)
    if reason:
        raise Unsupported(f"the Triton kernel does not take these inputs: {reason}")
    return lambda: gla_window.chunk_gla_window(*inputs, options)[0], inputs


def triton_unavailable(device: torch.device) -> str | None:
    if device.type != "cuda":
        return "the Triton kernel needs a CUDA device"
    from ..ops import backend

    if backend.get_backend() == "torch":
        return "the backend is torch"
    return None if backend.kernels_available() else "triton is not installed"


def fla_unavailable(device: torch.device) -> str | None:
    if device.type != "cuda":
        return "fla needs a CUDA device"
    try:
        import fla.ops.gla  # noqa: F401
    except ImportError as e:
        return f"fla not importable ({e})"
    return None


OPS = [
    Op("triton", "lizard (triton)", lizard_flops, 2.0, LIZARD_FORMULA, make_lizard_triton, triton_unavailable),
    Op("chunked", "lizard (pytorch chunked)", lizard_flops, 2.0, LIZARD_FORMULA, make_lizard_chunked, lambda device: None),
    Op("chunk_gla", "fla chunk_gla", gla_flops, 2.0, GLA_FORMULA, make_fla(simple=False), fla_unavailable),
    Op("chunk_simple_gla", "fla chunk_simple_gla", gla_flops, 2.0, GLA_FORMULA, make_fla(simple=True), fla_unavailable),
    Op("sdpa", "sdpa causal", sdpa_flops, 2.5, SDPA_FORMULA, make_sdpa, lambda device: None),
]


def measure(op: Op, shape, mode: str, device, dtype, warmup: int, iters: int) -> float:
    forward, inputs = op.make(*shape, device, dtype)
    if mode == "fwd":
        def step():
            with torch.no_grad():
                forward()
    else:
        with torch.no_grad():
            grad = torch.randn_like(forward())

        def step():
            torch.autograd.grad(forward(), inputs, grad)
    return time_ms(step, device, warmup=warmup, iters=iters)


def measure_peak(n: int, device, dtype, warmup: int, iters: int) -> dict:
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    ms = time_ms(lambda: a @ b, device, warmup=warmup, iters=iters)
    return {"n": n, "ms": ms, "tflops": 2.0 * n**3 / ms / 1e9}


def select_ops(keys: list[str] | None) -> list[Op]:
    """The ops `--ops` names (all by default), in the table's order."""
    known = [op.key for op in OPS]
    unknown = sorted(set(keys or []) - set(known))
    if unknown:
        raise ValueError(f"unknown op(s) {', '.join(unknown)}: choose from {', '.join(known)}")
    return [op for op in OPS if keys is None or op.key in keys]


def lizard_config() -> str | None:
    """The Triton kernel's default block configuration for these bf16 inputs, as the run used it."""
    try:
        from ..ops.gla_window.triton import Config
    except ImportError:
        return None
    return repr(Config.default(torch.bfloat16))


def bench(out: Path, *, quick: bool = False, ops: list[str] | None = None) -> list[Path]:
    chosen = select_ops(ops)
    settings = dict(QUICK if quick else FULL, dtype="bfloat16", chunk=CHUNK, window=WINDOW, sinks=SINKS, quick=quick)
    if any(op.key == "triton" for op in chosen):
        settings["lizard_config"] = lizard_config()
    if ops is not None:
        settings["ops"] = [op.key for op in chosen]
    device, dtype = default_device(), torch.bfloat16
    results = new_results("kernels", "Attention kernels", device, settings)
    warmup, iters = settings["warmup"], settings["iters"]
    peak = results["peak"] = measure_peak(settings["peak_n"], device, dtype, warmup, iters)
    results["flop_formulas"] = {op.name: op.formula for op in chosen}
    results["rows"] = []
    for shape in settings["shapes"]:
        for op in chosen:
            reason = op.unavailable(device)
            for mode in MODES:
                B, H, L, D = shape
                flops = op.flops(*shape) * (1.0 if mode == "fwd" else 1.0 + op.backward_factor)
                row = {"op": op.name, "mode": mode, "B": B, "H": H, "L": L, "D": D, "flops": flops}
                if reason:
                    row.update(status="skipped", reason=reason)
                else:
                    started = time.perf_counter()
                    try:
                        ms = measure(op, shape, mode, device, dtype, warmup, iters)
                        tflops = flops / ms / 1e9
                        row.update(status="ok", ms=ms, tflops=tflops, peak_share=tflops / peak["tflops"])
                    except Unsupported as e:
                        row.update(status="skipped", reason=str(e))
                    except Exception as e:  # noqa: BLE001 (OOM or a broken op: record it, measure the rest)
                        row.update(failure(e))
                    row["wall_s"] = time.perf_counter() - started
                free_memory()
                record_row(results, "rows", row, out)
    return write_outputs(results, out, tables, plots)


def tables(results: dict) -> list[str]:
    rows = results["rows"]
    shapes = list(dict.fromkeys((r["B"], r["L"]) for r in rows))
    H, D = rows[0]["H"], rows[0]["D"]
    peak = results["peak"]
    settings = results["settings"]
    lines = [
        (f"H={H}, D={D}, {settings['dtype']} inputs for every op (the model runs the PyTorch op in float32); median "
         f"of {settings['iters']} runs after {settings['warmup']} warm-up runs. Cells: ms · TFLOP/s · share of the "
         f"measured peak ({number(peak['tflops'])} TFLOP/s, a bf16 {peak['n']}³ matmul)."),
        "",
        "| op | pass | " + " | ".join(f"B={B} L={size_label(L)}" for B, L in shapes) + " |",
        "|---|---|" + "---|" * len(shapes),
    ]
    index = {(r["op"], r["mode"], r["B"], r["L"]): r for r in rows}
    for name in dict.fromkeys(r["op"] for r in rows):
        for mode in MODES:
            cells = [cell(index.get((name, mode, B, L)),
                          lambda r: f"{number(r['ms'])} · {number(r['tflops'])} · {100 * r['peak_share']:.0f}%")
                     for B, L in shapes]
            lines.append(f"| {name} | {mode} | " + " | ".join(cells) + " |")
    lines.append("")
    lines += target_lines(rows, rows)
    if settings.get("lizard_config") and any(r["op"] == "lizard (triton)" and r["status"] == "ok" for r in rows):
        lines.append(f"- lizard (triton) ran `{settings['lizard_config']}`")
    skipped = {r["op"]: r["reason"] for r in rows if r["status"] in ("skipped", "error")}
    lines += [f"- {name}: {reason}" for name, reason in skipped.items()]
    by_formula = {}
    for name, formula in results["flop_formulas"].items():
        by_formula.setdefault(formula, []).append(name)
    lines += [f"- FLOPs of {', '.join(names)}: {formula}" for formula, names in by_formula.items()]
    return lines + [""]


def target_lines(ours: list[dict], fla: list[dict]) -> list[str]:
    """The targets (`TARGETS`) as ratios of the Triton op's median ms in `ours` to fla's in `fla` (rows
    of one run, or of two: then the ratios compare across runs), at every shape both measured."""
    ms = {(r["op"], r["mode"], r["B"], r["L"]): r["ms"] for r in fla + ours if r["status"] == "ok"}  # ours last: they win
    shapes = list(dict.fromkeys((r["B"], r["L"]) for r in ours))
    lines = []
    for mode, other, target in TARGETS:
        ratios = {(B, L): ms[("lizard (triton)", mode, B, L)] / ms[(other, mode, B, L)] for B, L in shapes
                  if ("lizard (triton)", mode, B, L) in ms and (other, mode, B, L) in ms}
        if ratios:
            cells = ", ".join(f"B={B} L={size_label(L)} {ratio:.2f}x" for (B, L), ratio in ratios.items())
            verdict = "met" if max(ratios.values()) <= target else "missed"
            lines.append(f"- lizard (triton) {mode} / {other}: {cells} (target at most {target}x: {verdict})")
    return lines + ([""] if lines else [])


def plots(results: dict, out: Path) -> list[Path]:
    """Median ms vs L per op and batch size, one panel per pass."""
    fig = Figure(figsize=(11, 4.5), layout="constrained")
    for panel, mode in enumerate(MODES):
        ax = fig.add_subplot(1, 2, panel + 1)
        ok = [r for r in results["rows"] if r["mode"] == mode and r["status"] == "ok"]
        for op, B in dict.fromkeys((r["op"], r["B"]) for r in ok):
            points = sorted((r["L"], r["ms"]) for r in ok if r["op"] == op and r["B"] == B)
            ax.plot(*zip(*points), marker="o", label=f"{op}, B={B}")
        lengths = sorted({r["L"] for r in results["rows"]})
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(lengths, [size_label(L) for L in lengths])
        ax.set(xlabel="sequence length L", ylabel="median ms", title=mode)
        ax.grid(alpha=0.3)
        if ok:
            ax.legend(fontsize=7)
    fig.suptitle(results["title"])
    path = out / "kernels.png"
    save_png(fig, path, dpi=120)
    return [path]


def main(argv: list[str] | None = None) -> None:
    """`python -m linearize.bench.kernels OURS.json [FLA.json]`: the targets' ratios of a kernels run,
    fla's times from FLA.json where given (ratios across two runs)."""
    import argparse
    import json

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("ours", type=Path, help="a kernels.json with the lizard (triton) rows")
    parser.add_argument("fla", type=Path, nargs="?", help="a kernels.json with fla's rows (default: OURS)")
    args = parser.parse_args(argv)
    ours = json.loads(args.ours.read_text())["rows"]
    fla = json.loads(args.fla.read_text())["rows"] if args.fla else ours
    lines = [line for line in target_lines(ours, fla) if line]
    print("\n".join(lines or ["no shape has both the Triton op's and fla's times"]))


if __name__ == "__main__":
    main()
