"""The `linearize` command. Flag names are a contract: other tools script against them.

Every user mistake (bad flag value, missing path, unsupported model...) ends as one line on stderr
and exit status 2; set LINEARIZE_DEBUG=1 to see the traceback instead.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import threading
from pathlib import Path

from .cli_args import (  # noqa: F401  (the verbs' shared types, also importable from here)
    EXIT_USAGE,
    CommandError,
    atomic_output_dir,
    check_device,
    check_new_output,
    check_text,
    check_writable_parent,
    default_device,
    describe_os_error,
    first_line,
    parse_int_list,
    positive_float,
    positive_int,
)
from .config import ConfigError, inference_options_help


def cmd_convert(args) -> None:
    from .config import check_fits_positions, make_method_config, parse_set_options
    from .convert import check_layer_choice, convert, kept_sliding_layers
    from .loading import load_config, load_model, load_tokenizer

    # The flags first (option names and values against the method, --out), then what needs the model's
    # config (an alias may be fetched for it), then the weights.
    method = make_method_config(args.method, **parse_set_options(args.set or []))
    check_new_output(args.out)
    config = load_config(args.model)
    layers = getattr(config, "num_hidden_layers", None)  # None: convert names the model type
    if layers is not None:
        check_layer_choice(layers, args.method, args.softmax_layers, kept=kept_sliding_layers(config, args.layers))
    check_fits_positions(method, config)
    with atomic_output_dir(args.out) as scratch:
        model = load_model(args.model, dtype=args.dtype)
        convert(model, method, softmax_layers=args.softmax_layers, layers=args.layers)
        model.save_pretrained(scratch)
        load_tokenizer(args.model).save_pretrained(scratch)
    print(f"wrote {args.method} model to {args.out}")


def check_decoding_flags(temperature: float, static: bool, compile_step: bool) -> None:
    """Refuse a combination of generate's decoding flags (CommandError); needs no model."""
    if not math.isfinite(temperature) or temperature < 0:
        raise CommandError(f"--temperature must be 0 (greedy) or a positive number, got {temperature}")
    if (static or compile_step) and temperature > 0:
        raise CommandError("--static decodes greedily: leave out --temperature")
    if compile_step and not static:
        raise CommandError("--compile applies to --static decoding")


def generate_text(model, tokenizer, prompt: str, *, max_new_tokens: int, chat: bool = False,
                  temperature: float = 0.0, seed: int = 0, static: bool = False, compile_step: bool = False) -> str:
    """HF's `generate`, or with `static` greedy steps on the frozen fixed-shape cache of a fully
    linearized model (`linearize.decode.greedy_decode`: a CUDA graph per step on a GPU; with
    `compile_step`, the step through torch.compile first), cut at the first end-of-sequence token."""
    import torch

    check_decoding_flags(temperature, static, compile_step)
    if static:
        from .decode import fully_linearized

        if not fully_linearized(model):
            raise CommandError("--static decodes fully linearized models only (every layer linear); "
                               "this model has softmax layers, whose caches grow: leave out --static")
    if chat:
        messages = [{"role": "user", "content": prompt}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        text = prompt
    inputs = tokenizer(text, return_tensors="pt", add_special_tokens=not chat).to(model.device)
    if inputs["input_ids"].shape[1] == 0:
        raise CommandError(f"--prompt {prompt!r} gives no tokens to continue from: give some text")
    torch.manual_seed(seed)
    sampling = {"do_sample": True, "temperature": temperature, "top_p": 0.95} if temperature > 0 else {"do_sample": False}
    if static:
        from .decode import greedy_decode, until_end

        new = greedy_decode(model, inputs["input_ids"], max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                            compile_backend="inductor" if compile_step else None)
        return tokenizer.decode(until_end(new, tokenizer.eos_token_id)[0], skip_special_tokens=True)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                             **sampling)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def cmd_generate(args) -> None:
    from .config import parse_inference_options
    from .loading import load_model, load_tokenizer

    # Every flag checked before the (slow) model load.
    check_text(args.prompt, "--prompt")
    if not args.prompt and not args.chat:
        raise CommandError("--prompt is empty: give the text to continue (or --chat to answer an empty message)")
    check_decoding_flags(args.temperature, args.static, args.compile)
    check_device(args.device)
    options = parse_inference_options(args.set)
    model = load_model(args.model, dtype=args.dtype, device=default_device(args.device), inference_options=options)
    tokenizer = load_tokenizer(args.model)
    text = generate_text(model, tokenizer, args.prompt, max_new_tokens=args.max_new_tokens, chat=args.chat,
                         temperature=args.temperature, seed=args.seed, static=args.static, compile_step=args.compile)
    from .modeling import undistilled_note  # loaded by now: load_model imported it

    if note := undistilled_note(model.config):  # after the flags' checks: an error stays one line
        print(note, file=sys.stderr)
    print(text)


