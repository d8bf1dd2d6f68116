"""Which attention can learn, from scratch, to recall a fact once it has left the softmax window: tiny
models trained on a synthetic associative-recall task, recall accuracy by how far back the fact lies.

    python experiments/retrieval/toy_recall.py --out docs/results/cpu/toy-recall/toy_recall.json

The task. A sequence is `--length` positions over a small vocabulary of filler, key and value tokens
(three disjoint sets). `--facts` positions each hold a fact: their input is the embedding of a key
(distinct within the sequence) plus that of a value (any). Later, one position each holds its query: the
key's embedding alone, and the target there is the value. Every other position is a random filler. The
loss is cross-entropy on the queries' outputs only, and accuracy is their argmax; nothing else in the
sequence can be predicted. A fact is one position so that the retrieval is one hop, a key matched and its
value read, as a memory stores it: written as two tokens (key, then value), even the softmax model
stayed on the plateau of "one of the values present" (loss log facts) for 600 steps at this size, since it
must first learn a previous-token head. The distance of a query is its position minus its fact's: inside
the window when < `--window`. Each query draws a distance bucket uniformly (`buckets`: half a window to
one, then 1-2, 2-4 and 4-7 windows), then a distance within it, then free places for both; so every bucket
gets a quarter of the queries. Each step draws fresh sequences (nothing to memorise); the evaluation is
one fixed seeded set drawn apart from the training's.

The models: one tiny Llama (`--layers`, `--hidden`, `--heads`, RoPE, SwiGLU MLP, tied embeddings), one
random initialisation (`--seed`), converted by `linearize.convert` and then trained whole (every
parameter, the converted attention's new ones included) with AdamW, the same steps, batches, learning
rate and schedule for each:

  softmax          the Llama as is: full causal softmax attention, the upper bound
  window           Lizard, window `--window`, 4 sinks, a scalar gate, no memory: past the window only its
                   gated linear state (Hedgehog features) can recall
  delta gate       + `memory="delta"`, the delta-rule memory decaying by Lizard's scalar gate
  delta a=0.9995   + `memory="delta"`, its own learned per-head decay starting at 0.9995
  delta a=0.99     the same starting at 0.99 (a 69-token half-life at the start)
  delta no gate    `gate="none"` + `memory="delta"`: neither the linear state nor the memory decays
                   (the memory gets no decay parameter without `memory_decay_init`)

Every Lizard here sets `rope_in_window=true` (as the `lizard-shared` preset does), so that inside the
window it sees positions as the softmax model does and the two differ in reach only; the rest are
LizardConfig's defaults at head dim 16: Hedgehog feature_dim 8 (16 features), gate bias 6 (gamma 0.9975),
alpha and mu from 0, chunk 64.

Writes OUT (settings, accuracy by bucket, losses, seconds per configuration) and OUT with .md (the table);
seeded, CPU.
"""

from __future__ import annotations

import argparse
import datetime
import math
import multiprocessing
import shlex
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F

from linearize.cli_args import write_json_and_markdown

FORMAT = "linearize-toy-recall/1"

# name -> Lizard options (None: the softmax model as is)
CONFIGS: dict[str, dict | None] = {
    "softmax": None,
    "window": {},
    "delta gate": {"memory": "delta"},
    "delta a=0.9995": {"memory": "delta", "memory_decay_init": 0.9995},
    "delta a=0.99": {"memory": "delta", "memory_decay_init": 0.99},
    "delta no gate": {"memory": "delta", "gate": "none"},
}
LIZARD_COMMON = {"rope_in_window": True}


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="results JSON; the Markdown table goes next to it")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of: {', '.join(CONFIGS)}")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW's peak, after a 5%% warm-up, cosine to 10%%")
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--window", type=int, default=32)
    parser.add_argument("--facts", type=int, default=16, help="facts (and so queries) per sequence")
    parser.add_argument("--keys", type=int, default=32, help="key tokens in the vocabulary")
    parser.add_argument("--values", type=int, default=32, help="value tokens in the vocabulary")
    parser.add_argument("--fillers", type=int, default=32, help="filler tokens in the vocabulary")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--eval-sequences", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=1,
                        help="configurations trained at once, one process and one thread each (same results)")
    args = parser.parse_args(argv)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown or not args.configs:
        parser.error(f"--configs: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(CONFIGS)}")
    if min(args.steps, args.batch, args.jobs, args.facts, args.eval_sequences, args.layers, args.heads) < 1 or args.lr <= 0:
        parser.error("--steps, --batch, --facts, --eval-sequences, --layers, --heads and --lr must be positive")
    if args.window < 2 or args.hidden % args.heads:
        parser.error("--length must be even, --window at least 2, --hidden a multiple of --heads")
    if args.facts > args.keys or 4 * args.facts > args.length or buckets(args.window)[-1][1] > args.length - 2:
        parser.error("--facts needs as many --keys and room for its slots; the farthest bucket "
                     f"({buckets(args.window)[-1][1]}) must fit in --length")
    return args


