"""Times STILL's prefill at a model shape under each kernel block size (`linearize.ops.still.KERNEL_BLOCK`)
and each tiling of its forward kernel (`linearize.ops.still.triton.forward_launch`).

    python -m experiments.scripts.time_still_block [--shape llama3-8b] [--blocks 8192,4096,2048,1024]
        [--tiles 32x32/4/3,64x64/8/2] [--contexts 16k,128k] [--chunk 16k]

A continued call without gradients runs STILL's kernels in blocks of KERNEL_BLOCK tokens, each
continuing the state the previous one left (a fresh one runs the chunked kernel, `chunk_triton`,
whatever the block size: only the calls after the first `--chunk` tokens depend on it). A block's attention covers its own tokens and the carried keys (at most
the budget), so its cost grows with the block's square: smaller blocks do less attention work but
route and launch more often. A tiling is queries a program x keys a step / warps / stages. This prints,
for each block size and tiling, the batch-1 prefill time of each context (in calls of `--chunk` tokens
continuing the cache, as `linearize bench model` prefills), and the largest difference of the last
position's logits from the first combination's, which must stay at rounding level: every one computes
the same function. Needs a GPU (elsewhere the kernels do not run and the PyTorch form is timed).
"""

from __future__ import annotations

import argparse
import functools

import torch

import linearize.ops.still as still_ops
import linearize.ops.still.triton as still_triton
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
    parser.add_argument("--tiles", default="", help="e.g. 32x32/4/3,64x64/8/2 (default: the kernel's own)")
    parser.add_argument("--contexts", default="16k,128k")
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
    tilings = [None] + [tiling(t) for t in args.tiles.split(",") if t]
    kept = still_ops.KERNEL_BLOCK, still_triton.forward_launch
    try:
        for context in parse_sizes(args.contexts):
            ids = torch.randint(model.config.vocab_size, (1, context), device=device)
            first = None
            for block in blocks:
                for launch in tilings:
                    still_ops.KERNEL_BLOCK = block
                    still_triton.forward_launch = kept[1] if launch is None else functools.partial(fixed, launch)
                    out = {}
                    with torch.no_grad():
                        prefill(model, ids[:, :2 * chunk], chunk)  # warm-up: a fresh and a continued call
                        ms = wall_ms(functools.partial(timed, out, model, ids, chunk), device)
                    first = out["logits"] if first is None else first
                    diff = (out["logits"] - first).abs().max().item() / first.abs().max().item()
                    shown = "default" if launch is None else "{BM}x{BN}/{num_warps}/{num_stages}".format(**launch)
                    print(f"  context {size_label(context):>5}  block {block:>5}  tiles {shown:>10}  prefill {ms:9.1f} ms"
                          f"  logits vs the first: {diff:.1e} (relative to the largest)", flush=True)
    finally:
        still_ops.KERNEL_BLOCK, still_triton.forward_launch = kept


def tiling(text: str) -> dict:
    """"64x32/8/3" -> the launch options `forward_launch` returns."""
    tiles, warps, stages = text.split("/")
    rows, columns = tiles.split("x")
    return {"BM": int(rows), "BN": int(columns), "num_warps": int(warps), "num_stages": int(stages)}


def fixed(launch: dict, dtype, D, F, device=None, **_) -> dict:
    return launch

if __name__ == "__main__":
    main()
