"""`linearize bench serve --scenario chat`: multi-turn conversations on the serving engine, where a
linearized model's prefix cache (`linearize.serve.prefix_cache`) spares it the earlier turns' prefill.

C conversations of T turns share one system prompt of S tokens. Turn k's request is the whole
conversation so far, resubmitted as one prompt, as an OpenAI chat client does: the system prompt, then
each earlier turn's user message (U tokens) and the tokens the model answered to it, then the new user
message. A conversation submits a turn when its previous turn has finished, so the conversations run
side by side, each at its own pace. The tokens are seeded random ones, as the points scenario's prompts
are; each answer is `max_tokens` tokens, greedy, past any end-of-sequence token (`ignore_eos`). Unless
U is given, it is chosen so that the last turn's prompt is `target_context` tokens.

Runs, on one engine each, in this order: each method twice, with the prefix cache on and off, then the
softmax teacher once, with its own prefix cache (its keys and values restored by prefix, as vLLM serves
a model by default), on the same prompts (the teacher last: it takes the longest, and the time the
runs before it leave of their shares is its). Each model first serves an untimed small chat, so
that no run pays for compiling kernels.

Per run and turn index (the turn's requests that finished): TTFT at p50 and p99; the prompt tokens
against those prefilled (the rest were restored from the prefix cache: `Request.cached_tokens`);
output tokens/s over the turn's span (the first of its requests submitted to the last token of any).
Per run: output tokens/s over the whole scenario, the engine's prefill counts and prefix-cache
statistics (`hit_tokens`: the tokens restored), and a digest of each conversation's answers, so that
runs with the cache on and off can be seen to answer alike. `comparisons` sets, per method and turn,
TTFT with the cache on over the same turn with it off, and the output rate with the cache on over the
teacher's, against the targets (`TTFT_TARGET`, `RATE_TARGET`).

Each run gets an equal share of what is left of the time limit; at the end of its share the requests
still running are cancelled and the run is recorded as "cut", with the turns that had finished.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import time
from pathlib import Path

import torch

from ..serve.engine import Engine, SamplingParams
from .common import (
    MIB,
    OOM,
    default_device,
    failure,
    free_memory,
    human_bytes,
    new_results,
    number,
    options_note,
    peak_bytes,
    record_row,
    size_label,
    write_outputs,
)
from .model import SOFTMAX, build
from .serve import Interrupted, _client, drive, percentile

NAME = "serve_chat"
# The targets read from one run: a later turn's TTFT with the prefix cache at most this share of the same
# turn's without it; the linearized model's output tokens/s at least this multiple of the teacher's.
TTFT_TARGET = 0.1
RATE_TARGET = 10.0

FULL = {"conversations": 8, "turns": 6, "system_tokens": 2048, "user_tokens": None, "target_context": 32768,
        "max_tokens": 256, "max_batch": None, "prefill_chunk": 16384, "prefill_budget": 0.0, "prefix_block": 256,
        "prefix_cache_bytes": 8 << 30, "prefix_cache_host_bytes": 0, "time_limit": 540.0}
QUICK = {"conversations": 2, "turns": 3, "system_tokens": 32, "user_tokens": None, "target_context": 128,
         "max_tokens": 4, "max_batch": None, "prefill_chunk": 16, "prefill_budget": 0.0, "prefix_block": 8,
         "prefix_cache_bytes": 64 * MIB, "prefix_cache_host_bytes": 0, "time_limit": 120.0}


def user_tokens(settings: dict) -> int:
    """U, the tokens of each user message: as given, else the most with which the last turn's prompt
    (S + T x U + (T - 1) answers) stays within `target_context`. ValueError where none fits."""
    if settings["user_tokens"] is not None:
        return settings["user_tokens"]
    turns, answers = settings["turns"], settings["max_tokens"]
    room = settings["target_context"] - settings["system_tokens"] - (turns - 1) * answers
    if room < turns:
        raise ValueError(f"--target-context {settings['target_context']} leaves no room for {turns} user messages "
                         f"after a {settings['system_tokens']}-token system prompt and {turns - 1} answers of "
                         f"{answers} tokens: raise it, or lower --system-tokens, --turns or --max-tokens")
    return room // turns


def last_prompt_tokens(settings: dict) -> int:
    """The last turn's prompt: the system prompt, every user message and every answer but the last."""
    return settings["system_tokens"] + settings["turns"] * settings["user_tokens"] + \
        (settings["turns"] - 1) * settings["max_tokens"]


