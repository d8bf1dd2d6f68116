"""How long torch.compile takes on a decode step (`StaticDecoder(compile_backend=...)`), by layer count,
at SmolLM2's shape with random weights, on this machine's CPU (eager steps, no CUDA graph).

    python experiments/scripts/time_decode_compile.py [--methods lizard,still] [--layers 1,2,4] [--backend inductor]

Dynamo traces a whole step's layers unrolled (Lizard), so its first step's compile grows with the
layer count; STILL compiles its attention step alone, once for every layer, so its compile should not.
Also prints the graphs dynamo built over a few steps (a step that compiles anew at every token would
show one graph per step).
"""

from __future__ import annotations

import argparse
import os
import time

# Inductor's on-disk caches would turn a second run into a cache read (a fifth of the first's time here).
os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")

import torch  # after the cache switch, which inductor reads at import
from torch._dynamo.utils import counters
from transformers import DynamicCache

from linearize.bench.model import random_model
from linearize.convert import convert
from linearize.decode import StaticDecoder


def time_compile(method: str, layers: int, backend: str, steps: int) -> dict:
    model = convert(random_model("smollm2", num_hidden_layers=layers).eval(), method)
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        ids = torch.randint(model.config.vocab_size, (1, 64))
        token = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits.argmax(-1)
        decoder = StaticDecoder(model, cache, batch=1, cuda_graph=False, compile_backend=backend)
        seconds = []
        for _ in range(steps):
            start = time.perf_counter()
            token = decoder.step(token).argmax(-1)
            seconds.append(time.perf_counter() - start)
    return {"first": seconds[0], "second": seconds[1], "last": seconds[-1], "graphs": counters["stats"]["unique_graphs"],
            "ops": counters["stats"]["calls_captured"], "path": decoder.path}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="lizard,still")
    parser.add_argument("--layers", default="1,2,4")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    print(f"backend {args.backend}, {args.steps} eager steps after a 64-token prefill, torch {torch.__version__}")
    print("method  layers  first step s  second step s  last step s  graphs  ops captured (all graphs)")
    for method in args.methods.split(","):
        for layers in map(int, args.layers.split(",")):
            r = time_compile(method, layers, args.backend, args.steps)
            print(f"{method:7} {layers:6} {r['first']:13.1f} {r['second']:14.1f} {r['last']:12.3f} {r['graphs']:7} "
                  f"{r['ops']:6}   {r['path']}")


if __name__ == "__main__":
    main()
