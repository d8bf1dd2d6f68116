"""Does inductor compile STILL's fresh-pass routing correctly on this machine? Eager against
`torch.compile` (inductor) for the wavelet search `kth_ranked_above` alone and for the whole
`fresh_routing`, on random inputs at STILL's default shape (3 KV heads of 64, 896-token budget):

    python experiments/scripts/check_compiled_routing.py [--lengths 1024,4096] [--device cpu|cuda] [--kth-eager]

With --kth-eager the search runs uncompiled (a graph break) and one `fresh_routing` compiled with
dynamic shapes serves every length, as it would serve a prefill's prompts.

Compiling the routing would cut a prefill's ~100 small ops a layer (the eager pass is bound by their
dispatch); it is only worth trying where this prints no mismatch. On the project's CPU (torch 2.13)
`kth_ranked_above` comes out wrong at 4,096 tokens: every intermediate of its
loop matches eager, the final gather does not; and the compiled `fresh_routing` aborts the
process ("index out of bounds" from inductor's generated C++, which no `except` catches), so the
lengths run in order and each prints as it ends (docs/kernels.md).
"""

from __future__ import annotations

import argparse

import torch

from linearize.config import StillConfig
from linearize.ops.ranking import kth_ranked_above
from linearize.ops.still import StillOptions
from linearize.ops.still import naive as still
from linearize.ops.still import routing as still_routing


def random_inputs(length: int, device: str, seed: int = 0):
    g = torch.Generator(device).manual_seed(seed)
    cfg = StillConfig()
    B, H, HKV, d, F = 1, 9, 3, 64, 128
    q, k, v = (torch.randn(B, h, length, d, generator=g, device=device) for h in (H, HKV, HKV))
    valid = torch.ones(B, length, dtype=torch.bool, device=device)
    state = still.init_state(B, H, HKV, F, d, cfg.window, cfg.slots, device=device)
    fk = torch.rand(B, H, length, F, generator=g, device=device)
    return (q, k, v, valid, state), fk, StillOptions(**cfg.op_options(d**-0.5)), cfg.slots


def mismatches(a, b) -> int:
    """Elements that differ, over tensors or dicts of tensors (floats within 1e-5)."""
    if isinstance(a, dict):
        return sum(mismatches(a[name], b[name]) for name in a)
    if isinstance(a, (tuple, list)):
        return sum(mismatches(x, y) for x, y in zip(a, b))
    if a.is_floating_point():
        return int((~torch.isclose(a, b, atol=1e-5, rtol=1e-5)).sum())
    return int((a != b).sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024,4096")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--kth-eager", action="store_true")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {args.device}" + (", the search uncompiled" if args.kth_eager else ""))
    if args.kth_eager:
        still_routing.kth_ranked_above = torch.compiler.disable(kth_ranked_above)
        routing_compiled = torch.compile(still_routing.fresh_routing, backend="inductor", dynamic=True)
    for length in map(int, args.lengths.split(",")):
        inputs, fk, options, slots = random_inputs(length, args.device)
        if not args.kth_eager:
            # Distinct ranks for 70% of the slots and tokens, -1 (outside the set) for the others.
            g = torch.Generator(args.device).manual_seed(1)
            N = slots + length
            rank = torch.randperm(N, generator=g, device=args.device).expand(1, 3, N)
            rank = torch.where(torch.rand(1, 3, N, generator=g, device=args.device) < 0.7, rank, -1).to(torch.int32)
            torch._dynamo.reset()
            kth = mismatches(kth_ranked_above(rank, slots),
                             torch.compile(kth_ranked_above, backend="inductor")(rank, slots))
            print(f"L={length}: kth_ranked_above {kth} of {rank.numel()} wrong", flush=True)
            torch._dynamo.reset()
            routing_compiled = torch.compile(still_routing.fresh_routing, backend="inductor")
        with torch.no_grad():
            eager = still_routing.fresh_routing(*inputs, options, start=0, fk=fk)
            try:
                compiled = routing_compiled(*inputs, options, start=0, fk=fk)
                routing = f"{mismatches(eager, compiled)} mismatched elements"
            except Exception as e:  # noqa: BLE001 (report whatever inductor raises, then go on)
                routing = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
        print(f"L={length}: fresh_routing {routing}", flush=True)


if __name__ == "__main__":
    main()
