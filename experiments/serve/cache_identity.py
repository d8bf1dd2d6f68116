"""Whether a chat's greedy answers depend on the engine's prefix cache, by dtype: the same small chat
(`bench serve --scenario chat`'s conversations, quick sizes) served with the cache on and off on one
random-weight Lizard of the SmolLM2 shape, each conversation's answers compared.

    PYTHONPATH=. python -m experiments.serve.cache_identity [--dtypes float32,bfloat16,float64] [--layers 2]
        [--window 16]

With the cache a prompt is prefilled in other pieces (restored at a block boundary, then continued); in
exact arithmetic that changes nothing, in rounding it may, and random weights give near-tied logits that
greedy decoding turns into different tokens.
"""

from __future__ import annotations

import argparse
import sys

import torch

import linearize
from linearize.bench import chat
from linearize.bench.shapes import random_model

CHAT = {"system_tokens": 64, "target_context": 384, "max_tokens": 8, "prefix_block": 32, "prefill_chunk": 64}


def same_answers(dtype: torch.dtype, layers: int, window: int) -> list[bool]:
    """Per conversation: the same answers with the cache on as off."""
    settings = chat.settings_for(True, CHAT)
    model = random_model("smollm2", dtype=dtype, num_hidden_layers=layers)
    linearize.convert(model, "lizard", combine="shared", rope_in_window=True, window=window)
    model.eval()
    on, off = (chat.run_chat(model, settings=settings, prefix_cache=cache, device=torch.device("cpu"))
               for cache in (True, False))
    return [a == b for a, b in zip(on["answers_sha256"], off["answers_sha256"], strict=True)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.serve.cache_identity", description=__doc__.split("\n\n")[0])
    p.add_argument("--dtypes", default="float32,bfloat16,float64")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--window", type=int, default=16)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    print("| dtype | conversations answering the same with the cache on and off |\n|---|---|")
    for name in args.dtypes.split(","):
        same = same_answers(getattr(torch, name), args.layers, args.window)
        print(f"| {name} | {sum(same)} of {len(same)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