def cmd_demo(args) -> None:
    """Distil the default teacher into Lizard, then compare teacher and student.

    On a CPU the budget is small enough for ~8 minutes on 2 cores; on a GPU it is the paper's
    (20M tokens per stage at 2048). Rerunning continues an interrupted run, or reuses a finished one.
    """
    import torch

    from .eval.perplexity import perplexity
    from .loading import load_model, load_tokenizer
    from .train import DistillConfig, ensure_distilled

    gpu = torch.cuda.is_available()
    # On 2 CPU cores a step of 4 x 256 tokens takes ~3 s in stage 1 and ~6 s in stage 2, so the CPU
    # budget is 48 steps per stage (~9 minutes in all).
    budget = ({"max_tokens": 20_000_000, "seq_len": 2048, "batch": 8} if gpu
              else {"max_tokens": 49_152, "seq_len": 256, "batch": 4})
    # The Lizard variant that learns fastest from this teacher (docs/methods.md): RoPE in the window,
    # one shared normaliser, the per-head scalars at 30x the stage-1 lr.
    options = {"rope_in_window": True, "combine": "shared"}
    cfg = DistillConfig(model=args.model, method="lizard", out=args.out, data="default", eval_every=16,
                        save_every=8, val_batches=2, head_lr_scale=30.0, options=options, **budget)
    out = Path(args.out)
    ensure_distilled(cfg)
    tokenizer = load_tokenizer(args.model)
    prompt = "Write one sentence about the sea."
    device = "cuda" if gpu else None
    print(f"distilled with {cfg.max_tokens:,} tokens per stage at length {cfg.seq_len} (the papers use 20M), "
          f"options {options}")
    perplexities = {}
    for name, spec in (("teacher", args.model), ("lizard student", str(out))):
        model = load_model(spec, device=device)
        perplexities[name] = perplexity(model, tokenizer, [512], limit=4)["by_length"][0]["ppl"]
        print(f"{name}: perplexity {perplexities[name]:.2f} on held-out Moby-Dick (4 windows of 512 tokens)")
        answer = generate_text(model, tokenizer, prompt, max_new_tokens=32, chat=True)
        print(f"{name} says:", answer.strip() or "(nothing: it ended its turn at once)")
    print(demo_summary(out, perplexities))


def demo_summary(out: Path, perplexities: dict[str, float]) -> str:
    """The demo's closing lines: the figures the README quotes (each stage's validation loss, first and
    last, from the run's log; both perplexities) and where the model is, with what to run on it next."""
    import json

    from .train.run_dir import LOG_NAME

    losses: dict[int, list[float]] = {}
    log = out / LOG_NAME
    for line in log.read_text().splitlines() if log.is_file() else []:
        record = json.loads(line)
        if record.get("split") == "val":
            losses.setdefault(record["stage"], []).append(record["val_loss"])
    names = {1: "validation stage-1 MSE", 2: "stage-2 loss"}
    figures = [f"{names.get(stage, f'stage {stage}')} {values[0]:.2f} -> {values[-1]:.2f}"
               for stage, values in sorted(losses.items())]
    figures.append(f"perplexity {perplexities['lizard student']:.1f} against the teacher's {perplexities['teacher']:.1f}")
    return (f"summary: {', '.join(figures)}\n"
            f"the distilled model is in {out}: linearize generate --model {out} --prompt \"Hello\" --chat")