def conversation_tokens(settings: dict, vocab_size: int) -> tuple[list[int], list[list[list[int]]]]:
    """The shared system prompt and each conversation's user messages ([conversation][turn]), seeded
    random tokens (ids from 3 up: past the usual special tokens)."""
    generator = torch.Generator().manual_seed(settings["system_tokens"] * 1_000_003 + settings["user_tokens"])
    system = torch.randint(3, vocab_size, (settings["system_tokens"],), generator=generator).tolist()
    users = torch.randint(3, vocab_size, (settings["conversations"], settings["turns"], settings["user_tokens"]),
                          generator=generator).tolist()
    return system, users


def run_chat(model, *, settings: dict, prefix_cache: bool, device: torch.device, deadline: float = math.inf) -> dict:
    """Every conversation on a fresh engine (the prefix cache on or off). At `deadline` (time.monotonic())
    the requests still running are cancelled and the run is recorded as "cut"; an interrupt raises
    `Interrupted` with the run so far."""
    system, users = conversation_tokens(settings, model.config.vocab_size)
    params = SamplingParams(max_tokens=settings["max_tokens"], ignore_eos=True)
    conversations, turns = settings["conversations"], settings["turns"]
    engine = Engine(model, max_batch=min(conversations, settings["max_batch"] or conversations),
                    max_queue=conversations, prefill_chunk=settings["prefill_chunk"],
                    prefill_budget=settings["prefill_budget"], prefix_cache=prefix_cache,
                    prefix_block=settings["prefix_block"], prefix_cache_bytes=settings["prefix_cache_bytes"],
                    prefix_cache_host_bytes=settings["prefix_cache_host_bytes"])
    records: list[list[dict]] = [[] for _ in range(conversations)]  # [conversation][turn], as submitted
    cut = []

    async def conversation(index: int) -> None:
        history = list(system)
        for turn in range(turns):
            if cut:
                return
            prompt = history + users[index][turn]
            record = {"arrivals": [], "finish_reason": None, "request": None, "prompt_tokens": len(prompt)}
            records[index].append(record)
            await _client(engine, prompt, params, record)
            if record["finish_reason"] not in ("length", "stop"):
                return
            history = prompt + record["request"].generated

    async def conversations_done():
        await asyncio.gather(*(conversation(i) for i in range(conversations)))

    started, wall, interrupted = drive(engine, device, conversations_done, lambda: (r for rs in records for r in rs),
                                       deadline, cut)
    flat = [r for rs in records for r in rs]
    errors = [r["finish_reason"] for r in flat if r["finish_reason"] not in ("length", "stop", "cancelled", None)]
    if errors and not interrupted:
        raise RuntimeError(f"{len(errors)} of {len(flat)} requests ended with {errors[0]!r}")
    tokens = sum(len(r["arrivals"]) for r in flat)
    finished = sum(r["finish_reason"] in ("length", "stop") for r in flat)
    run = {"status": "ok", "mode": engine.mode, "slots": engine.max_batch, "peak_running": engine.peak_running,
           "wall_s": wall, "requests": finished, "output_tokens": tokens, "output_tokens_per_s": tokens / wall,
           "prompt_tokens": sum(r["prompt_tokens"] for r in flat if r["request"] is not None),
           "prefill_calls": engine.prefill_calls, "prefilled_tokens": engine.prefilled_tokens,
           "prefix_cache_stats": engine.stats()["prefix_cache"], "peak_bytes": peak_bytes(device),
           "prefill_path": engine.prefill_path, "turns": turn_rows(records, turns),
           "answers_sha256": [answers_digest(rs) for rs in records]}
    progress = f"{finished} of {conversations * turns} turns finished"
    if interrupted:
        raise Interrupted(run | {"status": "cut", "reason": f"interrupted after {wall:.0f} s: {progress}"})
    if cut and finished < conversations * turns:
        run.update(status="cut", reason=f"cut at the time limit after {cut[0] - started:.0f} s: {progress}")
    return run


