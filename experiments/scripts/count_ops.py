"""Counts the PyTorch ops one decoder layer dispatches, in a prompt's prefill and in one decode step,
at SmolLM2's shape with random weights, on this machine (the count does not depend on the device).

    python experiments/scripts/count_ops.py [--methods softmax,lizard,still] [--tokens 4096]

An eager pass pays Python and launch overhead per op on any device; a CUDA graph replays the
kernels without it. Views (reshape, slice, ...) are counted apart: they launch no kernel. Each
count is the difference between a 2-layer and a 1-layer model, so the embedding and the head drop
out. Where a GPU would run STILL's fresh pass through its Triton kernels, the kernel call is
replaced by a one-op stand-in (`--kernel-path`, the default), so the count is of the PyTorch ops
around it, as the GPU dispatches them; without it, a CPU's PyTorch form.
"""

from __future__ import annotations

import argparse

import torch
from transformers import DynamicCache

import linearize.ops.still
import linearize.ops.still.triton
from linearize.bench.common import OpCount
from linearize.bench.model import random_model
from linearize.convert import convert
from linearize.fused_projections import fuse_projections


def counts(method: str, layers: int, tokens: int) -> tuple[OpCount, OpCount]:
    model = random_model("smollm2", num_hidden_layers=layers).eval()
    if method != "softmax":
        convert(model, method)
        fuse_projections(model)
    ids = torch.randint(model.config.vocab_size, (1, tokens + 1))
    prefill, step = OpCount(), OpCount()
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        with prefill:
            model(input_ids=ids[:, :-1], past_key_values=cache, use_cache=True, logits_to_keep=1)
        with step:
            model(input_ids=ids[:, -1:], past_key_values=cache, use_cache=True, logits_to_keep=1)
    return prefill, step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="softmax,lizard,still")
    parser.add_argument("--tokens", type=int, default=4096, help="prompt length of the prefill")
    parser.add_argument("--no-kernel-path", dest="kernel_path", action="store_false")
    args = parser.parse_args()
    if args.kernel_path:
        linearize.ops.still.triton.supports = lambda *a, **k: None
        linearize.ops.still.triton.still_attention_triton = lambda q, *a, **k: q.clone()
    print(f"ops a layer, SmolLM2 shape, a {args.tokens}-token prefill and one decode step after it "
          f"(STILL's kernel path: {args.kernel_path})")
    for method in args.methods.split(","):
        (p1, s1), (p2, s2) = counts(method, 1, args.tokens), counts(method, 2, args.tokens)
        print(f"{method}: prefill {p2.ops - p1.ops} ops ({p2.views - p1.views} views), "
              f"decode step {s2.ops - s1.ops} ops ({s2.views - s1.views} views)")


if __name__ == "__main__":
    main()
