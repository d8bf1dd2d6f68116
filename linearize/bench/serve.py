"""`linearize bench serve`: the serving engine under N concurrent clients, a linearized model against
its softmax teacher on the same engine and device.

A point (clients N, prompt length P) submits N requests of P random tokens at once, each asking for
`max_tokens` tokens past any end-of-sequence token (`ignore_eos`, as vLLM's benchmarks do), to an
`linearize.serve.engine.Engine` of `max_batch` slots (N, capped), and reads every request's tokens
as they arrive, as the web layer's streaming responses do. It records the output tokens per second
over the point's wall time, time to first token (submit to first token) and inter-token latency (the
gaps between a request's consecutive tokens) at p50 and p99, and the peak device memory. It splits the
wall time at the moment every request has its first token (`all_prefilled_s`): before it the engine
still prefills prompts between decode steps, after it only decodes, and `decode_tokens_per_s` is the
output rate over that tail alone. Output tokens/s over the whole point is what a user sees; the tail's
rate is what the constant-size state buys once the prompts are in. The engine runs in this process
without HTTP: the scheduler, its slots and the model are what is measured. Each model first serves an
untimed warm-up point, so that its first measured point does not pay for compiling kernels.

A linearized model's requests hold one fixed-size state slot each, stepped together ("slots"); the
softmax teacher's requests hold one row each of a batched KV cache, whose keys and values grow with every
token, and all rows step together too ("kv", continuous batching as vLLM and TGI do it, with requests
admitted while their KV cache fits the engine's memory budget: 90% of the GPU memory free when each
point's engine starts, less a step's working room). A hybrid (linearized and softmax layers) is batched
in the same KV rows, its linearized layers' states beside its softmax layers' keys and values ("hybrid";
docs/serving.md). Each point records the engine's mode
and the most requests that generated at once (`peak_running`: for the teacher, how many rows its memory
let run). A point that runs out of memory is recorded as OOM and the larger points of that model are
skipped; so is one that would end past the model's share of the time limit.

These are the points of `--scenario points` (the default); multi-turn conversations, where a linearized
model's prefix cache matters, are `--scenario chat` (`linearize.bench.chat`).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path

import torch

from ..serve.engine import Engine, SamplingParams
from .common import (
    OOM,
    cell,
    default_device,
    failure,
    free_memory,
    human_bytes,
    new_results,
    number,
    options_note,
    parse_sizes,
    peak_bytes,
    record_row,
    reset_peak,
    size_label,
    write_outputs,
)
from .model import SOFTMAX, build

FULL = {"clients": [16, 64, 256], "prompt_lengths": parse_sizes("4k,32k"), "max_tokens": 256, "max_batch": 256,
        "prefill_chunk": 16384, "prefill_budget": 0.0, "time_limit": 540.0}
QUICK = {"clients": [2, 4], "prompt_lengths": [32], "max_tokens": 4, "max_batch": 4, "prefill_chunk": 16,
         "prefill_budget": 0.0, "time_limit": 120.0}


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between the sorted values."""
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


async def _client(engine: Engine, prompt: list[int], params: SamplingParams, record: dict) -> None:
    """One client's request, its token arrivals kept in `record` as they come (a point cut at the time
    limit keeps what had arrived)."""
    record["submitted"] = time.perf_counter()
    request = record["request"] = engine.submit(prompt, params)
    async for _ in request.tokens():
        record["arrivals"].append(time.perf_counter())
    record["finish_reason"] = request.finish_reason