def buckets(window: int) -> list[tuple[int, int]]:
    """Distance ranges [lo, hi): half a window to one (inside it), then 1-2, 2-4 and 4-7 windows past."""
    return [(window // 2, window), (window, 2 * window), (2 * window, 4 * window), (4 * window, 7 * window)]


def bucket_name(bounds: tuple[int, int], window: int) -> str:
    return f"{bounds[0] / window:g}-{bounds[1] / window:g}W"


def vocabulary(args) -> tuple[range, range, range]:
    """(fillers, keys, values): disjoint token ranges."""
    return (range(args.fillers), range(args.fillers, args.fillers + args.keys),
            range(args.fillers + args.keys, args.fillers + args.keys + args.values))


def draw_batch(args, n: int, generator: torch.Generator):
    """(tokens [n, length], the value written at each fact's position, -1 elsewhere [n, length], query
    positions [n, facts], their targets [n, facts], distances [n, facts])."""
    fillers, keys, values = vocabulary(args)
    spans = buckets(args.window)
    tokens = torch.randint(fillers.start, fillers.stop, (n, args.length), generator=generator)
    written = torch.full((n, args.length), -1, dtype=torch.long)
    where = torch.zeros(n, args.facts, dtype=torch.long)
    target = torch.zeros(n, args.facts, dtype=torch.long)
    distance = torch.zeros(n, args.facts, dtype=torch.long)
    for row in range(n):
        fact_keys = torch.randperm(len(keys), generator=generator)[:args.facts] + keys.start
        fact_values = torch.randint(values.start, values.stop, (args.facts,), generator=generator)
        taken = set()
        for i in range(args.facts):
            while True:  # rejection: a bucket, a distance in it, a free fact position and query position
                lo, hi = spans[int(torch.randint(len(spans), (), generator=generator))]
                d = int(torch.randint(lo, hi, (), generator=generator))
                fact = int(torch.randint(args.length - d, (), generator=generator))
                if fact not in taken and fact + d not in taken:
                    break
            taken |= {fact, fact + d}
            tokens[row, fact], written[row, fact] = fact_keys[i], fact_values[i]
            tokens[row, fact + d] = fact_keys[i]
            where[row, i], target[row, i], distance[row, i] = fact + d, fact_values[i], d
    return tokens, written, where, target, distance


def build(args, options: dict | None):
    """The tiny Llama from `--seed`, converted to Lizard with `options` (None: left softmax)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import linearize

    config = LlamaConfig(vocab_size=args.fillers + args.keys + args.values, hidden_size=args.hidden,
                         intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.heads,
                         max_position_embeddings=args.length, tie_word_embeddings=True)
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
    if options is not None:
        linearize.convert(model, "lizard", window=args.window, **LIZARD_COMMON, **options)
    for p in model.parameters():
        p.requires_grad_(True)
    return model


def answer_logits(model, tokens, written, where):
    """The logits at the queries [n, facts, vocab]. A fact's input is its key's embedding plus its value's."""
    embed = model.get_input_embeddings()
    inputs = embed(tokens) + embed(written.clamp(min=0)) * (written >= 0)[..., None]
    logits = model(inputs_embeds=inputs).logits
    return logits.gather(1, where[..., None].expand(-1, -1, logits.shape[-1]))  # [n, facts, vocab]


def learning_rate(args, step: int) -> float:
    warm = max(1, args.steps // 20)
    if step < warm:
        return args.lr * (step + 1) / warm
    done = (step - warm) / max(1, args.steps - warm)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done)))


