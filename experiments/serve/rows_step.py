"""Where a batched decode step of softmax rows goes: `BatchedKVCache.step` (the serving engine's kv and
hybrid modes) timed at several row counts on one prompt length, and profiled at the largest.

    PYTHONPATH=. python -m experiments.serve.rows_step [--shape llama3-8b] [--softmax-layers 16 | --teacher]
        [--rows 1,16] [--context 4k] [--steps 20] [--out DIR]

`bench serve` at the 8B shape found a step of 16 rows of 4K-token requests 2.8x a single row's, for the
50% Lizard hybrid and for the softmax teacher alike, where both read the same weights a step: this splits
the step into its ops. Every row holds a copy of one prefilled prompt of `--context` tokens (random
tokens, random weights of the shape, bf16 on a GPU, float32 on a CPU), so the step's attention reads
rows x context keys per softmax layer. Writes DIR/steps.md (ms a step by row count) and, with a GPU,
DIR/profile-rows-N.txt (torch.profiler's top ops of a few steps at the largest row count).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from linearize.bench.common import parse_sizes
from linearize.bench.model import SOFTMAX, build
from linearize.bench.shapes import SHAPES
from linearize.serve.kv_slots import BatchedKVCache

WARMUP_STEPS = 3
PROFILED_STEPS = 5


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m experiments.serve.rows_step", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    which = p.add_mutually_exclusive_group()
    which.add_argument("--softmax-layers", type=int, default=None, metavar="N",
                       help="a Lizard hybrid keeping N layers softmax, evenly spaced (default: half of them)")
    which.add_argument("--teacher", action="store_true", help="the softmax model itself")
    p.add_argument("--rows", default="1,16", help="row counts to time, e.g. 1,4,16")
    p.add_argument("--context", default="4k", help="tokens each row holds")
    p.add_argument("--steps", type=int, default=20, help="timed steps a row count")
    p.add_argument("--out", type=Path, default=None, help="folder for steps.md and the profile")
    return p.parse_args(argv)


def model_for(shape: str, teacher: bool, softmax_layers: int | None, device, dtype, **overrides):
    """The random model of `shape` (config `overrides` too, e.g. fewer layers), as `bench serve` builds it:
    the teacher, or a Lizard hybrid keeping `softmax_layers` (default half) of its layers softmax, evenly
    spaced, with the options the serving bench uses."""
    layers = overrides.get("num_hidden_layers", SHAPES[shape].config["num_hidden_layers"])
    settings = {"model": None, "shape": shape, "shape_overrides": overrides, "layers": None,
                "options": {"combine": "shared", "rope_in_window": True},
                "softmax_layers": layers // 2 if softmax_layers is None else softmax_layers}
    return build(settings, SOFTMAX if teacher else "lizard", device, dtype)


@torch.no_grad()
def filled_rows(model, rows: int, context: int, steps: int, device) -> BatchedKVCache:
    """A BatchedKVCache whose `rows` rows each hold one random prompt's prefill of `context` tokens."""
    from transformers import DynamicCache

    ids = torch.randint(3, model.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache(config=model.config)
    model(input_ids=ids.to(device), past_key_values=cache, use_cache=True, logits_to_keep=1)
    kv = BatchedKVCache(model)
    kv.set_limits(rows, context + WARMUP_STEPS + steps + PROFILED_STEPS + 1)
    for row in range(rows):
        kv.load_row(row, cache, context)
    return kv


def timed_steps(model, kv: BatchedKVCache, rows: int, steps: int, device) -> float:
    """Milliseconds a step of `rows` rows, the median of `steps` after WARMUP_STEPS."""
    tokens = torch.full((rows, 1), 5, device=device)
    times = []
    for i in range(WARMUP_STEPS + steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        kv.step(model, tokens)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= WARMUP_STEPS:
            times.append(1000 * (time.perf_counter() - started))
    return sorted(times)[len(times) // 2]


def profile(model, kv: BatchedKVCache, rows: int, device) -> str:
    """torch.profiler's top ops (by device time on a GPU) over PROFILED_STEPS steps of `rows` rows."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    tokens = torch.full((rows, 1), 5, device=device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        for _ in range(PROFILED_STEPS):
            kv.step(model, tokens)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=30)


def run(model, rows_list: list[int], context: int, steps: int, out: Path | None) -> list[tuple[int, float]]:
    device = next(model.parameters()).device
    results = []
    for rows in rows_list:
        kv = filled_rows(model, rows, context, steps, device)
        results.append((rows, timed_steps(model, kv, rows, steps, device)))
        if out is not None and rows == max(rows_list):
            (out / f"profile-rows-{rows}.txt").write_text(profile(model, kv, rows, device))
        kv.free()
    return results


def table(results: list[tuple[int, float]], about: str) -> str:
    single = dict(results).get(1)
    lines = [f"# A batched decode step by row count\n\n{about}\n", "| rows | ms a step | tokens/s | x one row's step |",
             "|---|---|---|---|"]
    for rows, ms in results:
        ratio = f"{ms / single:.2f}" if single else "–"
        lines.append(f"| {rows} | {ms:.2f} | {1000 * rows / ms:,.0f} | {ratio} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    rows_list = sorted({int(r) for r in args.rows.split(",")})
    (context,) = parse_sizes(args.context)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = model_for(args.shape, args.teacher, args.softmax_layers, device, dtype)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    results = run(model, rows_list, context, args.steps, args.out)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    kind = "the softmax teacher" if args.teacher else "a Lizard hybrid"
    text = table(results, f"{args.shape} shape, random weights, {kind}, {context} tokens a row, {dtype} on {where}; "
                          f"command: `python -m experiments.serve.rows_step {' '.join(argv or sys.argv[1:])}`.")
    print(text)
    if args.out is not None:
        (args.out / "steps.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