def prefill_fit(engine: Engine) -> dict | None:
    """The engine's fitted cost of a prefill call at the point's end (what `--prefill-budget` paces by):
    its fixed milliseconds, microseconds a token, and the tokens whose own cost equals the fixed share
    (the least a paced call takes)."""
    fit = engine.prefill_cost.fit()
    if fit is None:
        return None
    fixed_s, per_token_s = fit
    return {"fixed_ms": fixed_s * 1e3, "per_token_us": per_token_s * 1e6, "fixed_tokens": fixed_s / per_token_s}


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (or a time limit's SIGINT) during a point, carrying the point as it stood."""

    def __init__(self, point: dict):
        super().__init__()
        self.point = point


def drive(engine, device: torch.device, clients: Callable[[], Awaitable[None]], records: Callable[[], Iterable[dict]],
          deadline: float, cut: list[float]) -> tuple[float, float, bool]:
    """Start `engine` and run `clients()` on it until they end: (start time, wall seconds, interrupted).
    At `deadline` (time.monotonic()) the cut's time goes into `cut` and every request `records()` holds
    is cancelled, so the clients end with what had arrived; Ctrl-C stops it, `interrupted` then True."""

    async def cut_at_deadline():
        await asyncio.sleep(max(0.0, deadline - time.monotonic()))
        cut.append(time.perf_counter())
        for record in records():
            if record["request"] is not None:
                record["request"].cancel()

    async def run():
        guard = asyncio.create_task(cut_at_deadline()) if math.isfinite(deadline) else None
        try:
            await clients()
        finally:
            if guard is not None:
                guard.cancel()

    reset_peak(device)
    engine.start()
    started = time.perf_counter()
    interrupted = False
    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        interrupted = True
    finally:
        engine.stop(drain=False)
    return started, time.perf_counter() - started, interrupted


def measure_point(model, *, clients: int, prompt_length: int, settings: dict, device: torch.device,
                  deadline: float = math.inf) -> dict:
    """One (clients, prompt length) point on a fresh engine. At `deadline` (time.monotonic()) the
    requests still running are cancelled and the point is recorded as "cut", with what had arrived;
    an interrupt raises `Interrupted` with the point so far."""
    generator = torch.Generator().manual_seed(clients * 1_000_003 + prompt_length)
    prompts = torch.randint(3, model.config.vocab_size, (clients, prompt_length), generator=generator).tolist()
    params = SamplingParams(max_tokens=settings["max_tokens"], ignore_eos=True)
    engine = Engine(model, max_batch=min(clients, settings["max_batch"]), max_queue=clients,
                    prefill_chunk=settings["prefill_chunk"], prefill_budget=settings["prefill_budget"])
    records = [{"arrivals": [], "finish_reason": None, "request": None} for _ in prompts]
    cut = []

    async def clients_done():
        await asyncio.gather(*(_client(engine, prompt, params, record) for prompt, record in zip(prompts, records)))

    started, wall, interrupted = drive(engine, device, clients_done, lambda: records, deadline, cut)
    finished = [r for r in records if r["finish_reason"] in ("length", "stop")]
    errors = [r["finish_reason"] for r in records if r["finish_reason"] not in ("length", "stop", "cancelled", None)]
    if not interrupted and (errors or (not cut and len(finished) < clients)):
        reasons = errors or [r["finish_reason"] for r in records if r not in finished]
        raise RuntimeError(f"{len(reasons)} of {clients} requests ended with {reasons[0]!r}")
    answered = [r for r in records if r["arrivals"]]
    tokens = sum(len(r["arrivals"]) for r in records)
    ttft = [(r["arrivals"][0] - r["submitted"]) * 1e3 for r in answered]
    gaps = [(b - a) * 1e3 for r in answered for a, b in zip(r["arrivals"], r["arrivals"][1:])]
    all_prefilled = max(r["arrivals"][0] for r in answered) if len(answered) == clients else None
    tail_tokens = 0 if all_prefilled is None else sum(t > all_prefilled for r in records for t in r["arrivals"])
    point = {"status": "ok", "mode": engine.mode, "slots": engine.max_batch, "peak_running": engine.peak_running,
             "prefill_calls": engine.prefill_calls, "prefilled_tokens": engine.prefilled_tokens,
             "kv_budget_bytes": engine.kv_budget_bytes if engine.mode in ("kv", "hybrid") else None,
             "wall_s": wall, "output_tokens": tokens, "output_tokens_per_s": tokens / wall,
             "all_prefilled_s": None if all_prefilled is None else all_prefilled - started,
             "decode_tokens_per_s": tail_tokens / (started + wall - all_prefilled) if tail_tokens else None,
             "ttft_p50_ms": percentile(ttft, 50) if ttft else None, "ttft_p99_ms": percentile(ttft, 99) if ttft else None,
             "itl_p50_ms": percentile(gaps, 50) if gaps else None, "itl_p99_ms": percentile(gaps, 99) if gaps else None,
             "peak_bytes": peak_bytes(device), "prefill_fit": prefill_fit(engine), "prefill_path": engine.prefill_path}
    progress = f"{len(finished)} of {clients} requests finished, {len(answered)} had begun answering"
    if interrupted:
        raise Interrupted(point | {"status": "cut", "reason": f"interrupted after {wall:.0f} s: {progress}"})
    if cut and len(finished) < clients:
        point.update(status="cut", reason=f"cut at the time limit after {cut[0] - started:.0f} s: {progress}")
    return point


def warm_up(net, settings: dict, device: torch.device, deadline: float) -> float:
    """An untimed point before a model's first (the fewest clients, the shortest prompt up to one prefill
    chunk, a few tokens each), so that kernel compilation, CUDA graph capture and the allocator's first
    growth are not counted in the first measured point. Returns its seconds, which the record keeps."""
    started = time.perf_counter()
    measure_point(net, clients=min(settings["clients"]),
                  prompt_length=min(*settings["prompt_lengths"], settings["prefill_chunk"]),
                  settings=settings | {"max_tokens": min(4, settings["max_tokens"])}, device=device, deadline=deadline)
    free_memory()
    return time.perf_counter() - started


def bench(out: Path, *, model: str | None = None, shape: str = "smollm2", methods: list[str] = ("lizard",),
          options: dict | None = None, quick: bool = False, **overrides) -> list[Path]:
    """Every (clients, prompt length) point for the softmax teacher and each method."""
    device = default_device()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    settings = dict(QUICK if quick else FULL, **{k: v for k, v in overrides.items() if v is not None})
    settings.update(clients=sorted(set(settings["clients"])), prompt_lengths=sorted(set(settings["prompt_lengths"])),
                    model=model, shape=None if model else shape, methods=list(methods), options=options or {},
                    dtype=str(dtype).removeprefix("torch."), quick=quick)
    label = model or f"{shape} shape, random weights"
    results = new_results("serve", f"Serving: {label}", device, settings)
    results.update(models=[], points=[])
    variants = [SOFTMAX, *methods]
    end = time.monotonic() + settings["time_limit"]
    for i, variant in enumerate(variants):
        deadline = time.monotonic() + (end - time.monotonic()) / (len(variants) - i)
        net = build(settings, variant, device, dtype)
        try:
            warm_up_s = warm_up(net, settings, device, deadline)
        except Interrupted:  # the points before it are kept
            write_outputs(results, out, tables, plots)
            raise
        results["models"].append({"name": variant, "linearize": getattr(net.config, "linearize", None),
                                  "warm_up_s": warm_up_s})
        stopped = None
        for prompt_length in settings["prompt_lengths"]:
            last = None  # (clients, wall seconds) of the last point measured at this length
            for clients in settings["clients"]:
                point = {"model": variant, "clients": clients, "prompt_length": prompt_length}
                # At least proportional to the clients: every request's prompt is prefilled.
                estimate = None if last is None else last[1] * clients / last[0]
                if stopped is not None:
                    point.update(status="skipped", reason=stopped)
                elif estimate is not None and time.monotonic() + estimate > deadline:
                    point.update(status="skipped", reason="would pass the time limit")
                else:
                    try:
                        point.update(measure_point(net, clients=clients, prompt_length=prompt_length,
                                                   settings=settings, device=device, deadline=deadline))
                        last = (clients, point["wall_s"])
                        if point["status"] == "cut":
                            stopped = f"a smaller point was cut at the time limit ({size_label(prompt_length)} x {clients})"
                    except Interrupted as e:  # what the point had, and the points before it, are kept
                        point.update(e.point)
                        record_row(results, "points", point, out)
                        write_outputs(results, out, tables, plots)
                        raise
                    except OOM as e:
                        point.update(failure(e))
                        stopped = f"a smaller point ran out of memory ({size_label(prompt_length)} x {clients})"
                    except Exception as e:  # noqa: BLE001 (recorded, and the other points go on)
                        point.update(failure(e))
                    free_memory()
                record_row(results, "points", point, out)
        del net
        free_memory()
    return write_outputs(results, out, tables, plots)


def tables(results: dict) -> list[str]:
    points = results["points"]
    variants = [m["name"] for m in results["models"]]
    caption = (f"Output tokens/s (per point: clients x prompt length, {results['settings']['max_tokens']} tokens "
               f"asked of each).{options_note(results['settings'])}")
    lines = [caption, "",
             "| clients | prompt | " + " | ".join(variants) + " |", "|---|---|" + "---|" * len(variants)]
    keys = sorted({(p["clients"], p["prompt_length"]) for p in points}, key=lambda k: (k[1], k[0]))
    by = {(p["model"], p["clients"], p["prompt_length"]): p for p in points}
    for clients, length in keys:
        cells = [throughput_cell(by.get((v, clients, length))) for v in variants]
        lines.append(f"| {clients} | {size_label(length)} | " + " | ".join(cells) + " |")
    caption = ("Latency, phases and memory (all prefilled: when the last request got its first token, as a share "
               "of the wall time; decode tokens/s: the output rate after it; a point cut at the time limit: what "
               "had arrived by then):")
    header = ("| model | clients | prompt | TTFT p50 / p99 ms | ITL p50 / p99 ms | all prefilled | decode tokens/s "
              "| peak memory | batching |")
    lines += ["", caption, "", header, "|---|---|---|---|---|---|---|---|---|"]
    pair = lambda a, b: "–" if a is None else f"{number(a)} / {number(b)}"  # p50 / p99
    for p in points:
        if p["status"] not in ("ok", "cut"):
            continue
        decode = "–" if p["decode_tokens_per_s"] is None else number(p["decode_tokens_per_s"])
        prefilled = "–" if p["all_prefilled_s"] is None else f"{100 * p['all_prefilled_s'] / p['wall_s']:.0f}%"
        memory = human_bytes(p["peak_bytes"]) if p["peak_bytes"] is not None else "– (CPU)"
        model = p["model"] + (" (cut)" if p["status"] == "cut" else "")
        lines.append(f"| {model} | {p['clients']} | {size_label(p['prompt_length'])} | "
                     f"{pair(p['ttft_p50_ms'], p['ttft_p99_ms'])} | {pair(p['itl_p50_ms'], p['itl_p99_ms'])} | "
                     f"{prefilled} | {decode} | {memory} | {batching(p)} |")
    cut = [p for p in points if p["status"] == "cut"]
    if cut:
        lines += [""] + [f"- {p['model']}, {p['clients']} x {size_label(p['prompt_length'])}: {p['reason']}." for p in cut]
    return lines


def throughput_cell(point: dict | None) -> str:
    """Output tokens/s; a point cut at the time limit shows its rate so far, marked."""
    if point is not None and point["status"] == "cut":
        return f"{number(point['output_tokens_per_s'])} (cut)"
    return cell(point, lambda r: number(r["output_tokens_per_s"]))


def batching(point: dict) -> str:
    """How the engine batched a point's requests and prefilled their prompts, for the latency table."""
    if point["mode"] == "slots":
        rows = f"{point['slots']} slots"
    else:  # "kv" or "hybrid": rows of one batched KV cache
        peak = point.get("peak_running")
        kind = "batched KV" if point["mode"] == "kv" else "batched hybrid"
        rows = f"{kind} ({point['slots']} rows" + (f", {peak} at most at once)" if peak is not None else ")")
    calls = point.get("prefill_calls")
    if not calls:
        return rows
    text = f"{rows}; prompts in {calls} calls of {number(point['prefilled_tokens'] / calls)} tokens on average"
    if point.get("prefill_path"):
        text += f" through a fixed-shape cache, {point['prefill_path']}"
    fit = point.get("prefill_fit")
    if fit:  # what a paced call can get down to: it never takes fewer tokens than the fixed share's worth
        text += f"; a call's fixed share {number(fit['fixed_ms'])} ms, {number(fit['fixed_tokens'])} tokens' worth"
    return text


def plots(results: dict, out: Path) -> list[Path]:
    from matplotlib.figure import Figure

    from ..figures import save_png

    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    for model in [m["name"] for m in results["models"]]:
        for length in results["settings"]["prompt_lengths"]:
            xy = [(p["clients"], p["output_tokens_per_s"]) for p in results["points"]
                  if p["model"] == model and p["prompt_length"] == length and p["status"] == "ok"]
            if xy:
                ax.plot(*zip(*xy), marker="o", label=f"{model}, {size_label(length)} prompts")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("output tokens/s")
    ax.grid(alpha=0.3)
    if ax.lines:  # none where every point was cut, skipped or failed
        ax.legend(fontsize=7)
    path = out / "serve.tokens_per_s.png"
    save_png(fig, path, dpi=120, bbox_inches="tight")
    return [path]
