"""`linearize eval`: load a model by spec, run eval tasks, write FILE.json + FILE.md + plots."""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path

from linearize.cli_args import check_device, default_device, seed
from linearize.config import inference_options_help, parse_inference_options
from linearize.eval.longcontext import DEFAULT_SAMPLES
from linearize.eval.prompt_shapes import DEFAULT_SHAPE, SHAPES

# api and report (torch, transformers, lm-eval, matplotlib) are imported by the functions that use them,
# so building the parser (`linearize --help`) stays fast.

TASK_HELP = (
    "comma-separated tasks: ppl, piqa, arc_easy, arc_challenge, hellaswag, winogrande, mmlu, lambada, "
    "passkey, niah_single, niah_multikey, niah_multivalue, variable_tracking, mqar, RULER's niah_single_1..3, "
    "niah_multikey_1..3, niah_multiquery, vt, cwe, fwe, qa_1, babilong_qa1..5, the generative *_gen tasks "
    "and squad_gen; shorthands zeroshot (the five zero-shot tasks), zeroshot_gen (the same, answers generated), "
    "longcontext (the six synthetic ones), ruler (RULER's twelve offline tasks) and babilong; other lm-eval "
    "task names pass through"
)


def register(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "eval",
        help="evaluate a teacher or linearized model (perplexity, lm-eval tasks, long-context tasks)",
        description="Evaluate a model and write FILE.json, FILE.md and PNG plots next to it.",
    )
    parser.add_argument("--model", required=True, help="model spec: alias (smollm2), .gguf path, local HF dir or hub id")
    parser.add_argument("--tasks", required=True, help=TASK_HELP)
    parser.add_argument("--out", required=True, help="results JSON path; FILE.md and FILE.*.png are written next to it")
    parser.add_argument("--limit", type=int, help="cap per task: lm-eval documents, ppl windows per length, "
                        "long-context samples per (length, depth) cell")
    parser.add_argument("--task-limit", action="append", default=[], metavar="TASK=N",
                        help="cap one lm-eval task's documents (per subtask for groups), e.g. mmlu=20; repeatable")
    parser.add_argument("--lengths", default="1k,2k,4k,8k,16k,32k",
                        help="context lengths in tokens for ppl and long-context tasks, e.g. 1k,2k,512,32K")
    parser.add_argument("--task-lengths", action="append", default=[], metavar="TASK=LENGTHS",
                        help="lengths of one ppl or long-context task instead of --lengths, e.g. "
                        "variable_tracking=4k; repeatable")
    parser.add_argument("--depths", default="0,25,50,75,100", help="needle depths in percent")
    parser.add_argument("--samples", type=int, default=DEFAULT_SAMPLES,
                        help="long-context samples per (length, depth) cell")
    parser.add_argument("--batch", type=int, default=8, help="sequences per forward pass (fewer for long ones)")
    parser.add_argument("--harness-batch", type=int,
                        help="lm-eval's sequences per forward pass (default --batch): its requests are short")
    parser.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"),
                        help="default float32; auto keeps the checkpoint's dtype")
    parser.add_argument("--seed", type=seed, default=0, help="seed of the synthetic tasks and lm-eval's samplers")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help=inference_options_help())
    parser.add_argument("--text", help="perplexity text (.txt); default Moby-Dick from the public-domain texts")
    parser.add_argument("--essay", help="essay haystack text (.txt); default the other public-domain texts")
    parser.add_argument("--resume", action="store_true",
                        help="keep what an earlier run with the same settings saved in --out (finished tasks, "
                        "the answered prompts of a long-context task) and run the rest")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the results in --out from an earlier run (without it, an existing FILE.json "
                        "is refused, never overwritten)")
    parser.add_argument("--chat-template", action="store_true",
                        help="put the generative tasks' prompts (zeroshot_gen, squad_gen) in the model's chat template "
                        "as one user turn, for an instruct model; log-likelihood tasks keep the bare text")
    parser.add_argument("--prompt-shape", default=DEFAULT_SHAPE, choices=tuple(SHAPES),
                        help="layout and answer parsing of the passkey and niah_single prompts "
                        "(their shapes: linearize/eval/prompt_shapes.py); default %(default)s")
    parser.set_defaults(func=run)
    return parser


def _flag(flag: str, parse, *values):
    """parse(*values), its ValueError prefixed with the flag the values came from (the line names it)."""
    try:
        return parse(*values)
    except ValueError as e:
        raise ValueError(f"{flag}: {e}") from None


def run(args) -> int:
    from linearize.eval import api
    from linearize.eval.report import write_json, write_report

    # Check every input before the (slow) model load, so a mistake fails at once.
    cfg = eval_config_from_args(args)
    for flag in ("text", "essay"):
        if getattr(args, flag) is not None and not Path(getattr(args, flag)).is_file():
            raise ValueError(f"--{flag} {getattr(args, flag)} is not a file.")
    check_out(args.out, resume=args.resume, overwrite=args.overwrite)
    check_device(args.device)
    previous = read_previous(args.out) if args.resume else None
    options = parse_inference_options(args.set)

    from linearize.loading import load_model, load_tokenizer

    tokenizer = load_tokenizer(args.model)
    api.check_prompt_lengths(cfg.tasks, tokenizer, cfg.lengths, cfg.essay, cfg.task_lengths, cfg.prompt_shape)
    _flag("--chat-template", api.check_chat_template, cfg.chat_template, tokenizer)
    model = load_model(args.model, dtype=args.dtype, device=default_device(args.device), inference_options=options)
    results = api.evaluate(model, tokenizer, cfg, model_spec=args.model, on_progress=partial(write_json, out=args.out),
                           resume=previous)
    for path in write_report(results, args.out):
        print(f"wrote {path}")
    print(summary_line(results))
    return 0


