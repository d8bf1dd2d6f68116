"""Times STILL's routing of one fresh pass (one layer at SmolLM2's shape, random q/k/v) on this machine.

    python experiments/scripts/time_still_routing.py [--shapes 8x2048,4x4096,1x32768] [--repeats 3]

The routing (`linearize.ops.still.routing.fresh_routing`: saliency scores, chunk picks, the eviction replay)
runs in PyTorch before the STILL kernels in every training step and prefill. Prints the best of
`--repeats` wall times per batch x length, the number of PyTorch ops one call dispatches (what an
eager prefill pays per op on any device, a CUDA graph not at all), and a checksum of the fold times
(equal across versions of the code that route alike).
"""

from __future__ import annotations

import argparse
from functools import partial

import torch

from linearize.bench.common import OpCount, default_device, wall_ms
from linearize.config import StillConfig
from linearize.ops.still import StillOptions
from linearize.ops.still import naive as still
from linearize.ops.still import routing as still_routing

HEADS, KV_HEADS, HEAD_DIM, FEATURES = 9, 3, 64, 128  # SmolLM2-135M


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="8x2048,4x4096,1x32768")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    cfg = StillConfig()
    options = StillOptions(**cfg.op_options(HEAD_DIM**-0.5))
    device = default_device()
    print(f"{device}, {torch.get_num_threads()} threads, {cfg}")
    for shape in args.shapes.split(","):
        B, L = (int(x) for x in shape.split("x"))
        g = torch.Generator().manual_seed(0)
        q = torch.randn(B, HEADS, L, HEAD_DIM, generator=g).to(device)
        k, v = (torch.randn(B, KV_HEADS, L, HEAD_DIM, generator=g).to(device) for _ in range(2))
        valid = torch.ones(B, L, dtype=torch.bool, device=device)
        state = still.init_state(B, HEADS, KV_HEADS, FEATURES, HEAD_DIM, cfg.window, cfg.slots, device=device)
        route = partial(still_routing.fresh_routing, q, k, v, valid, state, options, start=0)
        best = min(wall_ms(route, device) for _ in range(args.repeats)) / 1e3
        with OpCount() as count:
            fold, _ = route()
        checksum = int(torch.where(fold == still_routing.NEVER, -1, fold).sum())
        print(f"batch {B} x {L} tokens: {best:.3f} s, {count.ops} ops (fold-time checksum {checksum})")


if __name__ == "__main__":
    main()