class _HelpWithDefaults(argparse.HelpFormatter):
    """Each option's help ends with its default, where it has one worth saying: not None, a switch's
    False/True or an empty list, and not one its help already states."""

    def _format_action(self, action):
        import copy

        default = action.default
        if (action.option_strings and not action.required and action.help is not argparse.SUPPRESS
                and not any(default is skip for skip in (None, True, False, argparse.SUPPRESS)) and default != []
                and "default" not in (action.help or "").lower()):
            if isinstance(default, int) and abs(default) >= 10_000:
                text = f"{default:,}"
            elif isinstance(default, list | tuple):
                text = ",".join(map(str, default))
            else:
                text = str(default)
            text = text.replace("%", "%%")
            action = copy.copy(action)
            action.help = f"{action.help} (default: {text})" if action.help else f"default: {text}"
        return super()._format_action(action)


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _HelpWithDefaults)  # every verb's parser is one of these
        super().__init__(*args, **kwargs)

    def error(self, message):
        # One line, not argparse's usage block: scripts read stderr.
        if message == "the following arguments are required: command":  # `linearize` alone: say what to type
            usage = " ".join(self.format_usage().split()[1:])  # argparse wraps a long usage: keep it one line
            message = f"a verb is required; usage: {usage} (linearize VERB --help for its flags)"
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(EXIT_USAGE)