def turn_rows(records: list[list[dict]], turns: int) -> list[dict]:
    """Per turn index, over the conversations whose request for it finished: TTFT, the prompt tokens
    against those prefilled, and the output rate over the turn's span."""
    rows = []
    for turn in range(turns):
        done = [rs[turn] for rs in records if len(rs) > turn and rs[turn]["finish_reason"] in ("length", "stop")]
        if not done:
            continue
        ttft = [(r["arrivals"][0] - r["submitted"]) * 1e3 for r in done if r["arrivals"]]
        prompt = sum(r["prompt_tokens"] for r in done)
        cached = sum(r["request"].cached_tokens for r in done)
        tokens = sum(len(r["arrivals"]) for r in done)
        span = max(r["arrivals"][-1] for r in done if r["arrivals"]) - min(r["submitted"] for r in done) \
            if ttft else 0.0
        rows.append({"turn": turn + 1, "conversations": len(done), "context": max(r["prompt_tokens"] for r in done),
                     "prompt_tokens": prompt, "cached_tokens": cached, "prefilled_tokens": prompt - cached,
                     "ttft_p50_ms": percentile(ttft, 50) if ttft else None,
                     "ttft_p99_ms": percentile(ttft, 99) if ttft else None,
                     "output_tokens": tokens, "output_tokens_per_s": tokens / span if span > 0 else None})
    return rows


def answers_digest(records: list[dict]) -> str:
    """The first 16 hex digits of the sha256 of a conversation's answers, turn by turn."""
    answers = ";".join(",".join(map(str, r["request"].generated)) for r in records if r["request"] is not None)
    return hashlib.sha256(answers.encode()).hexdigest()[:16]


def warm_up(net, settings: dict, device: torch.device, deadline: float) -> float:
    """An untimed chat before a model's runs (one conversation of two turns of the scenario's message
    lengths and 4-token answers, the prefix cache on), so that kernel compilation and tuning at the
    prefill calls' real sizes, graph capture and the first prefix restore are not counted in the first
    run's turn 1 (kernels tuned per size on short prompts would tune again there). Returns its seconds."""
    started = time.perf_counter()
    small = settings | {"conversations": 1, "turns": 2, "max_tokens": min(4, settings["max_tokens"])}
    run_chat(net, settings=small, prefix_cache=True, device=device, deadline=deadline)
    free_memory()
    return time.perf_counter() - started


def run_name(variant: str, prefix_cache: bool | None) -> str:
    return variant if prefix_cache is None else f"{variant}, prefix cache {'on' if prefix_cache else 'off'}"


def settings_for(quick: bool, overrides: dict) -> dict:
    """The scenario's settings: the full or quick defaults under the flags given, U resolved
    (ValueError where the sizes leave no room for it)."""
    settings = dict(QUICK if quick else FULL, **{k: v for k, v in overrides.items() if v is not None})
    settings["user_tokens"] = user_tokens(settings)
    settings["last_prompt_tokens"] = last_prompt_tokens(settings)
    return settings


