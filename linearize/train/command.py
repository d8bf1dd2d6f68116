"""`linearize distill`: the CLI face of `linearize.train.distill`."""

from __future__ import annotations

import argparse
import json
import math


def _lrs(text: str) -> tuple[float, float | None]:
    try:
        parts = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LR or LR1,LR2, got {text!r}") from None
    if len(parts) not in (1, 2) or not all(math.isfinite(x) and x > 0 for x in parts):
        raise argparse.ArgumentTypeError(f"expected one or two positive learning rates, got {text!r}")
    return parts[0], parts[-1] if len(parts) == 2 else None


def _softmax_by(text: str) -> str:
    from .config import parse_softmax_by

    try:
        rule, count = parse_softmax_by(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return f"{rule}:{count}"


def _checked_float(check: str, expected: str):
    """An argparse type: a float that `config.<check>` accepts, else the one line `expected ..., got TEXT`."""

    def parse(text: str) -> float:
        from . import config

        try:
            value = float(text)
            getattr(config, check)(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        return value

    return parse


_recall_share = _checked_float("check_recall_share", "a share of the training tokens, at least 0 and below 1 (e.g. 0.2)")
_far_weight = _checked_float("check_far_weight", "a number at least 0 (e.g. 4; 0: every position alike)")


def register(subparsers) -> None:
    from ..cli_args import StoreGiven, add_method_arguments, non_negative_int, parse_int_list, positive_int, seed
    from ..config import LAYER_CHOICES, LAYERS_HELP, PRESETS

    p = subparsers.add_parser("distill", help="distil a teacher into a linearized student (stage 1 + stage 2)")
    p.add_argument("--model", required=True, help="teacher: smollm2 or gemma3 (aliases), a .gguf file, a HF folder or a hub id")
    add_method_arguments(p, ["lizard", "still", "lolcats", "liger"], PRESETS)
    p.add_argument("--data", default="default", help="default, a HF dataset name, .jsonl/.txt files or folders")
    p.add_argument("--recall-share", type=_recall_share, default=0.0, metavar="SHARE",
                   help="share of each stage's training tokens given to seeded synthetic recall documents "
                        "(key-value lists, passkeys, multi-key needles in filler and in the data's own text, "
                        "each question followed by its answer), e.g. 0.2 (default 0: the data alone)")
    p.add_argument("--far-weight", type=_far_weight, default=0.0, metavar="W",
                   help="stage 1: weight each position's attention-transfer error by 1 + W x the teacher's "
                        "attention mass beyond the method's window (mean over heads), normalised to mean 1 a "
                        "sequence, e.g. 4 (default 0: every position alike)")
    p.add_argument("--out", required=True, help="run directory; ends up holding the distilled model")
    p.add_argument("--stage", default="both", choices=["1", "2", "both"],
                   help="1: attention transfer (the new attention's parameters learn the teacher's outputs), "
                        "2: LoRA fine-tune on next-token loss, or both in turn")
    p.add_argument("--max-tokens", type=positive_int, default=20_000_000, help="training tokens per stage")
    p.add_argument("--seq-len", type=positive_int, default=2048, help="tokens per training sequence")
    p.add_argument("--batch", type=positive_int, default=8, help="sequences per optimizer step (global)")
    p.add_argument("--grad-accum", type=positive_int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--lr", type=_lrs, default=None, help="stage learning rate(s): LR, or LR1,LR2 for both stages "
                   "(default: the papers', 1e-3 for stage 1 and 5e-4 for stage 2)")
    p.add_argument("--head-lr-scale", type=float, default=1.0, action=StoreGiven,
                   help="stage-1 lr multiplier of the per-head scalars (Lizard: alpha, sinks, gate bias)")
    p.add_argument("--softmax-layers", type=parse_int_list, default=[],
                   help="layers that keep softmax attention, e.g. 0,4 (default: none)")
    p.add_argument("--layers", choices=LAYER_CHOICES, default="all", help=LAYERS_HELP)
    p.add_argument("--softmax-by", type=_softmax_by, default=None, metavar="RULE:N",
                   help="keep N more of the linearized layers softmax, chosen by RULE: error (after stage 1, the N "
                        "with the highest stage-1 error), kl (after stage 1, the N whose restoring to softmax "
                        "brings the output distribution closest to the teacher's, KL-guided selection) or even "
                        "(before training, N evenly spaced); e.g. kl:2")
    p.add_argument("--kl-train-steps", type=non_negative_int, default=0, metavar="K",
                   help="with --softmax-by kl:N, train each candidate (the student with that one layer softmax) "
                        "K LoRA steps on the KL to the teacher before scoring it, as the method does "
                        "(default 0: score the stage-1 student as it is)")
    p.add_argument("--kl-seq-len", type=non_negative_int, default=0, metavar="L",
                   help="with --softmax-by kl:N, score the candidates on validation sequences of L tokens (default "
                        "0: --seq-len); past STILL's softmax budget, where its linear part counts")
    p.add_argument("--stage1-from", metavar="DIR", default=None,
                   help="take the finished stage 1 of the run in DIR (trained with this run's stage-1 settings) "
                        "instead of training one: hybrids that differ only in --softmax-by share it, and with "
                        "kl:N its candidate scores")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a method option (repeatable)")
    p.add_argument("--save-every", type=positive_int, default=100, help="optimizer steps between checkpoints")
    p.add_argument("--eval-every", type=positive_int, default=100, help="optimizer steps between validations")
    p.add_argument("--no-fsdp", dest="fsdp", action="store_false",
                   help="multi-GPU stage 2: a whole replica on every rank, gradients averaged in one all-reduce "
                        "a step (no FSDP2; with --cuda-graph the steps replay from graphs)")
    p.add_argument("--no-fsdp-reshard", dest="fsdp_reshard", action="store_false",
                   help="multi-GPU stage 2: keep each layer's weights gathered from forward to backward")
    p.add_argument("--fsdp-replicate", action="store_true",
                   help="multi-GPU stage 2: whole weights on every rank (HSDP, shards of one), gradients all-reduced")
    p.add_argument("--gradient-checkpointing", action="store_true", help="recompute layers in backward to save memory")
    p.add_argument("--cuda-graph", action="store_true",
                   help="capture an optimizer step as a CUDA graph and replay it (fewer host launches); "
                        "under torchrun where FSDP2 does not shard (stage 1, stage 2 with --no-fsdp)")
    p.add_argument("--seed", type=seed, default=0)
    p.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda when available)")
    p.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp32"],
                   help="auto: bf16 autocast on CUDA, float32 on a CPU")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    p.set_defaults(func=run)