def build_parser() -> argparse.ArgumentParser:
    from .cli_args import add_method_arguments, seed
    from .config import LAYER_CHOICES, LAYERS_HELP, METHOD_CONFIGS, PRESETS

    parser = _Parser(prog="linearize", description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("auto", "triton", "torch"), default=None,
                        help="Triton kernels where they apply (auto, the default: $LINEARIZE_BACKEND or auto), "
                             "required (triton) or never (torch); see linearize.ops.backend")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("convert", help="swap a model's attention and save the result")
    p.add_argument("--model", required=True, help="smollm2 or gemma3 (aliases), a .gguf file, a HF folder or a hub id")
    add_method_arguments(p, METHOD_CONFIGS, PRESETS)
    p.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
    p.add_argument("--softmax-layers", type=parse_int_list, default=[], help="layers that keep softmax, e.g. 0,4")
    p.add_argument("--layers", choices=LAYER_CHOICES, default="all", help=LAYERS_HELP)
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a method option (repeatable)")
    p.add_argument("--dtype", default=None, help="float32 (default), bfloat16, ... or auto")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("generate", help="generate text from a teacher or linearized model")
    p.add_argument("--model", required=True, help="smollm2 or gemma3 (aliases), a .gguf file, a HF folder (a convert or distill "
                   "output) or a hub id")
    p.add_argument("--prompt", required=True, help="the text to continue (with --chat: the user's message)")
    p.add_argument("--max-new-tokens", type=positive_int, default=64, help="tokens to generate at most")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--seed", type=seed, default=0, help="sampling seed")
    p.add_argument("--static", action="store_true",
                   help="fully linearized models: greedy steps on the fixed-shape cache (a CUDA graph per step on a GPU)")
    p.add_argument("--compile", action="store_true",
                   help="with --static: compile the step with torch.compile first (about a minute once, faster steps)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda when available, else cpu)")
    p.add_argument("--dtype", default=None, help="float32 (default), bfloat16, ... or auto (the checkpoint's)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help=inference_options_help())
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("demo", help="distil the default teacher into Lizard and compare the two")
    p.add_argument("--model", default="smollm2", help="teacher: smollm2 or gemma3 (aliases), a .gguf file, a HF folder or a hub id")
    p.add_argument("--out", default="runs/demo-lizard", help="run directory (rerun to resume)")
    p.set_defaults(func=cmd_demo)

    from .bench.command import register as register_bench
    from .eval.command import register as register_eval
    from .eval.command import run as run_eval
    from .recipes.command import register as register_recipe
    from .serve.command import register as register_serve
    from .train.command import register as register_distill

    register_distill(sub)
    register_eval(sub).set_defaults(func=run_eval)
    register_bench(sub)
    register_serve(sub)
    register_recipe(sub)
    return parser


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C raises KeyboardInterrupt: every clean stop that catches one catches it."""


def _raise_terminated(signum, frame):
    raise Terminated


def listen_for_interrupts():
    """Make SIGINT raise KeyboardInterrupt even where the process started with it ignored, as a shell
    starts its background commands, and SIGTERM raise `Terminated`, where it would kill the process: a
    time limit's SIGINT (`timeout --signal=INT`), a `kill`, a scheduler's stop or a container's must
    still stop a run the clean way (a checkpoint saved, the finished tasks and points kept). Returns
    SIGTERM's previous handler, to put back (`None`: left as it was)."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if threading.current_thread() is not threading.main_thread():  # where signals cannot be handled
        return None
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        return signal.signal(signal.SIGTERM, _raise_terminated)
    return None


def main(argv: list[str] | None = None) -> int:
    previous = listen_for_interrupts()
    try:
        return _main(argv)
    finally:
        if previous is not None:  # a caller's process (a test's) gets its SIGTERM back
            signal.signal(signal.SIGTERM, previous)


def _main(argv: list[str] | None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help, or a usage error already printed as one line
        return e.code
    if getattr(args, "loads_models", True):  # `recipe list` reads YAML: transformers' import is seconds
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # weight-loading bars would bury the one-line errors
    try:
        if args.backend:
            from .ops.backend import set_backend

            set_backend(args.backend)
        args.func(args)
    except Terminated:
        print("linearize: terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        print("linearize: interrupted", file=sys.stderr)
        return 130
    except (CommandError, ConfigError, FileNotFoundError, PermissionError, ValueError, OSError) as e:
        if os.environ.get("LINEARIZE_DEBUG"):
            raise
        if isinstance(e, OSError) and e.strerror and e.filename:  # no "[Errno 17]" prefix
            message = describe_os_error(e)
        else:
            message = first_line(e)
        print(f"linearize: error: {message}", file=sys.stderr)
        return EXIT_USAGE
    except ModuleNotFoundError as e:
        # An install without one of linearize's own dependencies: not bad input (exit 1), and no traceback.
        if os.environ.get("LINEARIZE_DEBUG") or not e.name:
            raise
        extra = "[gpu]" if e.name.split(".")[0] in ("fla", "triton") else ""  # pyproject's optional kernels
        print(f"linearize: error: the package {e.name!r} is not installed: install linearize{extra} again with its "
              f"dependencies (pip install -e '.{extra}' in a checkout)", file=sys.stderr)
        return 1
    except Exception as e:
        torch = sys.modules.get("torch")  # a command that ran out of GPU memory has imported it
        if torch is None or not isinstance(e, torch.OutOfMemoryError) or os.environ.get("LINEARIZE_DEBUG"):
            raise
        print(f"linearize: error: {out_of_memory_message(e)}", file=sys.stderr)
        return 1
    return 0


def out_of_memory_message(e: Exception) -> str:
    """One line for a GPU out of memory: torch's figures (what was asked for, what was free), and the
    settings that need less. Not bad input (exit 1, not 2): the same command may fit on an idle GPU."""
    text = " ".join(str(e).split())
    figures = text.split(" Including ")[0].removeprefix("CUDA out of memory. ").rstrip(".")
    return (f"out of GPU memory ({figures}); other processes on the GPU count too. Smaller micro-batches "
            "need less: distill's --grad-accum or --gradient-checkpointing (--resume continues from the "
            "last checkpoint), eval's --batch")


if __name__ == "__main__":
    sys.exit(main())
