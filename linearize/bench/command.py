"""`linearize bench kernels|model|train`: the CLI face of `linearize.bench`. Flag names are a contract."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..config import LAYER_CHOICES, LAYERS_HELP, METHOD_CONFIGS
from .shapes import SHAPES


def sizes(text: str) -> list[int]:
    from .common import parse_sizes  # here, not at the top: it imports torch, and `--help` should not

    try:
        return parse_sizes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def size(text: str) -> int:
    values = sizes(text)
    if len(values) != 1:
        raise argparse.ArgumentTypeError(f"expected one size such as 4k, got {text!r}")
    return values[0]


def names_among(what: str, choices, *, unique: bool = False):
    """An argparse type: one or more comma-separated names among `choices` (repeats dropped when `unique`)."""
    def parse(text: str) -> list[str]:
        names = [m.strip() for m in text.split(",") if m.strip()]
        unknown = [m for m in names if m not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"expected {what} among {', '.join(choices)}, got {text!r}")
        return list(dict.fromkeys(names)) if unique else names

    parse.__name__ = what  # argparse names the type in its messages
    return parse


def even_count(text: str) -> int:
    """`--softmax-layers even:N`: N >= 1 layers kept softmax, evenly spaced."""
    rule, _, count = text.partition(":")
    if rule != "even" or not count.isdigit() or int(count) < 1:
        raise argparse.ArgumentTypeError(f"expected even:N with N >= 1 (e.g. even:16), got {text!r}")
    return int(count)


def variant_spec(text: str) -> tuple[str, str, list[str]]:
    """`--variant NAME=METHOD:KEY=VALUE,...` -> (NAME, METHOD, ["KEY=VALUE", ...]); the options are read
    and checked against METHOD with the --set ones (`run_model`)."""
    name, sep, rest = text.partition("=")
    method, _, pairs = rest.partition(":")
    if not sep or not name or method not in METHOD_CONFIGS:
        raise argparse.ArgumentTypeError(f"expected NAME=METHOD:KEY=VALUE,... with METHOD among "
                                         f"{', '.join(METHOD_CONFIGS)}, got {text!r}")
    return name, method, [pair for pair in pairs.split(",") if pair]


methods = names_among("methods", METHOD_CONFIGS)
SERVE_SCENARIOS = ("points", "chat")
# The flags of one scenario of `bench serve` alone (the others are shared).
SCENARIO_FLAGS = {"points": ("clients", "prompt_lengths"),
                  "chat": ("conversations", "turns", "system_tokens", "user_tokens", "target_context", "prefix_block",
                           "prefix_cache_memory", "prefix_cache_host_memory")}
TRAIN_MODES = ("full", "lora", "stage1", "stage2")  # bench.train.MODES, named here without importing torch
train_modes = names_among("modes", TRAIN_MODES, unique=True)


def register(subparsers) -> None:
    from ..cli_args import non_negative_float, positive_float, positive_int
    from ..serve.command import memory_size

    bench = subparsers.add_parser("bench", help="measure kernel, model and training speed and memory",
                                  description="Each writes DIR/<name>.json, DIR/<name>.md and PNG plots into --out.")
    sub = bench.add_subparsers(dest="bench", required=True)
    quick_help = "tiny shapes and sweeps: runs on a CPU in seconds (what the tests use)"

    p = sub.add_parser("kernels", help="Lizard attention op vs fla chunk_gla / chunk_simple_gla and causal SDPA")
    p.add_argument("--out", required=True, type=Path, help="output directory")
    p.add_argument("--quick", action="store_true", help=quick_help)
    p.add_argument("--ops", type=lambda text: [key for key in text.split(",") if key],
                   help="time only these ops, comma-separated: triton, chunked, chunk_gla, chunk_simple_gla, sdpa "
                        "(default: all)")
    p.set_defaults(func=run_kernels)

    p = sub.add_parser("model", help="prefill latency, decode tokens/s and peak memory vs context and batch")
    p.add_argument("--out", required=True, type=Path, help="output directory")
    add_models(p)
    p.add_argument("--contexts", type=sizes, help="batch-1 context sweep, e.g. 1k,4k,1m (default 1k..1m, doubling)")
    p.add_argument("--batches", type=sizes, help="batch sweep, e.g. 1,4,16,64 (default)")
    p.add_argument("--batch-context", type=size, help="context of the batch sweep (default 4k)")
    p.add_argument("--decode-steps", type=positive_int, help="timed decode steps per point (default 32)")
    p.add_argument("--prefill-chunk", type=size, help="tokens per prefill call of a linear model (default 16k)")
    p.add_argument("--teacher-max", type=size, help="longest context for softmax attention (default 128k)")
    p.add_argument("--time-limit", type=positive_float,
                   help="seconds for the whole sweep; points that would end later are skipped (default 420)")
    p.add_argument("--profile", action="store_true",
                   help="also write each model's top ops in a prefill and a decode step (torch.profiler) to files")
    p.add_argument("--compile-decode", metavar="BACKEND", nargs="?", const="inductor",
                   help="torch.compile a linear model's decode step before its CUDA graph (default backend inductor)")
    p.add_argument("--variant", action="append", type=variant_spec, metavar="NAME=METHOD:KEY=VALUE,...",
                   help="one more model beside the methods, under its own name: METHOD with these options over "
                        "the --set ones (repeatable), e.g. lizard-delta=lizard:memory=delta")
    p.add_argument("--quick", action="store_true", help=quick_help)
    p.set_defaults(func=run_model)

    p = sub.add_parser("serve", help="the serving engine under concurrent clients: tokens/s, latency, memory, "
                                     "linearized vs the softmax teacher")
    p.add_argument("--out", required=True, type=Path, help="output directory")
    add_models(p)
    p.add_argument("--scenario", choices=SERVE_SCENARIOS, default="points",
                   help="points: N clients at once with prompts of one length, per (N, length) point (default; "
                        "DIR/serve.*); chat: multi-turn conversations resubmitted whole each turn, a method with "
                        "its prefix cache on and off beside the teacher (DIR/serve_chat.*)")
    p.add_argument("--clients", type=sizes, help="points: concurrent clients per point, e.g. 16,64,256 (default)")
    p.add_argument("--prompt-lengths", type=sizes, help="points: prompt tokens per request, e.g. 4k,32k (default)")
    chat = p.add_argument_group("chat scenario")
    chat.add_argument("--conversations", type=positive_int, help="concurrent conversations (default 8)")
    chat.add_argument("--turns", type=positive_int, help="turns of each conversation (default 6)")
    chat.add_argument("--system-tokens", type=size, help="tokens of the system prompt they share (default 2k)")
    user = chat.add_mutually_exclusive_group()
    user.add_argument("--user-tokens", type=size, help="tokens of each user message (default: from --target-context)")
    user.add_argument("--target-context", type=size,
                      help="the last turn's prompt tokens, which sets the user messages' length (default 32k)")
    chat.add_argument("--prefix-block", type=positive_int,
                      help="the prefix cache's block: a prefilled state is kept every this many tokens (default 256)")
    chat.add_argument("--prefix-cache-memory", type=memory_size, metavar="SIZE",
                      help="the most memory the kept prefix states take, e.g. 8GiB (default 8GiB)")
    chat.add_argument("--prefix-cache-host-memory", type=memory_size, metavar="SIZE",
                      help="host memory for the prefix states the device's budget pushes out (default: none)")
    p.add_argument("--max-tokens", type=positive_int,
                   help="tokens generated per request (default 256; chat: per answer, default 256)")
    p.add_argument("--max-batch", type=positive_int,
                   help="the engine's slots, at most (default 256; chat: the conversations)")
    p.add_argument("--prefill-chunk", type=size, help="prompt tokens per prefill call (default 16k)")
    p.add_argument("--prefill-budget", type=non_negative_float,
                   help="the engine's prefill time a turn while requests generate, in decode steps, as "
                        "`linearize serve --prefill-budget` (default 0: whole chunks)")
    p.add_argument("--time-limit", type=positive_float,
                   help="seconds for the whole run; points that would end later are skipped (default 540)")
    p.add_argument("--quick", action="store_true", help=quick_help)
    p.set_defaults(func=run_serve)

    p = sub.add_parser("train", help="tokens/s and peak memory of distillation stages 1 and 2 vs fine-tunes of the "
                                     "teacher, over sequence lengths, with and without gradient checkpointing")
    p.add_argument("--out", required=True, type=Path, help="output directory")
    which = p.add_mutually_exclusive_group()
    # No default here, or argparse could not tell `--shape X --model Y` from `--model Y`.
    which.add_argument("--model", help="teacher to load: smollm2 or gemma3 (aliases), a .gguf file, a HF folder or "
                                       "a hub id (default smollm2)")
    which.add_argument("--shape", choices=list(SHAPES),
                       help="random bf16 weights of this shape, built on the GPU: llama3-8b, mistral-7b and qwen3-8b "
                            "need one")
    p.add_argument("--method", default="lizard", choices=sorted(METHOD_CONFIGS))
    p.add_argument("--modes", type=train_modes,
                   help=f"comma-separated, among {', '.join(TRAIN_MODES)}: the teacher's full fine-tune, its LoRA "
                        "fine-tune (r, alpha and targets as stage 2), distillation stages 1 and 2 (default: all; "
                        "at the 8B shapes all but full, which does not fit one GPU; for liger, which has no "
                        "stage 1, all but stage1)")
    lengths = p.add_mutually_exclusive_group()
    lengths.add_argument("--seq-lens", type=sizes, help="sequence lengths, e.g. 2k,8k (default 2k; 2k,8k at a --shape)")
    lengths.add_argument("--seq-len", type=size, help="one sequence length (default 2048)")
    batches = p.add_mutually_exclusive_group()
    batches.add_argument("--tokens-per-step", type=size,
                         help="tokens an optimizer step, the batch at each length being this / the length (default 16k: "
                              "8 x 2K, 2 x 8K)")
    batches.add_argument("--batch", type=positive_int, help="sequences per optimizer step at every length instead")
    p.add_argument("--gradient-checkpointing", choices=["both", "on", "off"],
                   help="activation checkpointing per decoder layer: each mode's points with it, without it, or both "
                        "(default off; both at a --shape)")
    p.add_argument("--steps", type=positive_int, help="timed optimizer steps per point (default 10; 6 at a --shape)")
    p.add_argument("--time-limit", type=positive_float,
                   help="seconds for the whole run; points that would end later are skipped (default 480)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="a method option, as in distill (repeatable)")
    p.add_argument("--profile", action="store_true", help="also write each point's top ops (torch.profiler) to a file")
    p.add_argument("--cuda-graph", action="store_true",
                   help="replay each optimizer step from a CUDA graph, as distill --cuda-graph trains")
    p.add_argument("--quick", action="store_true", help=quick_help)
    p.set_defaults(func=run_train)


def add_models(p) -> None:
    """The flags `bench model` and `bench serve` share: which teacher (random weights of a shape, or a
    loaded model), and which linearized versions of it go beside its softmax self."""
    which = p.add_mutually_exclusive_group()
    # No default here, or argparse could not tell `--shape smollm2 --model X` from `--model X`.
    which.add_argument("--shape", choices=["smollm2", "llama3-8b"],
                       help="random bf16 weights of this shape (default smollm2)")
    which.add_argument("--model", help="load this model instead: smollm2 or gemma3 (aliases), a .gguf file, a HF folder or a hub id")
    p.add_argument("--methods", type=methods, help="linear methods to compare with softmax (default lizard)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="a method option for every method (repeatable)")
    p.add_argument("--layers", choices=LAYER_CHOICES, help=f"{LAYERS_HELP.removesuffix(')')}; default all)")
    p.add_argument("--softmax-layers", type=even_count, metavar="even:N",
                   help="a hybrid: keep N of the layers softmax, evenly spaced (with --layers all)")


def wrote(paths) -> None:
    for path in paths:
        print(f"wrote {path}")


def run_kernels(args) -> None:
    import torch

    from ..cli_args import CommandError

    if not args.quick and not torch.cuda.is_available():
        raise CommandError("bench kernels times the Lizard paper's GPU shapes (bf16, batch 16-32 at 2K-8K tokens), "
                           "hours on a CPU, and there is no CUDA device here: pass --quick for the tiny shapes")
    from . import kernels

    wrote(kernels.bench(args.out, quick=args.quick, ops=args.ops))


def check_hybrid(args) -> None:
    """A one-line error for --softmax-layers beside --layers full (which keeps the sliding layers already)."""
    from ..cli_args import CommandError

    if args.softmax_layers and args.layers == "full":
        raise CommandError("--softmax-layers picks among all the layers: use it with --layers all")


def run_model(args) -> None:
    check_hybrid(args)
    from ..cli_args import CommandError
    from ..config import ConfigError, make_method_config, parse_set_options
    from . import model

    methods = args.methods or list(model.DEFAULT_METHODS)
    options = parse_set_options(args.set or [], methods)
    variants = {}
    for name, method, pairs in args.variant or []:
        if name in variants or name in methods or name == model.SOFTMAX:
            raise CommandError(f"--variant {name}: the name is taken; give each model its own")
        extra = parse_set_options(pairs, flag=f"--variant {name}")
        try:
            make_method_config(method, **{**options, **extra})
        except ConfigError as e:
            raise CommandError(f"--variant {name}: {e}") from None
        variants[name] = {"method": method, "options": extra}
    wrote(model.bench(args.out, model=args.model, shape=args.shape or "smollm2", methods=methods,
                      options=options, quick=args.quick, profile=args.profile,
                      contexts=args.contexts, batches=args.batches, batch_context=args.batch_context,
                      decode_steps=args.decode_steps, prefill_chunk=args.prefill_chunk, teacher_max=args.teacher_max,
                      time_limit=args.time_limit, compile_decode=args.compile_decode, layers=args.layers,
                      softmax_layers=args.softmax_layers, variants=variants or None))


def run_serve(args) -> None:
    from ..cli_args import CommandError

    for scenario, flags in SCENARIO_FLAGS.items():
        given = [f"--{flag.replace('_', '-')}" for flag in flags if getattr(args, flag) is not None]
        if scenario != args.scenario and given:
            raise CommandError(f"{given[0]} belongs to --scenario {scenario}, not --scenario {args.scenario}")
    check_hybrid(args)
    import torch

    from ..config import parse_set_options
    from . import model, serve

    if not args.quick and not torch.cuda.is_available():
        raise CommandError("bench serve serves thousands of long prompts, hours on a CPU, and there is no CUDA device "
                           "here: pass --quick for tiny sizes")
    methods = args.methods or list(model.DEFAULT_METHODS)
    options = parse_set_options(args.set or [], methods)
    if args.scenario == "chat":
        from . import chat

        wrote(chat.bench(args.out, model=args.model, shape=args.shape or "smollm2", methods=methods, options=options,
                         quick=args.quick, conversations=args.conversations, turns=args.turns,
                         system_tokens=args.system_tokens, user_tokens=args.user_tokens,
                         target_context=args.target_context, max_tokens=args.max_tokens, max_batch=args.max_batch,
                         prefill_chunk=args.prefill_chunk, prefill_budget=args.prefill_budget,
                         prefix_block=args.prefix_block, prefix_cache_bytes=args.prefix_cache_memory,
                         prefix_cache_host_bytes=args.prefix_cache_host_memory,
                         time_limit=args.time_limit, layers=args.layers, softmax_layers=args.softmax_layers))
        return
    wrote(serve.bench(args.out, model=args.model, shape=args.shape or "smollm2", methods=methods, options=options,
                      quick=args.quick, clients=args.clients, prompt_lengths=args.prompt_lengths,
                      max_tokens=args.max_tokens, max_batch=args.max_batch, prefill_chunk=args.prefill_chunk,
                      prefill_budget=args.prefill_budget, time_limit=args.time_limit, layers=args.layers,
                      softmax_layers=args.softmax_layers))


def run_train(args) -> None:
    import torch

    from ..cli_args import CommandError
    from ..config import parse_set_options
    from . import train

    if args.shape and SHAPES[args.shape].needs_gpu and not torch.cuda.is_available():
        raise CommandError(f"bench train --shape {args.shape} builds a model of billions of parameters, which needs a "
                           "GPU, and there is no CUDA device here: use --shape smollm2 or --model")
    options = parse_set_options(args.set or [], [args.method])
    wrote(train.bench(args.out, model=args.model, shape=args.shape, method=args.method, options=options,
                      modes=args.modes, quick=args.quick, profile=args.profile, cuda_graph=args.cuda_graph,
                      seq_lens=args.seq_lens or ([args.seq_len] if args.seq_len else None),
                      tokens_per_step=args.tokens_per_step, batch=args.batch, steps=args.steps,
                      checkpointing=args.gradient_checkpointing, time_limit=args.time_limit))
