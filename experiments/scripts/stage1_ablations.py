"""Short CPU stage-1 runs of Lizard variants on the real teacher: the validation MSE each reaches.

    python experiments/scripts/stage1_ablations.py [--steps 48] [--seq-len 256] [--out runs/stage1-ablations]
        [--json FILE] [NAME ...]

Every variant trains stage 1 alone for `--steps` steps of 4 x `--seq-len` tokens at the papers' lr 1e-3 (the
per-head scalars at 30x), on top of the Lizard form that learns fastest from SmolLM2 (RoPE in the
window, one shared normaliser; docs/methods.md), and changes one option. A proxy on a CPU budget, not
a results row: it ranks options by how close stage 1 gets to the teacher's attention outputs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from linearize.train import DistillConfig, distill

BASE = {"rope_in_window": True, "combine": "shared"}
VARIANTS = {
    "base (w=128, 4 sinks, scalar gate)": {},
    "window 32": {"window": 32},
    "window 64": {"window": 64},
    "window 256": {"window": 256},
    "no sinks": {"num_sinks": 0},
    "vector gate": {"gate": "vector"},
    "no gate": {"gate": "none"},
    "no RoPE in the window": {"rope_in_window": False},
}


def val_losses(out: Path) -> list[float]:
    records = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    return [r["val_loss"] for r in records if r.get("split") == "val"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="variants to run (default: all)")
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--out", default="runs/stage1-ablations")
    parser.add_argument("--json", type=Path, help="also write each variant's validation MSEs here (the docs' source)")
    args = parser.parse_args()
    names = args.names or list(VARIANTS)
    results = {}
    print(f"| variant | val MSE at start | after {args.steps} steps |\n|---|---|---|", flush=True)
    for index, name in enumerate(names):
        out = Path(args.out) / f"{index}-{name.split(' (')[0].replace(' ', '-')}"
        cfg = DistillConfig(model=args.model, method="lizard", out=str(out), stage="1", seq_len=args.seq_len, batch=4,
                            max_tokens=args.steps * 4 * args.seq_len, eval_every=args.steps, save_every=args.steps,
                            head_lr_scale=30.0, options={**BASE, **VARIANTS[name]})
        if not (out / "stage1_attention.pt").exists():
            distill(cfg, resume=(out / "distill_config.json").exists(), progress=False)
        losses = val_losses(out)
        print(f"| {name} | {losses[0]:.3f} | {losses[-1]:.3f} |", flush=True)
        results[name] = {"options": {**BASE, **VARIANTS[name]}, "val_mse": losses}
        if args.json is not None:  # after every variant, so an interrupted sweep keeps the finished ones
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"model": args.model, "steps": args.steps, "seq_len": args.seq_len,
                                             "batch": 4, "device": "cpu", "variants": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
