"""One GPU vs N GPUs (FSDP2) at the same global batch: same loss curve, tokens/s ratio, resume.

    python scripts/gpu/fsdp_check.py --gpus 2 --out $OUT/fsdp [--model smollm2] [--steps 40]
    python scripts/gpu/fsdp_check.py --from-log fsdp.log --batch 16   # per-step rates of a captured log

Runs `linearize distill` under torchrun with 1 and with N processes on identical settings (stage 1
then stage 2), and N processes again with `--no-fsdp-reshard` (each layer stays gathered from its
forward to its backward in stage 2) and with `--fsdp-replicate` (whole weights on every rank, only
gradients all-reduced). Writes fsdp.json (per-step losses of the runs, their largest
relative difference, median tokens/s and the speed-ups) and fsdp.png. Resuming a multi-rank run, on
as many ranks or fewer, is tested on CPU (tests/train/test_multirank.py).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path


def distill(nproc: int, out: Path, args, extra=()) -> None:
    tokens = args.steps * args.batch * args.seq_len
    cmd = ["torchrun", f"--nproc-per-node={nproc}", "-m", "linearize.cli", "distill", "--model", args.model,
           "--method", args.method, "--out", str(out), "--max-tokens", str(tokens), "--seq-len", str(args.seq_len),
           "--batch", str(args.batch), "--save-every", "10", "--eval-every", str(args.steps), *extra]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def read_log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


def median_rate(step_seconds: list[float], tokens_per_step: int) -> float:
    """Median tokens/s of the steps after the first quarter (the first step compiles kernels)."""
    return statistics.median(tokens_per_step / t for t in step_seconds[len(step_seconds) // 4:])


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
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048)
    args = parser.parse_args()
    if args.from_log:
        for row in rates_from_log(Path(args.from_log).read_text(), args.batch * args.seq_len):
            print(f"stage {row['stage']}: {row['tokens_per_s']:,.0f} tokens/s  {row['run']}")
        return
    if not args.out:
        parser.error("--out is required")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = Path("/tmp/fsdp_runs")
    one, many = runs / "gpu1", runs / f"gpu{args.gpus}"
    gathered = runs / f"gpu{args.gpus}-gathered"
    replicated = runs / f"gpu{args.gpus}-replicated"
    distill(1, one, args)
    distill(args.gpus, many, args)
    distill(args.gpus, gathered, args, ["--no-fsdp-reshard"])
    distill(args.gpus, replicated, args, ["--fsdp-replicate"])

    result = {"gpus": args.gpus, "model": args.model, "method": args.method, "batch": args.batch,
              "seq_len": args.seq_len, "steps": args.steps, "stages": {}}
    per_step = args.batch * args.seq_len
    for stage in (1, 2):
        a, b = summary(read_log(one), stage, per_step), summary(read_log(many), stage, per_step)
        worst = max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a["loss"], b["loss"]))
        result["stages"][stage] = {"loss_1gpu": a["loss"], f"loss_{args.gpus}gpu": b["loss"],
                                   "max_relative_loss_difference": worst,
                                   "tokens_per_s_1gpu": a["tokens_per_s"],
                                   f"tokens_per_s_{args.gpus}gpu": b["tokens_per_s"],
                                   "speedup": b["tokens_per_s"] / a["tokens_per_s"]}
    for name, folder in (("no_reshard", gathered), ("replicate", replicated)):
        rate = summary(read_log(folder), 2, per_step)["tokens_per_s"]
        result["stages"][2][f"tokens_per_s_{name}"] = rate
        result["stages"][2][f"speedup_{name}"] = rate / result["stages"][2]["tokens_per_s_1gpu"]
    (out / "fsdp.json").write_text(json.dumps(result, indent=2))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, stage in zip(axes, (1, 2)):
        s = result["stages"][stage]
        ax.plot(s["loss_1gpu"], label="1 GPU")
        ax.plot(s[f"loss_{args.gpus}gpu"], "--", label=f"{args.gpus} GPUs (FSDP2)")
        ax.set_title(f"stage {stage}: speed-up {s['speedup']:.2f}x")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "fsdp.png", dpi=120)
    json.dump(result["stages"], sys.stdout, indent=1)


if __name__ == "__main__":
    main()