def bench(out: Path, *, model: str | None = None, shape: str = "smollm2", methods: list[str] = ("lizard",),
          options: dict | None = None, quick: bool = False, **overrides) -> list[Path]:
    """Each method's runs with the prefix cache on and off, then the teacher's."""
    settings = settings_for(quick, overrides)  # before anything is built: bad sizes fail at once
    device = default_device()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    settings.update(model=model, shape=None if model else shape, methods=list(methods), options=options or {},
                    dtype=str(dtype).removeprefix("torch."), quick=quick, scenario="chat")
    label = model or f"{shape} shape, random weights"
    results = new_results(NAME, f"Serving chat: {label}", device, settings)
    results.update(models=[], runs=[], comparisons=[])
    plan = [*((method, [True, False]) for method in methods), (SOFTMAX, [True])]
    remaining = sum(len(caches) for _, caches in plan)
    end = time.monotonic() + settings["time_limit"]
    for variant, caches in plan:
        net = build(settings, variant, device, dtype)
        try:
            warm_up_s = warm_up(net, settings, device, time.monotonic() + (end - time.monotonic()) / remaining)
        except Interrupted:
            finish(results, out)
            raise
        results["models"].append({"name": variant, "linearize": getattr(net.config, "linearize", None),
                                  "warm_up_s": warm_up_s})
        for prefix_cache in caches:
            deadline = time.monotonic() + (end - time.monotonic()) / remaining
            remaining -= 1
            run = {"model": run_name(variant, prefix_cache), "method": variant, "prefix_cache": prefix_cache}
            try:
                run.update(run_chat(net, settings=settings, prefix_cache=prefix_cache, device=device,
                                    deadline=deadline))
            except Interrupted as e:  # what the run had, and the runs before it, are kept
                run.update(e.point)
                record_row(results, "runs", run, out)
                finish(results, out)
                raise
            except OOM as e:
                run.update(failure(e))
            except Exception as e:  # noqa: BLE001 (recorded, and the other runs go on)
                run.update(failure(e))
            record_row(results, "runs", run, out)
            free_memory()
        del net
        free_memory()
    return finish(results, out)


def finish(results: dict, out: Path) -> list[Path]:
    results["comparisons"] = comparisons(results)
    return write_outputs(results, out, tables, plots)