def train_and_score(args, name: str, evaluation) -> dict:
    model = build(args, CONFIGS[name])
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    generator = torch.Generator().manual_seed(args.seed * 1_000_003 + 1)  # the same batches for every config
    losses, started = [], time.perf_counter()
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(args, step)
        tokens, written, where, target, _ = draw_batch(args, args.batch, generator)
        loss = F.cross_entropy(answer_logits(model, tokens, written, where).flatten(0, 1), target.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
    train_seconds = time.perf_counter() - started
    model.eval()
    tokens, written, where, target, distance = evaluation
    correct, eval_loss = [], 0.0
    with torch.no_grad():
        for lo in range(0, len(tokens), args.batch):
            part = slice(lo, lo + args.batch)
            logits = answer_logits(model, tokens[part], written[part], where[part])
            eval_loss += F.cross_entropy(logits.flatten(0, 1), target[part].flatten(), reduction="sum").item()
            correct.append(logits.argmax(-1) == target[part])
    correct = torch.cat(correct)
    by_bucket = {}
    for bounds in buckets(args.window):
        inside = (distance >= bounds[0]) & (distance < bounds[1])
        accuracy = correct[inside].float().mean().item() if inside.any() else None  # none drawn there
        by_bucket[bucket_name(bounds, args.window)] = {"accuracy": accuracy, "queries": int(inside.sum())}
    tail = losses[-max(1, args.steps // 10):]
    return {"config": name, "options": None if CONFIGS[name] is None else {**LIZARD_COMMON, **CONFIGS[name]},
            "parameters": sum(p.numel() for p in model.parameters()), "by_bucket": by_bucket,
            "accuracy": correct.float().mean().item(), "eval_loss": eval_loss / correct.numel(),
            "final_train_loss": sum(tail) / len(tail), "loss_curve": loss_curve(losses),
            "train_seconds": round(train_seconds, 1), **learned_scalars(model)}


def loss_curve(losses: list[float], points: int = 10) -> list[float]:
    """The training loss averaged over each of `points` equal stretches of the steps."""
    size = max(1, len(losses) // points)
    return [round(sum(part) / len(part), 4) for part in (losses[i:i + size] for i in range(0, len(losses), size))]


def learned_scalars(model) -> dict:
    """Per layer, the trained head scalars that say how the Lizard model reads: alpha (the window's weight),
    mu (the memory's), the memory's own decay a, and the gate's mean decay at its bias (sigmoid)."""
    found = {}
    for i, layer in enumerate(model.model.layers):
        attention = layer.self_attn
        for key, read in (("alpha", lambda a: a.alpha), ("mu", lambda a: a.memory_weight),
                          ("memory_decay", lambda a: torch.sigmoid(a.memory_decay)),
                          ("gate_bias_decay", lambda a: torch.sigmoid(a.gate.bias))):
            try:
                value = read(attention)
            except AttributeError:
                continue
            found.setdefault(key, []).append([round(x, 4) for x in value.detach().tolist()])
    return found


def report(got: dict) -> dict:
    """`got`, after printing its line to stderr."""
    print(f"{got['config']}: " + " ".join(f"{b} {cell(v['accuracy'])}" for b, v in got["by_bucket"].items())
          + f" loss {got['final_train_loss']:.3f} ({got['train_seconds']}s)", file=sys.stderr, flush=True)
    return got


def run(args, argv: list[str]) -> dict:
    evaluation = draw_batch(args, args.eval_sequences, torch.Generator().manual_seed(args.seed * 1_000_003 + 2))
    if args.jobs == 1:
        results = [report(train_and_score(args, name, evaluation)) for name in args.configs]
    else:
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(args.jobs, mp_context=context, initializer=torch.set_num_threads,
                                 initargs=(1,)) as pool:
            futures = [pool.submit(train_and_score, args, name, evaluation) for name in args.configs]
            results = [report(f.result()) for f in futures]
    settings = {k: v for k, v in vars(args).items() if k != "out"} | {
        "buckets": buckets(args.window), "loss": "query answers only",
        "command": "python " + shlex.join(["experiments/retrieval/toy_recall.py", *argv]),
        "started_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
    return {"format": FORMAT, "settings": settings, "results": results}


def table(results: dict) -> str:
    settings, rows = results["settings"], results["results"]
    window = settings["window"]
    names = [bucket_name(tuple(b), window) for b in settings["buckets"]]
    lines = [f"# Recall by distance, window {window}: tiny models trained from scratch", "",
             (f"Accuracy of the value asked for, on {settings['eval_sequences']} held-out sequences of "
              f"{settings['length']} tokens with {settings['facts']} facts each, by the distance from the query "
              f"back to its value in windows W = {window} (the first bucket inside the window). "
              f"{settings['layers']} layers, hidden {settings['hidden']}, {settings['heads']} heads; "
              f"{settings['steps']} AdamW steps of {settings['batch']} sequences at lr {settings['lr']:g}, loss on "
              f"the answers only; chance is 1/{settings['values']}. Configurations: the script's docstring. "
              f"Command: `{settings['command']}`."), "",
             "| config | " + " | ".join(names) + " | train loss | eval loss | seconds |",
             "|---|" + "---|" * (len(names) + 3)]
    for r in rows:
        lines.append(f"| {r['config']} | " + " | ".join(cell(r["by_bucket"][n]["accuracy"]) for n in names)
                     + f" | {r['final_train_loss']:.3f} | {r['eval_loss']:.3f} | {r['train_seconds']:g} |")
    return "\n".join(lines) + "\n"


def cell(accuracy: float | None) -> str:
    return "n/a" if accuracy is None else f"{accuracy:.2f}"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    results = run(args, argv)
    write_json_and_markdown(args.out, results, table(results))
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
