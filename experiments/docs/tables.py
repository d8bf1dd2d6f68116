"""Tables of figures for the docs where no `linearize` command prints one, each from files under docs/results/.

    python -m experiments.docs.tables fsdp docs/results/h200/fsdp/fsdp.json
    python -m experiments.docs.tables train-ratios 'LABEL=DIR' ...
    python -m experiments.docs.tables train-shapes 'LABEL=DIR' ...
    python -m experiments.docs.tables kernel-targets DIR ...
    python -m experiments.docs.tables serve-pacing DIR ...
    python -m experiments.docs.tables default-mix docs/results/cpu/default-mix/stats.json
    python -m experiments.docs.tables needle-mass 'LABEL=DIR' ...
    python -m experiments.docs.tables prefill DIR ...
    python -m experiments.docs.tables speed --train DIR --kernels DIR --decode DIR --prefill DIR --memory DIR
    python -m experiments.docs.tables eval-times DIR
    python -m experiments.docs.tables decode-memory --contexts 1k,128k 'LABEL=DIR[#MODEL]' ...
    python -m experiments.docs.tables stage1-ablations docs/results/cpu/stage1-ablations/seq256.json

Each prints a Markdown table whose every figure is read or computed from the named files, with the GPU
it ran on; the pages hold them between `<!-- generated: COMMAND -->` markers (experiments.docs.generated).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

# The decode target's reference: the teacher's best decode rate at 32K at the 8B shape (docs/benchmarks.md).
TEACHER_BEST_DECODE = 70


def _load(path: Path, name: str) -> dict:
    """`name`.json in a directory, or the file itself."""
    return json.loads((path / f"{name}.json" if path.is_dir() else path).read_text(encoding="utf-8"))


def gpu(device: str) -> str:
    """"NVIDIA H200" or "cuda:0 (NVIDIA H100 80GB HBM3)" -> "H200", "H100 80GB HBM3"."""
    inner = re.fullmatch(r"cuda(?::\d+)? \((.*)\)", device)
    return (inner[1] if inner else device).removeprefix("NVIDIA ")


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows]) + "\n"


def _link(path: Path, name: str) -> str:
    """A link to a run's Markdown from a page under docs/ (README links through docs/)."""
    folder = path if path.is_dir() else path.parent
    return f"[run]({folder.relative_to('docs').as_posix()}/{name}.md)" if (folder / f"{name}.md").exists() else ""


def fsdp(path: Path) -> str:
    """experiments/gpu/fsdp_check.py's record: each stage's loss agreement and rates on 1 and 2 GPUs."""
    record = _load(path, "fsdp")
    rows = []
    for stage, r in record["stages"].items():
        kind = "replicas + one all-reduce" if stage == "1" else "FSDP2"
        rows.append([f"{stage} ({kind})", f"{r['max_relative_loss_difference']:.1e}", f"{r['tokens_per_s_1gpu']:,.0f}",
                     f"{r['tokens_per_s_2gpu']:,.0f}", f"{r['speedup']:.2f}x"])
        if "tokens_per_s_no_reshard" in r:
            rows.append([f"{stage} (FSDP2, `--no-fsdp-reshard`)", "–", f"{r['tokens_per_s_1gpu']:,.0f}",
                         f"{r['tokens_per_s_no_reshard']:,.0f}", f"{r['speedup_no_reshard']:.2f}x"])
    header = ["stage", f"largest relative loss difference, {record['steps']} steps", "1 GPU tokens/s",
              f"{record['gpus']} GPUs tokens/s", "speed-up"]
    return _table(header, rows)


def _train_rates(results: dict) -> dict[str, float]:
    return {r["mode"].split(" (")[0]: r["tokens_per_s"] for r in results["rows"] if r.get("tokens_per_s")}


def train_ratios(runs: list[tuple[str, Path]]) -> str:
    """Each `bench train` run's stage 1 and stage 2 against its teacher's full fine-tune."""
    rows = []
    for label, path in runs:
        results = _load(path, "train")
        rate = _train_rates(results)
        options = " ".join(f"`--set {k}={v}`" for k, v in results["settings"].get("options", {}).items())
        if results["settings"].get("method", "lizard") != "lizard":
            options = " ".join(filter(None, [f"`--method {results['settings']['method']}`", options]))
        rows.append([label, gpu(results["environment"]["device"]), f"{rate['full fine-tune']:,.0f}",
                     f"{rate['stage 1']:,.0f} ({rate['stage 1'] / rate['full fine-tune']:.2f}x)",
                     f"{rate['stage 2']:,.0f} ({rate['stage 2'] / rate['full fine-tune']:.2f}x)", options, _link(path, "train")])
    header = ["student", "GPU", "full fine-tune tokens/s", "stage 1 tokens/s (x the full fine-tune)",
              "stage 2 tokens/s (x)", "options", ""]
    return _table(header, rows)