def comparisons(results: dict) -> list[dict]:
    """Per method and turn: TTFT p50 with the prefix cache over without it, and the output rate with the cache
    over the teacher's; whether the two runs' answers match; the last turn against the targets."""
    runs = {(r["method"], r["prefix_cache"]): r for r in results["runs"] if r["status"] in ("ok", "cut")}
    teacher = runs.get((SOFTMAX, True))  # the baseline: the teacher as a server with prefix caching runs it
    rows = []
    for method in results["settings"]["methods"]:
        on, off = runs.get((method, True)), runs.get((method, False))
        if on is None:
            continue
        by_turn = lambda run: {} if run is None else {t["turn"]: t for t in run["turns"]}
        on_turns, off_turns, teacher_turns = by_turn(on), by_turn(off), by_turn(teacher)
        turns = []
        for turn, row in on_turns.items():
            ttft = ratio(row["ttft_p50_ms"], off_turns.get(turn, {}).get("ttft_p50_ms"))
            rate = ratio(row["output_tokens_per_s"], teacher_turns.get(turn, {}).get("output_tokens_per_s"))
            turns.append({"turn": turn, "context": row["context"], "ttft_p50_over_cache_off": ttft,
                          "output_tokens_per_s_over_teacher": rate})
        last = turns[-1] if turns and turns[-1]["turn"] == results["settings"]["turns"] else None
        rows.append({
            "method": method, "turns": turns,
            "answers_match_cache_off": None if off is None else on["answers_sha256"] == off["answers_sha256"],
            "output_tokens_per_s_over_teacher": ratio(on["output_tokens_per_s"],
                                                      None if teacher is None else teacher["output_tokens_per_s"]),
            "last_turn": None if last is None else {
                **last,
                "ttft_target_met": None if last["ttft_p50_over_cache_off"] is None else
                last["ttft_p50_over_cache_off"] <= TTFT_TARGET,
                "rate_target_met": None if last["output_tokens_per_s_over_teacher"] is None else
                last["output_tokens_per_s_over_teacher"] >= RATE_TARGET}})
    return rows


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def tables(results: dict) -> list[str]:
    settings = results["settings"]
    scenario = (f"{settings['conversations']} conversations of {settings['turns']} turns: a shared system prompt of "
                f"{settings['system_tokens']} tokens, user messages of {settings['user_tokens']} tokens, answers of "
                f"{settings['max_tokens']} tokens; each turn resubmits the whole conversation, up to "
                f"{size_label(settings['last_prompt_tokens'])} tokens at the last turn.{options_note(settings)}")
    caption = ("Per turn (prompt and prefilled tokens summed over the turn's conversations; prefilled: not restored "
               "from the prefix cache; output tokens/s over the turn's span):")
    lines = [scenario, "", caption, "",
             "| run | turn | context | prompt / prefilled tokens | TTFT p50 / p99 ms | output tokens/s |",
             "|---|---|---|---|---|---|"]
    for run in results["runs"]:
        if run["status"] not in ("ok", "cut"):
            continue
        for t in run["turns"]:
            ttft = "–" if t["ttft_p50_ms"] is None else f"{number(t['ttft_p50_ms'])} / {number(t['ttft_p99_ms'])}"
            rate = "–" if t["output_tokens_per_s"] is None else number(t["output_tokens_per_s"])
            lines.append(f"| {run['model']} | {t['turn']} | {size_label(t['context'])} | "
                         f"{t['prompt_tokens']:,} / {t['prefilled_tokens']:,} | {ttft} | {rate} |")
    caption = ("Per run (output tokens/s over the whole scenario; prefix cache: prompt tokens restored of those "
               "looked up, and the states kept at the end):")
    lines += ["", caption, "",
              "| run | output tokens/s | wall s | prefilled / prompt tokens | prefix cache | peak memory | batching |",
              "|---|---|---|---|---|---|---|"]
    for run in results["runs"]:
        if run["status"] not in ("ok", "cut"):
            lines.append(f"| {run['model']} | {run['status']} ({run.get('reason', '')}) | | | | | |")
            continue
        memory = human_bytes(run["peak_bytes"]) if run["peak_bytes"] is not None else "– (CPU)"
        model = run["model"] + (" (cut)" if run["status"] == "cut" else "")
        lines.append(f"| {model} | {number(run['output_tokens_per_s'])} | {number(run['wall_s'])} | "
                     f"{run['prefilled_tokens']:,} / {run['prompt_tokens']:,} | {cache_cell(run['prefix_cache_stats'])} "
                     f"| {memory} | {run['mode']}, {run['slots']} rows |")
    caption = (f"Against the targets (a later turn's TTFT p50 with the prefix cache at most {TTFT_TARGET:g}x "
               f"the same turn's without it; output tokens/s at least {RATE_TARGET:g}x the teacher's):")
    lines += ["", caption, "",
              "| method | turn | context | TTFT cache on / off | output tokens/s / teacher's |", "|---|---|---|---|---|"]
    show = lambda x: "–" if x is None else f"{x:.3g}x"
    for row in results["comparisons"]:
        for t in row["turns"]:
            lines.append(f"| {row['method']} | {t['turn']} | {size_label(t['context'])} | "
                         f"{show(t['ttft_p50_over_cache_off'])} | {show(t['output_tokens_per_s_over_teacher'])} |")
    lines.append("")
    for row in results["comparisons"]:
        match = {True: "the same", False: "different", None: "–"}[row["answers_match_cache_off"]]
        lines.append(f"- {row['method']}: output tokens/s over the whole scenario "
                     f"{show(row['output_tokens_per_s_over_teacher'])} the teacher's; greedy answers with the prefix "
                     f"cache on and off: {match}.")
    cut = [r for r in results["runs"] if r["status"] == "cut"]
    lines += [f"- {r['model']}: {r['reason']}." for r in cut]
    return lines


def cache_cell(stats: dict) -> str:
    if not stats.get("enabled"):
        return f"off ({stats.get('why')})"
    return (f"{stats['hit_tokens']:,} of {stats['query_tokens']:,} tokens; {stats['entries']} states, "
            f"{human_bytes(stats['bytes'])}")


def plots(results: dict, out: Path) -> list[Path]:
    from matplotlib.figure import Figure

    from ..figures import save_png

    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    for run in results["runs"]:
        xy = [(t["turn"], t["ttft_p50_ms"]) for t in run.get("turns", []) if t["ttft_p50_ms"] is not None]
        if xy:
            ax.plot(*zip(*xy), marker="o", label=run["model"])
    ax.set_yscale("log")
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT p50 (ms)")
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=7)
    path = out / f"{NAME}.ttft.png"
    save_png(fig, path, dpi=120, bbox_inches="tight")
    return [path]