def config_from_args(args):
    from ..config import parse_set_options
    from .config import DistillConfig

    options = parse_set_options(args.set or [])  # checked against the method once, by DistillConfig
    lrs = {}
    if args.lr is not None:
        first, second = args.lr
        if args.stage == "2":
            lrs["lr_stage2"] = first
        else:
            lrs["lr_stage1"] = first
            if second is not None:
                lrs["lr_stage2"] = second
    return DistillConfig(model=args.model, method=args.method, out=args.out, data=args.data, recall_share=args.recall_share,
                         far_weight=args.far_weight,
                         stage=args.stage,
                         max_tokens=args.max_tokens, seq_len=args.seq_len, batch=args.batch,
                         grad_accum=args.grad_accum, head_lr_scale=args.head_lr_scale, options=options,
                         softmax_layers=args.softmax_layers, softmax_by=args.softmax_by,
                         kl_train_steps=args.kl_train_steps, kl_seq_len=args.kl_seq_len, stage1_from=args.stage1_from,
                         layers=args.layers,
                         save_every=args.save_every, eval_every=args.eval_every, seed=args.seed, device=args.device,
                         gradient_checkpointing=args.gradient_checkpointing, fsdp=args.fsdp,
                         fsdp_reshard=args.fsdp_reshard, fsdp_replicate=args.fsdp_replicate, cuda_graph=args.cuda_graph,
                         precision=args.precision, **lrs)


def run(args) -> None:
    from ..cli_args import check_device, check_writable_parent
    from .distillation import distill
    from .run_dir import LAYER_ERRORS_NAME, is_finished

    cfg = config_from_args(args)
    check_device(args.device)
    check_writable_parent(args.out)
    finished = args.resume and is_finished(args.out)
    out = distill(cfg, resume=args.resume)
    if finished:
        print(f"{out} already holds the finished distilled {args.method} model: nothing to resume")
    else:
        print(f"distilled {args.method} model written to {out}")
    record = out / LAYER_ERRORS_NAME
    picked = json.loads(record.read_text()).get("picked") if cfg.softmax_by and record.exists() else None
    if picked:
        print(f"kept softmax by {cfg.softmax_by}: layer{'s' if len(picked) > 1 else ''} "
              f"{', '.join(map(str, picked))} (the scores: {record}; their figure: {record.with_suffix('.png')})")