def train_shapes(runs: list[tuple[str, Path]]) -> str:
    """`bench train --shape` runs: at each length, the teacher's LoRA fine-tune, stages 1 and 2 against it, the
    peaks and the papers' recipe (`settings.recipe_tokens` a stage) in GPU-hours, checkpointing as each ran."""
    rows = []
    for label, path in runs:
        results = _load(path, "train")
        tokens = results["settings"]["recipe_tokens"]
        by = {(r["key"], r["seq_len"]): r for r in results["rows"] if r["status"] == "ok"}
        for length in results["settings"]["seq_lens"]:
            lora, one, two = (by[(key, length)] for key in ("lora", "stage1", "stage2"))
            hours = (tokens / one["tokens_per_s"] + tokens / two["tokens_per_s"]) / 3600
            peaks = " / ".join(f"{r['peak_bytes'] / 2**30:.1f}" for r in (lora, one, two))
            rows.append([label, gpu(results["environment"]["device"]), f"{length // 1024}K",
                         f"{lora['tokens_per_s']:,.0f}",
                         f"{one['tokens_per_s']:,.0f} ({one['tokens_per_s'] / lora['tokens_per_s']:.2f}x)",
                         f"{two['tokens_per_s']:,.0f} ({two['tokens_per_s'] / lora['tokens_per_s']:.2f}x)",
                         peaks, f"{hours:.1f}", _link(path, "train")])
    header = ["shape", "GPU", "length", "LoRA fine-tune", "stage 1 (attention transfer)", "stage 2 (LoRA)",
              "peak GiB (LoRA / stage 1 / stage 2)", "the recipe, GPU-hours", ""]
    return _table(header, rows)


def _points(results: dict, model: str, **where) -> list[dict]:
    return [p for p in results["points"] if p["model"] == model and p["status"] == "ok"
            and all(p.get(k) == v for k, v in where.items())]


def _prefill(results: dict, context: int) -> dict[str, float]:
    """Model name -> batch-1 prefill seconds at `context` (the linear method, softmax, the GEMM floor)."""
    return {p["model"]: p["prefill_ms"] / 1000 for p in results["points"] if p.get("context") == context
            and p.get("batch") == 1 and p.get("prefill_ms") is not None and p["status"] == "ok"}


def prefill(paths: list[Path], context: int = 131072) -> str:
    """Batch-1 prefill at `context` of each `bench model` run: the method, SDPA, the GEMM floor, the ratios."""
    rows = []
    for path in paths:
        results = _load(path, "model")
        seconds = _prefill(results, context)
        method = next(m for m in seconds if m not in ("softmax (sdpa)", "GEMM floor"))
        ours, sdpa, floor = seconds[method], seconds.get("softmax (sdpa)"), seconds.get("GEMM floor")
        rows.append([gpu(results["environment"]["device"]), method, f"{ours:.2f} s",
                     f"{sdpa:.2f} s" if sdpa else "–", f"{sdpa / ours:.2f}x" if sdpa else "–",
                     f"{floor:.2f} s" if floor else "–", f"{ours / floor:.2f}x" if floor else "–",
                     results["started_at"][:10], _link(path, "model")])
    header = ["GPU", "method", "prefill", "SDPA", "faster than SDPA", "GEMM floor", "x the floor", "run on", ""]
    return _table(header, rows)


_PASSES = {"fwd": "forward", "fwd+bwd": "forward+backward"}


def _kernel_ratios(results: dict, mode: str, other: str) -> list[float]:
    """The Triton op's median ms over `other`'s at every shape both measured in one `bench kernels` run."""
    ms = {(r["op"], r["mode"], r["B"], r["L"]): r["ms"] for r in results["rows"] if r["status"] == "ok"}
    shapes = dict.fromkeys((r["B"], r["L"]) for r in results["rows"])
    return [ms[("lizard (triton)", mode, *s)] / ms[(other, mode, *s)] for s in shapes
            if ("lizard (triton)", mode, *s) in ms and (other, mode, *s) in ms]


