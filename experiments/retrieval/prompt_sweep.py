"""Which prompt shape shows a teacher's retrieval: passkey and niah_single accuracy per shape, length and depth.

    nice python experiments/retrieval/prompt_sweep.py --model smollm2 --lengths 1k,2k \\
        --depths 0,10,50,90,100 --samples 3 --out docs/results/cpu/prompt-sweep/smollm2.json
    python experiments/retrieval/prompt_sweep.py --model gemma3 --device cuda --dtype bfloat16 \\
        --lengths 4k,8k,16k,32k --out docs/results/h100/prompt-sweep/gemma3.json

Every prompt is generated greedily, one at a time (batch 1: no padding), with the seeds `linearize
eval` uses for the same (task, length, depth, sample), so every shape gets the same keys and needles.
Each answer is read both ways (`prompt_shapes.contains_score`: the answer anywhere in the prediction;
`first_match_score`: the prediction's first number is the answer), so a shape that differs from
another only in its parsing (space-first vs space) needs no prompts of its own. Writes OUT (every
prompt, its prediction and both scores; rewritten after each prompt, and kept by a rerun with
`--resume`) and OUT with .md: accuracy per shape and length, and per shape and depth.
For the teachers only: a shape is chosen on the teacher's retrieval, never on a student's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

from linearize.cli_args import compact_json, write_text_atomic
from linearize.eval.prompt_shapes import SHAPES, contains_score, first_match_score

TASKS = ("passkey", "niah_single")
DEFAULT_SHAPES = "v1,space,landmark,example"
FORMAT = "linearize-prompt-sweep/1"


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="model spec: alias (smollm2, gemma3) or a path")
    parser.add_argument("--out", required=True, type=Path, help="results JSON; the Markdown table goes next to it")
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--tasks", default=",".join(TASKS), help="passkey, niah_single or both")
    parser.add_argument("--niah-variants", default="1", help="niah_single variants (1: noise haystack; 2, 3: essay)")
    parser.add_argument("--lengths", default="1k,2k")
    parser.add_argument("--depths", default="0,10,50,90,100")
    parser.add_argument("--samples", type=int, default=3, help="prompts per (task, length, depth)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16", "auto"))
    parser.add_argument("--resume", action="store_true", help="keep the prompts OUT already answered")
    parser.add_argument("--tables", action="store_true",
                        help="only write the Markdown of OUT again (of a sweep cut short too), running nothing")
    return parser.parse_args(argv)


def checked(args) -> tuple[list[str], list[str], list[int], list[int], list[float]]:
    """(shapes, tasks, niah variants, lengths, depths), or a ValueError naming the bad flag."""
    from linearize.eval.tasks import parse_depths, parse_lengths

    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    if not shapes or (bad := [s for s in shapes if s not in SHAPES]):
        raise ValueError(f"--shapes: unknown {', '.join(bad) if shapes else 'none given'}; choose from {', '.join(SHAPES)}")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks or any(t not in TASKS for t in tasks):
        raise ValueError(f"--tasks {args.tasks!r}: choose from {', '.join(TASKS)}")
    try:
        variants = sorted({int(v) for v in args.niah_variants.split(",")})
        lengths, depths = parse_lengths(args.lengths), parse_depths(args.depths)
    except ValueError as e:
        raise ValueError(f"--niah-variants/--lengths/--depths: {e}") from None
    if any(v not in (1, 2, 3) for v in variants):
        raise ValueError(f"--niah-variants {args.niah_variants!r}: variants are 1, 2 and 3")
    if args.samples < 1:
        raise ValueError(f"--samples {args.samples}: give at least 1")
    if args.out.suffix != ".json":
        raise ValueError(f"--out {args.out}: name a .json file")
    if args.out.exists() and not args.resume:
        raise ValueError(f"--out {args.out} exists: pass --resume to continue it, or pick a new --out")
    return shapes, tasks, variants, lengths, depths


def prompt_fields(shape: str) -> tuple:
    """What of a shape makes its prompt: shapes equal in these share their prompts and predictions."""
    return tuple(asdict(replace(SHAPES[shape], name="", answer="")).values())


def cells(shapes, tasks, variants, lengths, depths, samples, seed) -> list[dict]:
    from linearize.eval.longcontext import sample_seed

    return [
        {"shape": shape, "task": task, "length": length, "depth": depth, "index": i,
         "seed": sample_seed(seed, task, length, depth, i, variant)} | ({"variant": variant} if variant else {})
        for task in tasks
        for variant in (variants if task == "niah_single" else (None,))
        for length in lengths
        for shape in shapes
        for depth in depths
        for i in range(samples)
    ]


def cell_key(cell: dict) -> tuple:
    return cell["shape"], cell["task"], cell.get("variant"), cell["length"], cell["depth"], cell["seed"]


def accuracy(records: list[dict], rule: str) -> float:
    return sum(r[rule] for r in records) / len(records)


def tables(results: dict) -> str:
    """The Markdown: per task, accuracy per shape and length (both readings), then per shape and depth."""
    records, settings = results["samples"], results["settings"]
    from linearize.eval.report import length_label

    where = settings.get("gpu") or settings["device"]  # a GPU's name, so its figures say which card ran them
    about = (f"Greedy, batch 1, {settings['dtype']} on {where}; up to {settings['samples']} prompts per "
             f"(task, shape, length, depth), depths {settings['depths']}; {len(records)} prompts answered. Each cell: "
             "accuracy with the answer anywhere in the prediction / with the prediction's first number the answer "
             f"(`first`). Command: `{settings['command']}`.")
    lines = [f"# Prompt-shape sweep: {settings['model']}", "", about, ""]

    for task in dict.fromkeys((r["task"], r.get("variant")) for r in records):
        rows = [r for r in records if (r["task"], r.get("variant")) == task]
        name = task[0] + (f" (variant {task[1]})" if task[1] else "")
        shapes = list(dict.fromkeys(r["shape"] for r in rows))
        for axis, label in (("length", length_label), ("depth", lambda d: f"{d:g}%")):
            values = sorted({r[axis] for r in rows})
            lines += [f"## {name}: by {axis}", "", f"| shape | {' | '.join(label(v) for v in values)} | all |",
                      "|---" * (len(values) + 2) + "|"]
            for shape in shapes:
                mine = [r for r in rows if r["shape"] == shape]
                cells_ = [[r for r in mine if r[axis] == v] for v in values] + [mine]
                lines.append(f"| {shape} | " + " | ".join(
                    f"{accuracy(c, 'contains'):.2f} / {accuracy(c, 'first'):.2f}" if c else "–" for c in cells_) + " |")
            lines.append("")
        lines += [f"## {name}: by length and depth (answer anywhere)", ""]
        lengths, depths = sorted({r["length"] for r in rows}), sorted({r["depth"] for r in rows})
        lines += [f"| shape | length | {' | '.join(f'{d:g}%' for d in depths)} |", "|---" * (len(depths) + 2) + "|"]
        for shape in shapes:
            for length in lengths:
                at = [[r for r in rows if r["shape"] == shape and r["length"] == length and r["depth"] == d]
                      for d in depths]
                lines.append(f"| {shape} | {length_label(length)} | "
                             + " | ".join(f"{accuracy(c, 'contains'):.2f}" if c else "–" for c in at) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.tables:
        if not args.out.is_file():
            print(f"prompt_sweep: --out {args.out} does not exist: nothing to tabulate", file=sys.stderr)
            return 2
        write_text_atomic(args.out.with_suffix(".md"), tables(json.loads(args.out.read_text())))
        print(f"wrote {args.out.with_suffix('.md')}")
        return 0
    try:
        shapes, tasks, variants, lengths, depths = checked(args)
    except ValueError as e:
        print(f"prompt_sweep: {e}", file=sys.stderr)
        return 2

    from functools import partial

    import torch

    from linearize.eval.generation import greedy_generate
    from linearize.eval.longcontext import build_sample
    from linearize.eval.tasks import haystack_essay
    from linearize.loading import load_model, load_tokenizer

    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model, dtype=None if args.dtype == "float32" else args.dtype, device=args.device)
    generate = partial(greedy_generate, model, tokenizer, batch=1, desc="prompt")
    essays = {task: haystack_essay(task, None) if task == "niah_single" and variants != [1] else () for task in tasks}
    settings = {"model": args.model, "device": args.device, "dtype": args.dtype, "shapes": shapes, "tasks": tasks,
                "niah_variants": variants, "lengths": lengths, "depths": depths, "samples": args.samples,
                "seed": args.seed, "command": " ".join(["python", *sys.argv]),
                "started_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
    if torch.device(args.device).type == "cuda":
        settings["gpu"] = torch.cuda.get_device_name(torch.device(args.device))
    kept = {}
    if args.resume and args.out.exists():
        kept = {cell_key(r): r for r in json.loads(args.out.read_text())["samples"]}
    predictions = {(prompt_fields(r["shape"]), r["task"], r.get("variant"), r["length"], r["depth"], r["seed"]):
                   r["prediction"] for r in kept.values()}
    records = []
    todo = cells(shapes, tasks, variants, lengths, depths, args.samples, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for number, cell in enumerate(todo, start=1):
        if cell_key(cell) in kept:
            records.append(kept[cell_key(cell)])
            continue
        sample = build_sample(cell["task"], tokenizer, cell["length"], cell["depth"], cell["seed"],
                              variant=cell.get("variant"), essay=essays[cell["task"]], prompt_shape=cell["shape"])
        shared = (prompt_fields(cell["shape"]), *cell_key(cell)[1:])
        if shared not in predictions:
            predictions[shared] = generate([sample.prompt], sample.max_new_tokens)[0]
        prediction = predictions[shared]
        records.append(cell | {"tokens": sample.tokens, "answers": list(sample.answers), "prediction": prediction,
                               "contains": contains_score(prediction, sample.answers),
                               "first": first_match_score(prediction, sample.answers)})
        results = {"format": FORMAT, "settings": settings, "samples": records}
        write_text_atomic(args.out, compact_json(results) + "\n")
        print(f"[{number}/{len(todo)}] {cell['shape']} {cell['task']} {cell['length']} {cell['depth']:g}%: "
              f"{records[-1]['contains']:.0f}/{records[-1]['first']:.0f} {prediction.strip()[:60]!r}", flush=True)
    results = {"format": FORMAT, "settings": settings, "samples": records}
    write_text_atomic(args.out, compact_json(results) + "\n")
    write_text_atomic(args.out.with_suffix(".md"), tables(results))
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
