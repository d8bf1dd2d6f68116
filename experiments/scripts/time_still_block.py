"""Times STILL's prefill at a model shape under each kernel block size (`linearize.ops.still.KERNEL_BLOCK`).

    python -m experiments.scripts.time_still_block [--shape llama3-8b] [--blocks 1024,2048,4096,8192]
        [--contexts 16k,128k] [--chunk 16k]

A call without gradients runs STILL's kernels in blocks of KERNEL_BLOCK tokens, each continuing the
state the previous one left. A block's attention covers its own tokens and the carried keys (at most
the budget), so its cost grows with the block's square: smaller blocks do less attention work but
route and launch more often. This prints, for each block size, the batch-1 prefill time of each
context (in calls of `--chunk` tokens continuing the cache, as `linearize bench model` prefills), and
the largest difference of the last position's logits from the first block size's, which must stay at
rounding level: every block size computes the same function.
"""

from __future__ import annotations

import argparse
import functools

import torch

import linearize.ops.still as still_ops
from linearize.bench.common import default_device, parse_sizes, size_label, wall_ms
from linearize.bench.shapes import random_model
from linearize.convert import convert


def prefill(model, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    """Last position's logits after prefilling `ids` in calls of `chunk` tokens continuing the cache."""
    cache = None
    for start in range(0, ids.shape[1], chunk):
        out = model(input_ids=ids[:, start:start + chunk], past_key_values=cache, use_cache=True, logits_to_keep=1)
        cache = out.past_key_values
    return out.logits[:, -1].float()


def timed(out: dict, model, ids: torch.Tensor, chunk: int) -> None:
    out["logits"] = prefill(model, ids, chunk)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama3-8b")
    parser.add_argument("--blocks", default="8192,4096,2048,1024")
    parser.add_argument("--contexts", default="16k,128k", help="joined by , or +")
    parser.add_argument("--chunk", default="16k")
    args = parser.parse_args()
    device = default_device()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = random_model(args.shape, device=device, dtype=dtype)
    convert(model, "still")
    model.eval()
    chunk = parse_sizes(args.chunk)[0]
    blocks = [int(b) for b in args.blocks.split(",")]
    print(f"{torch.cuda.get_device_name() if device.type == 'cuda' else device}, shape {args.shape}, "
          f"calls of {size_label(chunk)} tokens, batch 1")
    kept = still_ops.KERNEL_BLOCK
    try:
        for context in parse_sizes(args.contexts.replace("+", ",")):
            ids = torch.randint(model.config.vocab_size, (1, context), device=device)
            first = None
            for block in blocks:
                still_ops.KERNEL_BLOCK = block
                out = {}
                with torch.no_grad():
                    prefill(model, ids[:, :2 * chunk], chunk)  # warm-up: a fresh and a continued call
                    ms = wall_ms(functools.partial(timed, out, model, ids, chunk), device)
                logits = out["logits"]
                first = logits if first is None else first
                diff = (logits - first).abs().max().item() / first.abs().max().item()
                print(f"  context {size_label(context):>5}  block {block:>5}  prefill {ms:9.1f} ms  "
                      f"logits vs block {blocks[0]}: {diff:.1e} (relative to the largest)", flush=True)
    finally:
        still_ops.KERNEL_BLOCK = kept


if __name__ == "__main__":
    main()