def kernel_targets(paths: list[Path]) -> str:
    """The kernel targets (`linearize.bench.kernels.TARGETS`) in each `bench kernels` run that timed both ops,
    and each fla pass a run could not time, with fla's reason."""
    from linearize.bench.kernels import TARGETS

    runs = [(path, _load(path, "kernels")) for path in paths]
    rows = []
    for mode, other, limit in TARGETS:
        found = [(path, results, _kernel_ratios(results, mode, other)) for path, results in runs]
        found = [(path, results, ratios) for path, results, ratios in found if ratios]
        measured = "; ".join(f"{min(r):.2f}-{max(r):.2f}x" + (f" ({_link(path, 'kernels')})" if _link(path, "kernels") else "")
                             for path, _, r in found)
        verdict = "**met**" if found and all(max(r) <= limit for _, _, r in found) else "missed"
        gpus = ", ".join(dict.fromkeys(gpu(results["environment"]["device"]) for _, results, _ in found))
        rows.append([f"{_PASSES[mode]} at most {limit}x fla's `{other.removeprefix('fla ')}`", gpus or "–",
                     measured or "not measured", verdict if found else "–"])
    targeted = {(mode, other) for mode, other, _ in TARGETS}
    for path, results in runs:
        for r in results["rows"]:
            if r["status"] == "error" and r["op"].startswith("fla ") and (r["mode"], r["op"]) not in targeted:
                targeted.add((r["mode"], r["op"]))
                rows.append([f"{_PASSES[r['mode']]} against `{r['op'].removeprefix('fla ')}`",
                             gpu(results["environment"]["device"]),
                             f"not measurable: {r['reason'].split('. ')[0]} ({_link(path, 'kernels')})", "–"])
    return _table(["target", "GPU", "measured (the Triton op's time over fla's, over the run's shapes)", ""], rows)


def serve_pacing(paths: list[Path]) -> str:
    """`bench serve` runs that differ in `--prefill-budget`: each model's rates, latencies and prefill calls."""
    from linearize.bench.common import number

    rows = []
    for path in paths:
        results = _load(path, "serve")
        budget = f"{results['settings']['prefill_budget']:g}"
        for p in results["points"]:
            if p["status"] != "ok":
                continue
            rows.append([budget, p["model"], gpu(results["environment"]["device"]), number(p["output_tokens_per_s"]),
                         f"{number(p['ttft_p50_ms'])} / {number(p['ttft_p99_ms'])}",
                         f"{number(p['itl_p50_ms'])} / {number(p['itl_p99_ms'])}",
                         f"{p['itl_p99_ms'] / p['itl_p50_ms']:.1f}x",
                         f"{p['prefill_calls']} ({number(p['prefilled_tokens'] / p['prefill_calls'])})", _link(path, "serve")])
    header = ["`--prefill-budget`", "model", "device", "output tokens/s", "TTFT p50 / p99 ms", "ITL p50 / p99 ms",
              "ITL p99 / p50", "prefill calls (tokens each)", ""]
    return _table(header, rows)


def default_mix(path: Path, seq_len: int = 1024) -> str:
    """`python -m linearize.data.default_mix --stats --json` counts: each source, the total, and its blocks."""
    import math

    record = _load(path, "stats")
    rows = [[r["source"], *(f"{r[k]:,}" for k in ("documents", "characters", "tokens"))] for r in record["sources"]]
    total = record["sources"][-1]["tokens"]
    blocks = total // seq_len
    held_out = min(64, math.ceil(0.02 * blocks))  # build_token_blocks' defaults: val_size 2%, max_val_blocks 64
    return (_table(["source", "documents", "characters", "tokens"], rows)
            + f"\nAbout {total / 1e6:.1f}M tokens (with {record['tokenizer']}'s tokenizer, one `{record['eos']}` a document): "
            f"{blocks:,} blocks of {seq_len:,} tokens, of which {held_out} are held out for validation by default.\n")


def needle_mass(runs: list[tuple[str, Path]]) -> str:
    """`needle_mass` records (experiments/scripts/still_routing.py's mass.json): at the last prompt token, the
    key's share of the best head's normaliser and the linear terms' mean share, at each length; "–" where a
    model has no linear terms."""
    rows, lengths = [], None
    for label, path in runs:
        record = _load(path, "mass")
        lengths = lengths or record["lengths"]
        by_length = [record["results"][str(length)] for length in lengths]
        linear = [r["linear"]["best"] for r in by_length]
        rows.append([label, *(f"{r['needle']['best']:.2f}" for r in by_length),
                     *(f"{v:.2f}" if any(linear) else "–" for v in linear)])
    labels = [f"{length // 1024}K" if length >= 1024 else str(length) for length in lengths or []]
    return _table(["model", *(f"key {x}" for x in labels), *(f"linear {x}" for x in labels)], rows)


