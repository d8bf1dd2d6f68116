"""`linearize bench model`: prefill latency, decode speed and GPU memory of linearized models vs softmax (SDPA).

A point (batch b, context c) prefills c random tokens with use_cache=True, then runs single-token decode steps
continuing from that cache (median ms per step; a linear model steps through `linearize.decode.StaticDecoder`,
a CUDA graph per step on a GPU). The softmax teacher prefills in one forward, as HF does; a linear
model prefills in calls of `prefill_chunk` tokens (across the batch) that continue the same cache, so its
memory stays bounded at any context and batch. Peak memory is torch.cuda.max_memory_allocated, reset before the
prefill and again before the decode; `cache_bytes` is `linearize.cache_nbytes` of the cache after the prefill.
Each model gets two sweeps: batch at `batch_context`, then context at batch 1. Speed needs no trained weights,
so `--shape` builds random ones.

The GEMM floor (`gemm_floor_point`) is measured on the teacher's own weights in the same run, at every context
of the batch-1 sweep: the time of each layer's projections and MLP alone, over the same tokens in the same
calls as a linear model's prefill. No attention can prefill faster than that, so a method's prefill is
reported as a multiple of it.

A point that runs out of memory is recorded as OOM and the larger points of its sweep are skipped; a point that
would end past the model's share of the time limit (estimated from the previous point, cost taken to grow with the
number of tokens) is skipped too, so a sweep ends on time whatever the device.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
from matplotlib.figure import Figure  # no pyplot: Figure.savefig renders with Agg, no display needed

from ..cache import cache_nbytes, compact_softmax_layers
from ..convert import convert
from ..decode import StaticDecoder, fully_linearized
from ..figures import save_png
from ..fused_projections import FusedProjection, fusable, fuse_projections
from .common import (
    GIB,
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
    time_ms,
    wall_ms,
    write_outputs,
    write_profile,
)
from .shapes import random_model  # the shapes' table and builder, shared with bench train

SOFTMAX = "softmax (sdpa)"
FLOOR = "GEMM floor"  # not a model: the teacher's projections and MLPs alone (`gemm_floor_point`)
DEFAULT_METHODS = ("lizard",)  # compared with softmax unless --methods names others

# Short prefills are timed as the median of a few runs; long ones once (each takes seconds).
SHORT_PREFILL_REPEATS = 3

FULL = {"contexts": parse_sizes("1k,2k,4k,8k,16k,32k,64k,128k,256k,512k,1m"), "batches": [1, 4, 16, 64],
        "batch_context": 4096, "decode_steps": 32, "decode_warmup": 3, "prefill_chunk": 16384,
        "teacher_max": 128 * 1024, "time_limit": 420.0, "compile_decode": None}
QUICK = {"contexts": [64, 256], "batches": [1, 2], "batch_context": 64, "decode_steps": 3, "decode_warmup": 1,
         "prefill_chunk": 128, "teacher_max": 256, "time_limit": 120.0, "compile_decode": None}


def build(settings: dict, variant: str, device: torch.device, dtype: torch.dtype):
    """The teacher (loaded, or random weights of a known shape), converted unless `variant` is softmax."""
    if settings["model"]:
        from ..loading import load_model

        model = load_model(settings["model"], dtype=dtype, device=device)
        model.set_attn_implementation("sdpa")
    else:
        model = random_model(settings["shape"], device=device, dtype=dtype, **settings.get("shape_overrides", {}))
    if variant != SOFTMAX:
        # A named variant (`--variant`): its method, its options over the shared ones.
        own = (settings.get("variants") or {}).get(variant, {"method": variant, "options": {}})
        convert(model, own["method"], softmax_layers=hybrid_softmax_layers(model, settings.get("softmax_layers")),
                layers=settings.get("layers") or "all", **{**settings.get("options", {}), **own["options"]})
        # Once for the whole sweep, prefill and decode alike: fused anew per decoder, every point's new fused
        # weights could fail the compiled step's guards and compile it again (~1 min each at the 8B shape).
        fuse_projections(model)
    return model.eval()


def hybrid_softmax_layers(model, even: int | None) -> list[int]:
    """The layers a hybrid keeps softmax: `even` of them, evenly spaced over the decoder (as the recipes'
    `softmax_by: even` picks them); none without it."""
    if not even:
        return []
    from ..train.layer_selection import even_layers

    return even_layers(list(range(model.config.num_hidden_layers)), even)


def prefill_chunk(variant: str, context: int, batch: int, settings: dict) -> int:
    """Tokens per sequence in one prefill call: all of them for softmax; for a linear model (and the
    GEMM floor), `prefill_chunk` tokens across the batch, so that its activations stay bounded at any batch."""
    return context if variant == SOFTMAX else max(1, settings["prefill_chunk"] // batch)


def profile_point(variant: str, settings: dict) -> tuple[int, int]:
    """(context, tokens per call) of the profiled batch-1 prefill: two calls for a linear model, so the
    profile shows a fresh and a continued pass, one for softmax. It never exceeds the sweep's largest
    context: a method whose fresh pass is quadratic (STILL's kernels) took minutes at twice a 128K chunk."""
    context = min(2 * settings["prefill_chunk"], settings["contexts"][-1])
    if variant == SOFTMAX:
        context = min(context, settings["teacher_max"])
        return context, context
    return context, max(1, context // 2)


def measure_point(model, *, batch: int, context: int, chunk: int, settings: dict, device: torch.device,
                  profile_to: str | None = None) -> dict:
    """One (batch, context) point; with `profile_to`, one more prefill and decode step under
    torch.profiler write their top ops to `<profile_to>-prefill.txt` and `<profile_to>-decode.txt`."""
    ids = torch.randint(model.config.vocab_size, (batch, context), device=device)
    last = {}

    def prefill():
        last.clear()  # drop the previous run's cache before building a new one
        cache = None
        for start in range(0, context, chunk):
            out = model(input_ids=ids[:, start:start + chunk], past_key_values=cache, use_cache=True,
                        logits_to_keep=1)
            cache = out.past_key_values
        compact_softmax_layers(cache)
        last.update(cache=cache, token=out.logits[:, -1:].argmax(-1))

    repeats = SHORT_PREFILL_REPEATS if batch * context <= settings["prefill_chunk"] else 1
    times = []
    for _ in range(repeats):
        reset_peak(device)
        times.append(wall_ms(prefill, device))
    point = {"prefill_ms": statistics.median(times), "prefill_repeats": repeats,
             "prefill_calls": -(-context // chunk), "prefill_peak_bytes": peak_bytes(device),
             "cache_bytes": cache_nbytes(last["cache"])}
    if profile_to:
        write_profile(prefill, device, Path(f"{profile_to}-prefill.txt"))

    decoder = None
    if fully_linearized(model):
        # A linear model decodes on its fixed-shape cache: a CUDA graph per step where the method allows.
        # (One that keeps softmax sliding layers steps as HF does: their caches are HF's.)
        decoder = StaticDecoder(model, last["cache"], batch=batch, compile_backend=settings["compile_decode"])

        def step():
            last["token"] = decoder.step(last["token"])[:, -1:].argmax(-1)
    else:
        def step():
            out = model(input_ids=last["token"], past_key_values=last["cache"], use_cache=True, logits_to_keep=1)
            last["token"] = out.logits[:, -1:].argmax(-1)

    reset_peak(device)
    step_ms = time_ms(step, device, warmup=settings["decode_warmup"], iters=settings["decode_steps"])
    if profile_to:
        write_profile(step, device, Path(f"{profile_to}-decode.txt"))
    path = "eager" if decoder is None else decoder.path
    if decoder is not None:
        decoder.close()  # frees its graph now (the projections stay fused: `build` fused them)
    return dict(point, decode_ms=step_ms, decode_tokens_per_s=batch * 1e3 / step_ms,
                decode_peak_bytes=peak_bytes(device), decode_path=path)


def gemm_floor_point(model, *, batch: int, context: int, chunk: int, settings: dict, device: torch.device) -> dict:
    """The prefill's GEMM floor at one point: for every decoder layer of the (unconverted) teacher, its
    attention's projections and its MLP (GEMMs and activation) on random activations of the point's
    tokens, in calls of `chunk` tokens a sequence as a linear model's prefill, and fused as a linear
    model runs them: q, k and v as one GEMM, gate and up as another. Attention itself, norms,
    residuals, embedding and head are left out: they are what a method adds."""
    layers = model.get_decoder().layers
    dtype = next(model.parameters()).dtype
    undo_mlp = fuse_projections(model)  # only the MLPs: the teacher's attention is not a linearized one
    qkv = {}
    for i, layer in enumerate(layers):
        parts = [getattr(layer.self_attn, name, None) for name in ("q_proj", "k_proj", "v_proj")]
        if fusable(parts):
            qkv[i] = FusedProjection(parts)
    try:
        # Each layer's GEMMs on one input: the fused q/k/v, then every other Linear of its attention.
        others = [[m for m in layer.self_attn.modules()
                   if isinstance(m, torch.nn.Linear) and m not in (qkv[i].linears if i in qkv else ())]
                  for i, layer in enumerate(layers)]
        tokens = batch * min(chunk, context)
        # Random inputs once per width, outside the timing (o_proj's input width is the attention's).
        widths = {model.config.hidden_size} | {m.in_features for linears in others for m in linears}
        inputs = {width: torch.randn(tokens, width, device=device, dtype=dtype) for width in widths}
        x = inputs[model.config.hidden_size]

        def run():
            for start in range(0, context, chunk):
                rows = batch * (min(start + chunk, context) - start)
                for i, layer in enumerate(layers):
                    if i in qkv:
                        qkv[i].split(x[:rows])
                    for linear in others[i]:
                        linear(inputs[linear.in_features][:rows])
                    layer.mlp(x[:rows])

        repeats = SHORT_PREFILL_REPEATS if batch * context <= settings["prefill_chunk"] else 1
        ms = statistics.median(wall_ms(run, device) for _ in range(repeats))
    finally:
        for fused in qkv.values():
            fused.undo()
        if undo_mlp is not None:
            undo_mlp()
    return {"prefill_ms": ms, "prefill_repeats": repeats, "prefill_calls": -(-context // chunk)}


def sweep(model, variant: str, name: str, points: list[tuple[int, int]], settings: dict, device, deadline: float,
          results: dict, out: Path, *, measure) -> None:
    """Measure (batch, context) points in increasing size until OOM or until the deadline would pass;
    `measure` is `measure_point` or `gemm_floor_point`."""
    stop, previous = None, None  # why the rest is skipped; (tokens, seconds) of the last measured point
    for batch, context in points:
        row = {"model": variant, "sweep": name, "batch": batch, "context": context}
        tokens = batch * context
        if stop:
            row.update(status="skipped", reason=stop)
        elif variant == SOFTMAX and context > settings["teacher_max"]:
            row.update(status="skipped", reason=f"softmax runs up to {size_label(settings['teacher_max'])} tokens")
        elif previous and time.monotonic() + previous[1] * tokens / previous[0] > deadline:
            row.update(status="skipped", reason="would pass the time limit")
        else:
            started = time.monotonic()
            try:
                chunk = prefill_chunk(variant, context, batch, settings)
                row.update(status="ok", **measure(model, batch=batch, context=context, chunk=chunk,
                                                  settings=settings, device=device))
            except Exception as e:  # noqa: BLE001 (OOM or a broken model: record it, go on with the next sweep)
                row.update(failure(e))
                stop = f"{row['status']} at batch {batch}, context {size_label(context)}"
            previous = (tokens, time.monotonic() - started)
            row["wall_s"] = previous[1]
        free_memory()  # after the except block, so an OOM's traceback no longer holds its tensors
        record_row(results, "points", row, out)


def bench(out: Path, *, model: str | None = None, shape: str = "smollm2", methods: list[str] = DEFAULT_METHODS,
          options: dict | None = None, quick: bool = False, profile: bool = False, **overrides) -> list[Path]:
    """Run both sweeps for softmax and each method (converted with `options`); `overrides` replace entries
    of FULL / QUICK. With `profile`, each model then writes `profile-<model>-{prefill,decode}.txt`
    (`softmax` for SDPA): the top ops of a batch-1 prefill (`profile_point`) and of one decode step after it."""
    device = default_device()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # CPU bf16 matmuls are unrepresentative
    settings = dict(QUICK if quick else FULL, **{k: v for k, v in overrides.items() if v is not None})
    # Ascending, because a sweep stops at its first OOM and estimates each point from the one before.
    settings.update(contexts=sorted(set(settings["contexts"])), batches=sorted(set(settings["batches"])))
    settings.update(model=model, shape=None if model else shape, methods=list(methods), options=options or {},
                    dtype=str(dtype).removeprefix("torch."), quick=quick, prefill_chunk_across_batch=True)
    label = model or f"{shape} shape, random weights"
    results = new_results("model", f"Model speed: {label}", device, settings)
    results.update(models=[], points=[])
    variants = [SOFTMAX, *methods, *(settings.get("variants") or {})]
    end = time.monotonic() + settings["time_limit"]
    for i, variant in enumerate(variants):
        deadline = time.monotonic() + (end - time.monotonic()) / (len(variants) - i)  # a fair share of the rest
        net = build(settings, variant, device, dtype)
        results["models"].append({
            "name": variant, "parameters": sum(p.numel() for p in net.parameters()),
            "weights_bytes": sum(p.numel() * p.element_size() for p in net.parameters()),
            "attn_implementation": net.config._attn_implementation,
            "linearize": getattr(net.config, "linearize", None)})
        with torch.inference_mode():
            # Warm-up (kernel selection, allocator): one small point, not recorded.
            first = settings["contexts"][0]
            measure_point(net, batch=1, context=first, chunk=prefill_chunk(variant, first, 1, settings),
                          settings=settings, device=device)
            batch_points = [(b, settings["batch_context"]) for b in settings["batches"]]
            sweep(net, variant, "batch", batch_points, settings, device, deadline, results, out, measure=measure_point)
            sweep(net, variant, "context", [(1, c) for c in settings["contexts"]], settings, device, deadline,
                  results, out, measure=measure_point)
            if variant == SOFTMAX:
                # On the teacher's weights before any conversion, chunked as the linear models prefill.
                sweep(net, FLOOR, "context", [(1, c) for c in settings["contexts"]], settings, device, deadline,
                      results, out, measure=gemm_floor_point)
            if profile:
                context, chunk = profile_point(variant, settings)
                measure_point(net, batch=1, context=context, chunk=chunk, settings=settings, device=device,
                              profile_to=str(out / f"profile-{variant.split()[0]}"))
        del net
        free_memory()
    return write_outputs(results, out, tables, plots)


def gib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / GIB:.2f}"


def tables(results: dict) -> list[str]:
    settings, points = results["settings"], results["points"]
    variants = [m["name"] for m in results["models"]]
    by = {(p["model"], p["sweep"], p["batch"], p["context"]): p for p in points}
    contexts, batches = settings["contexts"], settings["batches"]

    def table(caption, first, keys, sweep, fmt):
        lines = [caption, "", f"| {first} | " + " | ".join(variants) + " |", "|---" * (len(variants) + 1) + "|"]
        for batch, context in keys:
            label = size_label(context) if sweep == "context" else str(batch)
            cells = [cell(by.get((v, sweep, batch, context)), fmt) for v in variants]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        return lines + [""]

    context_keys = [(1, c) for c in contexts]
    floor = {c: by[(FLOOR, "context", 1, c)] for c in contexts if (FLOOR, "context", 1, c) in by}

    def prefill_cell(p):
        measured = floor.get(p["context"])
        if measured is None or measured["status"] != "ok":
            return number(p["prefill_ms"])
        return f"{number(p['prefill_ms'])} ({p['prefill_ms'] / measured['prefill_ms']:.2f}x)"

    floor_note = (" In brackets: the prefill as a multiple of the GEMM floor at that context (the teacher's "
                  "projections and MLPs alone, in the linear models' calls)." if floor else "")
    floor_lines = [f"| {size_label(c)} | " + cell(floor[c], lambda p: number(p["prefill_ms"])) + " |"
                   for c in contexts if c in floor]
    lines = [
        (f"{settings['dtype']}; softmax prefills in one forward, linear models in calls of "
         f"{size_label(settings['prefill_chunk'])} tokens "
         f"({'across the batch' if settings.get('prefill_chunk_across_batch') else 'per sequence'}) continuing "
         "the cache; decode: median of "
         f"{settings['decode_steps']} steps after {settings['decode_warmup']} warm-up steps. Peak memory is "
         f"torch.cuda.max_memory_allocated (weights included).{options_note(settings)}"),
        "",
        *table(f"**Prefill latency, batch 1** (ms).{floor_note}", "context", context_keys, "context", prefill_cell),
        *([f"**{FLOOR}, batch 1** (ms)", "", "| context | ms |", "|---|---|", *floor_lines, ""] if floor_lines else []),
        *table("**Decode, batch 1** (tokens/s · peak GiB while decoding · cache size)", "context", context_keys,
               "context", lambda p: f"{number(p['decode_tokens_per_s'])} · {gib(p['decode_peak_bytes'])} · "
                                    f"{human_bytes(p['cache_bytes'])}"),
        *table(f"**Decode vs batch, context {size_label(settings['batch_context'])}** (tokens/s · peak GiB)",
               "batch", [(b, settings["batch_context"]) for b in batches], "batch",
               lambda p: f"{number(p['decode_tokens_per_s'])} · {gib(p['decode_peak_bytes'])}"),
    ]
    reasons = dict.fromkeys(f"{p['model']}: {p['reason']}" for p in points if p.get("reason"))
    return lines + [f"- not measured: {r}" for r in reasons] + ([""] if reasons else [])


def plot(results: dict, out: Path, name: str, sweep: str, curves, ylabel: str, log_y: bool = True,
         extra: tuple[str, ...] = ()) -> Path:
    """One line per model (and per name in `extra`, the GEMM floor) and curve over the sweep's x values;
    `curves` maps a legend suffix to a value getter."""
    x_key = "context" if sweep == "context" else "batch"
    fig = Figure(figsize=(6.5, 4.5), layout="constrained")
    ax = fig.add_subplot()
    for model in [m["name"] for m in results["models"]] + list(extra):
        for suffix, value in curves.items():
            xy = [(p[x_key], value(p)) for p in results["points"]
                  if p["model"] == model and p["sweep"] == sweep and p["status"] == "ok" and value(p) is not None]
            if xy:
                ax.plot(*zip(*xy), marker="o", linestyle="--" if "prefill" in suffix else "-", label=model + suffix)
    xs = results["settings"]["contexts" if sweep == "context" else "batches"]
    ax.set_xscale("log", base=2)
    if log_y:
        ax.set_yscale("log")
    ax.set_xticks(xs, [size_label(x) if sweep == "context" else str(x) for x in xs])
    batch_note = f" (context {size_label(results['settings']['batch_context'])})" if sweep == "batch" else " (batch 1)"
    ax.set(xlabel=x_key + batch_note, ylabel=ylabel, title=results["title"])
    ax.title.set_fontsize(9)
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "nothing measured here (memory is only measured on CUDA)", ha="center",
                transform=ax.transAxes)
    path = out / f"model.{name}.png"
    save_png(fig, path, dpi=120)
    return path


def plots(results: dict, out: Path) -> list[Path]:
    def in_gib(key):
        return lambda p: None if p[key] is None else p[key] / GIB

    return [
        plot(results, out, "prefill", "context", {"": lambda p: p["prefill_ms"]}, "prefill ms", extra=(FLOOR,)),
        plot(results, out, "decode", "context", {"": lambda p: p["decode_tokens_per_s"]}, "decode tokens/s"),
        plot(results, out, "memory", "context",
             {" decode": in_gib("decode_peak_bytes"), " prefill": in_gib("prefill_peak_bytes")}, "peak GiB",
             log_y=False),
        plot(results, out, "batch", "batch", {"": lambda p: p["decode_tokens_per_s"]}, "decode tokens/s"),
    ]
