"""Times STILL's attention alone in a fresh pass without gradients (a prompt's prefill) at a model's
shape: the chunked form's kernel (`linearize.ops.still.chunk_triton`, its PyTorch preparation
included), the one-pass kernel that walks every key up to each query (`linearize.ops.still.triton`),
and causal SDPA on the same q, k, v; the routing (`fresh_routing`, which gives the fold times both
STILL kernels read) timed apart.

    python -m experiments.scripts.time_still_chunk_kernel [--contexts 4k,16k] [--heads 32] [--kv-heads 8]
        [--head-dim 128] [--features 128] [--tiles 32x32x32/4/2,64x32x16/8/2]

Batch 1, bf16, STILL's default budget (window 128, 768 salient slots, routing chunks of 64, 48 picks
a chunk). A tiling is queries a block x keys a step x feature rows a step / warps / stages
(`chunk_launch`'s keys; default: its own). Prints median ms over CUDA events after warm-up, and the
chunked kernel's largest difference from the one-pass kernel's y relative to the largest value, which
must stay at rounding level. Needs a GPU (elsewhere it runs in the interpreter under
TRITON_INTERPRET=1, slowly, for a smoke test at small sizes).
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.nn.functional as F

from linearize.bench.common import default_device, parse_sizes, size_label, time_ms
from linearize.ops.still import StillOptions, init_state
from linearize.ops.still.chunk_triton import still_chunk_triton
from linearize.ops.still.routing import fresh_routing
from linearize.ops.still.triton import still_attention_triton

WINDOW, SLOTS, CHUNK, PER_CHUNK = 128, 768, 64, 48


def tiling(text: str) -> dict:
    """"32x32x32/4/2" -> the launch options `chunk_launch` returns."""
    tiles, warps, stages = text.split("/")
    C, BN, BF = (int(n) for n in tiles.split("x"))
    return {"C": C, "BN": BN, "BF": BF, "num_warps": int(warps), "num_stages": int(stages)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="4k,16k")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--features", type=int, default=128)
    parser.add_argument("--tiles", default="", help="e.g. 32x32x32/4/2,64x32x16/8/2 (default: the kernel's own)")
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    device = default_device()
    dtype = torch.bfloat16
    H, Hkv, D, Fd = args.heads, args.kv_heads, args.head_dim, args.features
    options = StillOptions(window=WINDOW, chunk=CHUNK, per_chunk=PER_CHUNK, routing="saliency", scale=D**-0.5)
    print(f"{torch.cuda.get_device_name() if device.type == 'cuda' else device}, batch 1, H {H}, H_kv {Hkv}, "
          f"d {D}, F {Fd}, bf16, window {WINDOW}, slots {SLOTS}")
    tilings = [None] + [tiling(t) for t in args.tiles.split(",") if t]
    timing = functools.partial(time_ms, device=device, warmup=2, iters=args.iters)
    for L in parse_sizes(args.contexts):
        g = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(1, H, L, D, generator=g, device=device, dtype=dtype)
        k, v = (torch.randn(1, Hkv, L, D, generator=g, device=device, dtype=dtype) for _ in range(2))
        fq, fk = (torch.randn(1, H, L, Fd, generator=g, device=device).softmax(-1).to(dtype) for _ in range(2))
        gate = torch.rand(1, H, L, D, generator=g, device=device, dtype=dtype)
        valid = torch.ones(1, L, dtype=torch.bool, device=device)
        state = init_state(1, H, Hkv, Fd, D, WINDOW, SLOTS, device=device)
        with torch.no_grad():
            route = functools.partial(fresh_routing, q.float(), k.float(), v.float(), valid, state, options, start=0)
            fold, _ = route()
            one_pass = functools.partial(still_attention_triton, q, k, v, fq, fk, gate, fold, valid,
                                         scale=options.scale, eps=options.eps)
            y_ref = one_pass()
            k_rep, v_rep = (t.repeat_interleave(H // Hkv, 1) for t in (k, v))  # SDPA's keys a query head, untimed
            sdpa = functools.partial(F.scaled_dot_product_attention, q, k_rep, v_rep, is_causal=True)
            rows = {"routing": timing(route), "one-pass kernel": timing(one_pass), "sdpa": timing(sdpa)}
            for launch in tilings:
                chunked = functools.partial(still_chunk_triton, q, k, v, fq, fk, gate, fold, valid, options,
                                            slots=SLOTS, launch=launch)
                diff = (chunked().float() - y_ref.float()).abs().max().item() / y_ref.float().abs().max().item()
                shown = "default" if launch is None else "{C}x{BN}x{BF}/{num_warps}/{num_stages}".format(**launch)
                rows[f"chunked kernel {shown} (vs one-pass {diff:.1e})"] = timing(chunked)
        for name, ms in rows.items():
            print(f"  context {size_label(L):>5}  {name:<48} {ms:9.2f} ms", flush=True)


if __name__ == "__main__":
    main()