def speed(train: Path, kernels: Path, decode: Path, prefill_run: Path, memory: Path) -> str:
    """The README's speed figures, each from the run named."""
    from linearize.bench.kernels import TARGETS

    rows = []
    t = _load(train, "train")
    rate = _train_rates(t)
    rows.append(["distillation, SmolLM2, batch 8 x 2048, CUDA graph (Lizard recipe)", gpu(t["environment"]["device"]),
                 (f"stage 1 {rate['stage 1']:,.0f} tokens/s ({rate['stage 1'] / rate['full fine-tune']:.2f}x the teacher's "
                 f"full fine-tune, {rate['full fine-tune']:,.0f}); stage 2 {rate['stage 2']:,.0f} "
                 f"({rate['stage 2'] / rate['full fine-tune']:.2f}x)")])
    k = _load(kernels, "kernels")
    ms = {(r["op"], r["mode"], r["B"], r["L"]): r["ms"] for r in k["rows"] if r["status"] == "ok"}
    shapes = list(dict.fromkeys((r["B"], r["L"]) for r in k["rows"]))
    parts = []
    for mode, other, _target in TARGETS:
        ratios = [ms[("lizard (triton)", mode, *s)] / ms[(other, mode, *s)] for s in shapes
                  if ("lizard (triton)", mode, *s) in ms and (other, mode, *s) in ms]
        if ratios:
            parts.append(f"{mode} {min(ratios):.2f}-{max(ratios):.2f}x {other}")
    rows.append(["Lizard attention kernel at the Lizard paper's Table 3 shapes", gpu(k["environment"]["device"]),
                 "; ".join(parts)])
    d = _load(decode, "model")
    method = d["settings"]["methods"][0]
    one = [p["decode_ms"] for p in _points(d, method, batch=1)]
    rows.append([f"decode, {d['settings']['shape']} shape, batch 1, compiled step", gpu(d["environment"]["device"]),
                 f"{min(one):.2f}-{max(one):.2f} ms a token"])
    wide = max(_points(d, method, sweep="batch"), key=lambda p: p["batch"])
    rows.append([f"decode, {d['settings']['shape']} shape, batch {wide['batch']}, {wide['context'] // 1024}K context",
                 gpu(d["environment"]["device"]),
                 (f"{wide['decode_tokens_per_s']:,.0f} tokens/s ({wide['decode_tokens_per_s'] / TEACHER_BEST_DECODE:.0f}x "
                 f"the teacher's best, {TEACHER_BEST_DECODE})")])
    p = _load(prefill_run, "model")
    seconds = _prefill(p, 131072)
    method = next(m for m in seconds if m not in ("softmax (sdpa)", "GEMM floor"))
    rows.append([f"prefill of 128K tokens, {p['settings']['shape']} shape, batch 1", gpu(p["environment"]["device"]),
                 (f"{seconds[method]:.2f} s against SDPA's {seconds['softmax (sdpa)']:.2f} s "
                 f"({seconds['softmax (sdpa)'] / seconds[method]:.2f}x)")])
    m = _load(memory, "model")
    method = m["settings"]["methods"][0]
    by_context = sorted(_points(m, method, sweep="context", batch=1), key=lambda p: p["context"])
    low, high = by_context[0], by_context[-1]
    rows.append([(f"decode memory, {m['settings']['shape']} shape, {low['context'] // 1024}K to "
                 f"{high['context'] // 1048576}M context"), gpu(m["environment"]["device"]),
                 (f"{low['decode_peak_bytes'] / 1e6:,.0f} MB to {high['decode_peak_bytes'] / 1e6:,.0f} MB "
                 f"({100 * (high['decode_peak_bytes'] / low['decode_peak_bytes'] - 1):+.2f}%)")])
    return _table(["what", "GPU", "measured"], rows)


def _context(text: str) -> int:
    """"1k" -> 1024, "1m" -> 1048576, "512" -> 512."""
    scale = {"k": 1024, "m": 1048576}.get(text[-1:].lower(), 1)
    return int(text[:-1] if scale > 1 else text) * scale


