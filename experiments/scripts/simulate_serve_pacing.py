"""The serving engine's turns on paper: inter-token latency and output rate for a burst of requests,
with whole prefill chunks or chunks paced by `--prefill-budget`, from per-call costs.

    python -m experiments.scripts.simulate_serve_pacing [--clients 64] [--prompt 4096] [--tokens 256]

Each turn prefills one chunk of the first waiting prompt (all N arrive at once), then steps every
running request, as `linearize.serve.engine` does. The default costs are the H200's at the
Llama-3-8B shape (docs/results/h200/model/llama3-8b-rope-shared: prefill ~29 µs a token, 3.81 s for
128K in 16K calls; a compiled decode step 5.5 ms at batch 1 and ~11 ms at batch 64), plus an assumed
4 ms a prefill call for launches; none is measured here. Prints ITL p50 / p99, their ratio, TTFT p99
and output tokens/s for each pacing.
"""

from __future__ import annotations

import argparse
import itertools

from linearize.bench.serve import percentile


def simulate(clients: int, prompt: int, tokens: int, *, chunk: int, budget: float, per_token: float,
             per_call: float, step_1: float, step_64: float, floor: int = 16) -> dict:
    def step(batch: int) -> float:
        return step_1 + (step_64 - step_1) * (batch - 1) / 63

    now, last_step = 0.0, None
    waiting = [[i, prompt] for i in range(clients)]  # (request, prompt tokens left)
    running, arrivals = [], {}  # running: [request, tokens made]
    while waiting or running:
        if waiting:
            size = chunk
            if budget and running and last_step is not None:
                size = max(floor, min(chunk, int(budget * last_step / per_token)))
            request, left = waiting[0]
            size = min(size, left)
            now += per_call + size * per_token
            waiting[0][1] -= size
            if waiting[0][1] == 0:
                waiting.pop(0)
                arrivals[request] = [now]
                running.append([request, 1])
        if running:
            last_step = step(len(running))
            now += last_step
            for r in running:
                arrivals[r[0]].append(now)
                r[1] += 1
            running = [r for r in running if r[1] < tokens]
    gaps = [b - a for times in arrivals.values() for a, b in itertools.pairwise(times)]
    return {"output_tokens": sum(len(t) for t in arrivals.values()),
            "itl_p50_ms": 1e3 * percentile(gaps, 50), "itl_p99_ms": 1e3 * percentile(gaps, 99),
            "ttft_p99_s": percentile([t[0] for t in arrivals.values()], 99), "tokens_per_s": clients * tokens / now}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--per-token", type=float, default=29e-6, help="prefill seconds a token")
    parser.add_argument("--per-call", type=float, default=0.004, help="prefill seconds a call besides its tokens")
    parser.add_argument("--step-1", type=float, default=0.0055, help="decode step seconds at batch 1")
    parser.add_argument("--step-64", type=float, default=0.011, help="decode step seconds at batch 64")
    args = parser.parse_args()
    costs = {"per_token": args.per_token, "per_call": args.per_call, "step_1": args.step_1, "step_64": args.step_64}
    pacings = [("whole 16K chunks", 16384, 0.0), ("whole 2K chunks", 2048, 0.0), ("budget 1", 16384, 1.0),
               ("budget 2", 16384, 2.0), ("budget 4", 16384, 4.0)]
    print(f"{args.clients} clients, {args.prompt}-token prompts, {args.tokens} tokens each")
    for label, chunk, budget in pacings:
        r = simulate(args.clients, args.prompt, args.tokens, chunk=chunk, budget=budget, **costs)
        print(f"  {label:18s} ITL p50 {r['itl_p50_ms']:6.1f} ms, p99 {r['itl_p99_ms']:6.1f} ms "
              f"({r['itl_p99_ms'] / r['itl_p50_ms']:.2f}x); TTFT p99 {r['ttft_p99_s']:5.1f} s; "
              f"{r['tokens_per_s']:6.0f} tokens/s")


if __name__ == "__main__":
    main()
