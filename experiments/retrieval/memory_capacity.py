"""How many key-value pairs a constant-size state gives back: the delta-rule memory against an additive
linear state, with no training, at one head's size.

    python experiments/retrieval/memory_capacity.py --out docs/results/cpu/memory-capacity/capacity.json

Two scenarios, each written in order into each state and read back by its keys as queries; a pair
counts as recalled when the read-out's nearest value (by cosine, among every distinct value written)
is its own: the retrieval a passkey needs once the key has left the softmax window.

  distinct  N pairs, random Gaussian keys and values (d_k = d_v = head dim): every pair is read back
  haystack  N filler pairs cycling through 8 (key, value) pairs whose keys share one direction (a
            mean plus a third as much noise: repeated filler text), with 4 needles of random keys at
            random places: only the needles are read back

  delta     `chunk_delta_rule` (linearize.ops.delta_rule), a = 1 (no decay), write strength b; keys
            L2-normalised in the op: a write replaces what the state held along its key
  sum       S = sum_t k_t v_t^T on the same unit keys, read S^T q: the delta rule without its correction
            (each write added on top of what the state holds along its key)
  additive  S = sum_t phi(k_t) v_t^T read as S^T phi(q) / (phi(q) . sum_t phi(k_t)), phi = elu + 1: a
            normalised linear-attention state with positive features, whose keys all overlap

Writes OUT (every cell) and OUT with .md (recall by N, per memory); seeded, CPU, a few seconds.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from linearize.cli_args import write_json_and_markdown
from linearize.ops.delta_rule import DeltaRuleOptions, chunk_delta_rule

FORMAT = "linearize-memory-capacity/1"


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="results JSON; the Markdown table goes next to it")
    parser.add_argument("--dim", type=int, default=64, help="head dim d_k = d_v (SmolLM2's and Gemma-3-270M's: 64)")
    parser.add_argument("--pairs", default="8,16,32,64,128,256,1024,4096", help="comma-separated N")
    parser.add_argument("--strengths", default="1.0,0.5", help="the delta rule's write strengths b")
    parser.add_argument("--trials", type=int, default=8, help="seeded draws per N")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        args.pairs = [int(n) for n in args.pairs.split(",")]
        args.strengths = [float(b) for b in args.strengths.split(",")]
    except ValueError as e:
        parser.error(f"--pairs/--strengths: {e}")
    if args.dim < 1 or args.trials < 1 or min(args.pairs) < 1 or not all(0 < b <= 1 for b in args.strengths):
        parser.error("--dim, --trials and every N must be positive, every strength in (0, 1]")
    return args


def delta_read(keys, values, strength: float) -> torch.Tensor:
    N = len(keys)
    q, k, v = keys[None, None], keys[None, None], values[None, None]  # [1, 1, N, d]
    log_a, b = torch.zeros(1, 1, N), torch.full((1, 1, N), strength)
    _, state = chunk_delta_rule(q, k, v, log_a, b, DeltaRuleOptions(), output_final_state=True)
    return F.normalize(keys, dim=-1) @ state["S"][0, 0]


def sum_read(keys, values) -> torch.Tensor:
    unit = F.normalize(keys, dim=-1)
    return unit @ (unit.T @ values)


def additive_read(keys, values) -> torch.Tensor:
    phi = F.elu(keys) + 1
    S, z = phi.T @ values, phi.sum(0)
    return (phi @ S) / (phi @ z)[:, None]


NEEDLES, FILLER_KINDS = 4, 8


def distinct(n, dim, generator):
    """(keys, values, which pairs to read back, the distinct values) of N random pairs."""
    keys, values = (torch.randn(n, dim, generator=generator, dtype=torch.float64) for _ in range(2))
    return keys, values, torch.arange(n), values


def haystack(n, dim, generator):
    """N filler pairs of FILLER_KINDS kinds sharing a key direction, and NEEDLES random pairs among them."""
    mean = torch.randn(dim, generator=generator, dtype=torch.float64)
    kinds_k = mean + torch.randn(FILLER_KINDS, dim, generator=generator, dtype=torch.float64) / 3
    kinds_v = torch.randn(FILLER_KINDS, dim, generator=generator, dtype=torch.float64)
    needle_k, needle_v = (torch.randn(NEEDLES, dim, generator=generator, dtype=torch.float64) for _ in range(2))
    order = torch.arange(n + NEEDLES) % FILLER_KINDS
    places = torch.randperm(n + NEEDLES, generator=generator)[:NEEDLES].sort().values
    keys, values = kinds_k[order], kinds_v[order]
    keys[places], values[places] = needle_k, needle_v
    return keys, values, places, torch.cat([needle_v, kinds_v])


def recalled_at(read, values, asked, candidates) -> float:
    """Share of the asked pairs whose read-out is nearest their own value among `candidates`."""
    nearest = (F.normalize(read[asked], dim=-1) @ F.normalize(candidates, dim=-1).T).argmax(-1)
    own = (F.normalize(values[asked], dim=-1) @ F.normalize(candidates, dim=-1).T).argmax(-1)
    return (nearest == own).float().mean().item()


def run(args) -> dict:
    cells = []
    for scenario, make in (("distinct", distinct), ("haystack", haystack)):
        for n in args.pairs:
            for trial in range(args.trials):
                generator = torch.Generator().manual_seed(args.seed * 1_000_003 + n * 1_009 + trial)
                keys, values, asked, candidates = make(n, args.dim, generator)
                reads = {f"delta b={b:g}": delta_read(keys, values, b) for b in args.strengths}
                reads["sum"] = sum_read(keys, values)
                reads["additive"] = additive_read(keys, values)
                cells += [{"scenario": scenario, "pairs": n, "trial": trial, "memory": name,
                           "recalled": recalled_at(read, values, asked, candidates)} for name, read in reads.items()]
    return {"format": FORMAT, "settings": {k: v for k, v in vars(args).items() if k != "out"} | {
        "command": "python " + " ".join(["experiments/retrieval/memory_capacity.py", *sys.argv[1:]]),
        "started_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}, "cells": cells}


def table(results: dict) -> str:
    settings, cells = results["settings"], results["cells"]
    memories = list(dict.fromkeys(c["memory"] for c in cells))
    pairs = list(dict.fromkeys(c["pairs"] for c in cells))

    def mean(scenario, memory, n):
        got = [c["recalled"] for c in cells if (c["scenario"], c["memory"], c["pairs"]) == (scenario, memory, n)]
        return sum(got) / len(got)

    lines = [f"# Pairs recalled from one state of {settings['dim']} x {settings['dim']}", "",
             (f"Share of the pairs read back whose read-out is nearest their own value, mean of {settings['trials']} "
              f"seeded draws (docstring of the script: the scenarios and memories). Command: `{settings['command']}`.")]
    for scenario, what in (("distinct", "N random pairs, all read back"),
                           ("haystack", f"{NEEDLES} random needles among N filler pairs of shared key direction")):
        lines += ["", f"## {scenario}: {what}", "", "| memory | " + " | ".join(f"N={n}" for n in pairs) + " |",
                  "|---|" + "---|" * len(pairs)]
        lines += [f"| {m} | " + " | ".join(f"{mean(scenario, m, n):.2f}" for n in pairs) + " |" for m in memories]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    results = run(args)
    write_json_and_markdown(args.out, results, table(results))
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