def decode_memory(runs: list[tuple[str, Path]], contexts: list[int]) -> str:
    """Peak memory while decoding at batch 1 after a prompt of each context, from `bench model` runs; a run is
    DIR (its linear method) or DIR#MODEL (e.g. `#softmax (sdpa)`, the teacher measured in the same run)."""
    rows = []
    for label, path in runs:
        folder, _, model = str(path).partition("#")
        results = _load(Path(folder), "model")
        model = model or results["settings"]["methods"][0]
        peak = {p["context"]: p["decode_peak_bytes"] for p in _points(results, model, sweep="context", batch=1)}
        missing = [c for c in contexts if c not in peak]
        if missing:
            raise ValueError(f"{path}: {model} has no decode at batch 1 at context {missing[0]}")
        gib = [peak[c] / 2**30 for c in contexts]
        rows.append([label, gpu(results["environment"]["device"]), *(f"{g:.3g} GiB" for g in gib),
                     f"{100 * (gib[-1] / gib[0] - 1):+.2g}%"])
    labels = [f"{c // 1024}K" for c in contexts]
    return _table(["", "GPU", *labels, f"{labels[0]} to {labels[-1]}"], rows)


ZEROSHOT = ("piqa", "arc_easy", "arc_challenge", "hellaswag", "winogrande")


def eval_times(path: Path) -> str:
    """An eval.json's seconds per task, the five zero-shot tasks together first."""
    results = _load(path, "eval")
    tasks = results["tasks"]
    device = gpu(results["provenance"].get("device", "–"))
    rows = [["the five zero-shot tasks", device, f"{sum(tasks[t]['wall_time_s'] for t in ZEROSHOT):.0f} s"]]
    rows += [[f"`{name}`", device, f"{r['wall_time_s']:.1f} s"] for name, r in tasks.items() if name not in ZEROSHOT]
    return _table(["tasks", "GPU", "seconds"], rows)


def stage1_ablations(path: Path) -> str:
    """experiments/scripts/stage1_ablations.py's record (`--json`): each variant's validation MSE at the start
    of stage 1 and after its steps, on the CPU."""
    record = json.loads(path.read_text(encoding="utf-8"))
    rows = [[name, f"{r['val_mse'][0]:.3f}", f"{r['val_mse'][-1]:.3f}"] for name, r in record["variants"].items()]
    return _table(["variant (CPU)", "val MSE at start", f"after {record['steps']} steps"], rows)


def _labelled(text: str) -> tuple[str, Path]:
    label, _, path = text.rpartition("=")
    if not label:
        raise argparse.ArgumentTypeError(f"{text!r}: expected LABEL=DIR")
    return label, Path(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.docs.tables", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="table", required=True)

    def table(name: str, make, *arguments: tuple[str, dict]) -> None:
        """A subcommand `name` whose arguments, parsed, give the table as `make(args)`."""
        command = sub.add_parser(name)
        for flag, options in arguments:
            command.add_argument(flag, **options)
        command.set_defaults(make=make)

    one_path = ("path", {"type": Path})
    paths = ("runs", {"nargs": "+", "type": Path})
    labelled = ("runs", {"nargs": "+", "type": _labelled, "metavar": "LABEL=DIR"})
    table("fsdp", lambda a: fsdp(a.path), one_path)
    table("train-ratios", lambda a: train_ratios(a.runs), labelled)
    table("train-shapes", lambda a: train_shapes(a.runs), labelled)
    table("kernel-targets", lambda a: kernel_targets(a.runs), paths)
    table("serve-pacing", lambda a: serve_pacing(a.runs), paths)
    table("default-mix", lambda a: default_mix(a.path), one_path)
    table("needle-mass", lambda a: needle_mass(a.runs), labelled)
    table("prefill", lambda a: prefill(a.runs), paths)
    table("speed", lambda a: speed(a.train, a.kernels, a.decode, a.prefill, a.memory),
          *[(f"--{name}", {"type": Path, "required": True}) for name in ("train", "kernels", "decode", "prefill",
                                                                        "memory")])
    table("eval-times", lambda a: eval_times(a.path), one_path)
    table("decode-memory", lambda a: decode_memory(a.runs, a.contexts),
          ("--contexts", {"type": lambda t: [_context(c) for c in t.split(",")], "required": True}),
          ("runs", {"nargs": "+", "type": _labelled, "metavar": "LABEL=DIR[#MODEL]"}))
    table("stage1-ablations", lambda a: stage1_ablations(a.path), one_path)
    args = parser.parse_args(argv)
    text = args.make(args)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
