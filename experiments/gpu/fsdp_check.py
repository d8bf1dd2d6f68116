"""One GPU vs N GPUs at the same global batch: same loss curve, tokens/s ratio.

    python experiments/gpu/fsdp_check.py --gpus 2 --out $OUT/fsdp [--model smollm2] [--steps 40] [--cases fsdp,graphed]
    python experiments/gpu/fsdp_check.py --from-log fsdp.log --batch 16   # per-step rates of a captured log

Runs `linearize distill` under torchrun on identical settings (stage 1 then stage 2), once per case
below on N processes and once per baseline on one, and compares each case with its baseline: the
eager cases with the eager one-GPU run, the CUDA-graph case with the graphed one-GPU run (the fast
single-GPU path that N GPUs have to beat). Stage 1 always trains whole replicas; the cases differ in
stage 2. Writes fsdp.json (per case and stage: both runs' losses, their largest relative difference,
median tokens/s and the speed-up) and fsdp.png. Resuming a multi-rank run, on as many ranks or fewer,
is tested on CPU (tests/train/test_multirank.py).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
from pathlib import Path


def distill(nproc: int, out: Path, args, extra=()) -> None:
    tokens = args.steps * args.batch * args.seq_len
    cmd = ["torchrun", f"--nproc-per-node={nproc}", "-m", "linearize.cli", "distill", "--model", args.model,
           "--data", args.data, "--method", args.method, "--out", str(out), "--max-tokens", str(tokens),
           "--seq-len", str(args.seq_len), "--batch", str(args.batch), "--save-every", "10",
           "--eval-every", str(args.steps), *extra]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def read_log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


def median_rate(step_seconds: list[float], tokens_per_step: int) -> float:
    """Median tokens/s of the steps after the first quarter (the first step compiles kernels)."""
    return statistics.median(tokens_per_step / t for t in step_seconds[len(step_seconds) // 4:])


# name: (the one-GPU baseline it is measured against, its flags on N GPUs)
CASES = {
    "fsdp": ("eager", ()),  # FSDP2, each layer its own unit, resharded after its forward
    "gathered": ("eager", ("--no-fsdp-reshard",)),  # FSDP2, layers kept gathered to their backward
    "replicated": ("eager", ("--fsdp-replicate",)),  # FSDP2 on a [N, 1] mesh: whole weights, per-layer all-reduce
    "graphed": ("graphed", ("--no-fsdp", "--cuda-graph")),  # replicas, one all-reduce a step, CUDA-graph steps
}
BASELINES = {"eager": (), "graphed": ("--cuda-graph",)}


def summary(records: list[dict], stage: int, tokens_per_step: int) -> dict:
    """Losses and `median_rate` of one stage's steps."""
    steps = [r for r in records if r["stage"] == stage and "loss" in r]
    return {"loss": [r["loss"] for r in steps],
            "tokens_per_s": median_rate([r["step_s"] for r in steps], tokens_per_step)}


def rates_from_log(text: str, tokens_per_step: int) -> list[dict]:
    """Per-step tokens/s of each run and stage in a captured log of this script, from the progress bars.

    The bars show the stage-so-far rate after step n (tokens n*T over elapsed e_n); e_n - e_(n-1) is
    step n alone (with a checkpoint save, the step after one). Logs written before train_log.jsonl had
    `step_s` need this.
    """
    found = []
    for run in re.split(r"(?m)^\+ torchrun", text)[1:]:
        command = run.splitlines()[0].strip()
        for stage in (1, 2):
            shown = {int(n): int(rate.replace(",", "")) for n, rate in
                     re.findall(rf"stage {stage}:[^|]*\|[^|]*\|\s*(\d+)/\d+ [^\]]*tok_s=([\d,]+)\]", run)}
            elapsed = {n: n * tokens_per_step / rate for n, rate in shown.items() if n > 0}
            steps = [elapsed[n] - elapsed[n - 1] for n in sorted(elapsed) if n - 1 in elapsed]
            found.append({"run": command, "stage": stage, "step_s": steps,
                          "tokens_per_s": median_rate(steps, tokens_per_step)})
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--out")
    parser.add_argument("--from-log", help="only print per-step rates from a captured log of this script")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--method", default="lizard")
    parser.add_argument("--data", default="default")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    args = parser.parse_args()
    if args.from_log:
        for row in rates_from_log(Path(args.from_log).read_text(), args.batch * args.seq_len):
            print(f"stage {row['stage']}: {row['tokens_per_s']:,.0f} tokens/s  {row['run']}")
        return
    if not args.out:
        parser.error("--out is required")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cases = args.cases.split(",")
    if unknown := set(cases) - set(CASES):
        parser.error(f"unknown cases {sorted(unknown)}; known: {', '.join(CASES)}")
    runs = Path("/tmp/fsdp_runs")
    for baseline in dict.fromkeys(CASES[case][0] for case in cases):
        distill(1, runs / f"gpu1-{baseline}", args, BASELINES[baseline])
    for case in cases:
        distill(args.gpus, runs / f"gpu{args.gpus}-{case}", args, CASES[case][1])

    result = {"gpus": args.gpus, "model": args.model, "method": args.method, "batch": args.batch,
              "seq_len": args.seq_len, "steps": args.steps, "cases": {}}
    per_step = args.batch * args.seq_len
    for case in cases:
        one, many = read_log(runs / f"gpu1-{CASES[case][0]}"), read_log(runs / f"gpu{args.gpus}-{case}")
        result["cases"][case] = {"flags": list(CASES[case][1]), "baseline": CASES[case][0], "stages": {}}
        for stage in (1, 2):
            a, b = summary(one, stage, per_step), summary(many, stage, per_step)
            worst = max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a["loss"], b["loss"], strict=True))
            result["cases"][case]["stages"][stage] = {
                "loss_1gpu": a["loss"], f"loss_{args.gpus}gpu": b["loss"], "max_relative_loss_difference": worst,
                "tokens_per_s_1gpu": a["tokens_per_s"], f"tokens_per_s_{args.gpus}gpu": b["tokens_per_s"],
                "speedup": b["tokens_per_s"] / a["tokens_per_s"]}
    (out / "fsdp.json").write_text(json.dumps(result, indent=2))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from linearize.figures import save_png

    fig, axes = plt.subplots(len(cases), 2, figsize=(10, 3.2 * len(cases)), squeeze=False)
    for row, case in zip(axes, cases):
        for ax, stage in zip(row, (1, 2)):
            s = result["cases"][case]["stages"][stage]
            ax.plot(s["loss_1gpu"], label=f"1 GPU ({CASES[case][0]})")
            ax.plot(s[f"loss_{args.gpus}gpu"], "--", label=f"{args.gpus} GPUs ({case})")
            ax.set_title(f"{case}, stage {stage}: speed-up {s['speedup']:.2f}x")
            ax.set_xlabel("step")
            ax.set_ylabel("loss")
            ax.legend()
    fig.tight_layout()
    save_png(fig, out / "fsdp.png", dpi=120)
    for case in cases:
        print(case, " ".join(f"stage {stage}: {s['speedup']:.2f}x"
                             for stage, s in result["cases"][case]["stages"].items()), flush=True)


if __name__ == "__main__":
    main()