# EvalConfig's settings -> the flags that give them, which its errors name.
FLAGS = {"tasks": "--tasks", "limit": "--limit", "task_limits": "--task-limit", "lengths": "--lengths",
         "task_lengths": "--task-lengths", "depths": "--depths", "samples": "--samples", "batch": "--batch",
         "harness_batch": "--harness-batch", "chat_template": "--chat-template", "prompt_shape": "--prompt-shape"}


def eval_config_from_args(args):
    """The `EvalConfig` of the command's flags (a ValueError naming the flag for a bad one)."""
    from linearize.eval.config import EvalConfig, EvalSettingError

    task_limits = _flag("--task-limit", parse_task_limits, args.task_limit)
    try:
        return EvalConfig(tasks=args.tasks, limit=args.limit, task_limits=task_limits, lengths=args.lengths,
                          task_lengths=dict(item.partition("=")[::2] for item in args.task_lengths), depths=args.depths,
                          samples=args.samples, batch=args.batch, harness_batch=args.harness_batch, seed=args.seed,
                          text=args.text, essay=args.essay, chat_template=args.chat_template,
                          prompt_shape=args.prompt_shape)
    except EvalSettingError as e:
        flag, text = FLAGS.get(e.setting, e.setting), str(e)
        if text.startswith(f"{e.setting} "):  # a message that names the setting names the flag instead
            raise ValueError(flag + text.removeprefix(e.setting)) from None
        raise ValueError(f"{flag}: {text}") from None


def check_out(out: str, *, resume: bool, overwrite: bool) -> None:
    """Refuse an --out that the results could not be written to, or that would overwrite earlier
    results unasked: checked before the model loads, so no task runs in vain."""
    from linearize.cli_args import CommandError, check_writable_parent

    path = Path(out).expanduser()
    if resume and overwrite:
        raise CommandError("--resume keeps the results in --out and --overwrite replaces them: pick one")
    check_writable_parent(out)
    if path.is_dir():
        raise CommandError(f"--out {out} is a folder: name the results file in it, e.g. {path / 'results.json'}")
    if path.suffix != ".json":
        raise CommandError(f"--out {out}: the results are JSON, so name a .json file "
                           f"(FILE.md and the plots go next to it)")
    if path.exists() and not resume and not overwrite:
        raise CommandError(f"--out {out} already exists: pass --resume to continue it, --overwrite to replace it, "
                           "or pick a new --out")


def read_previous(out: str) -> dict:
    """The results an earlier run wrote to `out`, for --resume."""
    from linearize.eval import api
    from linearize.eval.results_file import read_results

    path = Path(out)
    if not path.is_file():
        raise ValueError(f"--resume: {out} does not exist (nothing to resume; run without --resume).")
    try:
        previous = read_results(path)
    except json.JSONDecodeError as e:
        raise ValueError(f"--resume: {out} is not a results JSON ({e}).") from e
    except (OSError, ValueError) as e:  # the per-sample records it names: missing or not gzipped JSON lines
        raise ValueError(f"--resume: {out}: its per-sample records cannot be read ({e}).") from e
    if not isinstance(previous, dict) or previous.get("format") != api.FORMAT:
        raise ValueError(f"--resume: {out} is not a results file of `linearize eval` (format {api.FORMAT}).")
    return previous


def parse_task_limits(items: list[str]) -> dict[str, int]:
    """["mmlu=20", ...] -> {"mmlu": 20}."""
    limits = {}
    for item in items:
        task, _, value = item.partition("=")
        if not task or not value.isdigit() or int(value) < 1:
            raise ValueError(f"--task-limit takes TASK=N with N a positive integer, got {item!r}")
        limits[task.strip()] = int(value)
    return limits


def summary_line(results: dict) -> str:
    """One line of headline numbers for the terminal. A zero-shot task shows the metric the zero-shot
    average takes from it (`name:acc_norm=...` where that is not acc), so the average is the mean of the
    numbers beside it."""
    averaged = results.get("zeroshot_average", {}).get("metrics", {})
    parts = []
    for name, r in results["tasks"].items():
        if name == "ppl":
            parts += [f"ppl@{row['length']}={row['ppl']:.2f}" for row in r["by_length"]]
        elif "grid" in r:
            parts.append(f"{name}={r['score']:.3f}")
        elif averaged.get(name, "acc") != "acc" and averaged[name] in r:
            parts.append(f"{name}:{averaged[name]}={r[averaged[name]]:.3f}")
        elif "acc" in r:
            parts.append(f"{name}={r['acc']:.3f}")
    if "zeroshot_average" in results:
        parts.append(f"zeroshot_avg={results['zeroshot_average']['value']:.3f}")
    return " ".join(parts)
