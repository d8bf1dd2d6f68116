"""`linearize bench train`: training tokens/s and peak memory of distillation stages 1 and 2 against
fine-tunes of the teacher, at several sequence lengths, with and without gradient checkpointing.

Modes (`--modes`, in this order):

- `full`: a full fine-tune of the teacher, every parameter, next-token cross-entropy. The reference the
  speed targets were set against at small scale; at 8B AdamW alone needs 16 bytes a parameter (float32
  weights, gradients, two moments: 128 GB), so it is left out at the 8B shapes unless asked for.
- `lora`: the teacher's own LoRA fine-tune (rank, alpha and targets as distillation's stage 2: r=8 on
  q, k, v), next-token cross-entropy: the reference a user knows, at any scale.
- `stage1`: distillation stage 1, attention transfer (the new modules of every linearized layer).
- `stage2`: distillation stage 2, LoRA on the linearized student, next-token cross-entropy.

Every next-token loss is `losses.stage_loss`'s (chunked over the vocabulary: no [tokens, vocab]
logits). Each point (mode, gradient checkpointing off or on, sequence length) times whole optimizer
steps on random tokens: forward, backward, gradient clipping and AdamW, bf16 autocast on CUDA.
tokens/s = batch * seq_len / median step time over the timed steps after the warm-up ones; the batch is
`tokens_per_step / seq_len`, so every point trains on as many tokens a step (or `--batch` at every
length). Peak memory is torch.cuda.max_memory_allocated over the point's steps, weights included.

The model: `--model` loads the teacher as the trainer does (in bf16 under bf16 autocast, float32 on a
CPU, then moved to the device); `--shape` builds random weights of a known shape (`shapes.SHAPES`) in
bf16 directly on the device (float32 on a CPU). Either way only the trained parameters become float32
master weights, beside stage 1's new modules, which stay float32 in stage 2 as in the trainer: frozen
weights are held once, in bf16, with no gradient or AdamW state. Each mode's model is built once and
serves its points (checkpointing is switched between them).

A point that runs out of memory is recorded as OOM and the run goes on with the next; a point that would
end after the time limit (estimated from the last measured one) is skipped. The Markdown projects the
measured tokens/s onto the papers' recipe (`DistillConfig.max_tokens`, 20M tokens a stage) in GPU-hours
and says which points fit an 80 GB GPU.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from matplotlib.figure import Figure  # no pyplot: Figure.savefig renders with Agg, no display needed

from ..figures import save_png
from ..train.config import DistillConfig
from ..train.losses import stage_loss
from ..train.runtime import Runtime
from ..train.step import WARMUP_STEPS, TrainStep, make_optimizer
from ..train.student import (
    build_student,
    enable_checkpointing,
    linearized_layers,
    linearized_student,
    prepare_stage,
    upcast_to_float32,
    weights_dtype,
)
from .common import (
    GIB,
    cell,
    failure,
    free_memory,
    new_results,
    number,
    options_note,
    peak_bytes,
    record_row,
    reset_peak,
    size_label,
    time_ms,
    write_outputs,
    write_profile,
)
from .shapes import SHAPES, random_model

# key: (row label, distillation stage or None for the teacher's own fine-tunes)
MODES = {"full": ("full fine-tune (teacher)", None), "lora": ("LoRA fine-tune (teacher)", None),
         "stage1": ("stage 1 (attention transfer)", 1), "stage2": ("stage 2 (LoRA)", 2)}
CHECKPOINTING = {"off": [False], "on": [True], "both": [False, True]}

TOKENS_PER_STEP = 8 * 2048  # the recipe's batch: 8 sequences of 2K tokens
FULL = {"seq_lens": [2048], "tokens_per_step": TOKENS_PER_STEP, "steps": 10, "warmup": 3, "checkpointing": "off",
        "time_limit": 480.0}
QUICK = {"seq_lens": [64], "tokens_per_step": 128, "steps": 2, "warmup": 1, "checkpointing": "off",
         "time_limit": 120.0}
# A shape: 2K and 8K at 16K tokens a step (8 x 2K, 2 x 8K), each mode with and without checkpointing.
# Fewer steps than FULL: an 8B step takes seconds, and twelve points must end within the time limit.
SHAPE_FULL = {"seq_lens": [2048, 8192], "tokens_per_step": TOKENS_PER_STEP, "steps": 6, "warmup": 2,
              "checkpointing": "both", "time_limit": 480.0}
SHAPE_QUICK = {"seq_lens": [32, 64], "tokens_per_step": 128, "steps": 1, "warmup": 1, "checkpointing": "both",
               "time_limit": 120.0}

# An 80 GB GPU (A100 or H100 80GB) has 79.2 GiB; the CUDA context, cuBLAS workspaces and the allocator's
# fragmentation are not in max_memory_allocated: a point "fits" when its peak leaves them 3 GiB.
FIT_80GB_BYTES = 76 * GIB
RECIPE_TOKENS = DistillConfig.__dataclass_fields__["max_tokens"].default  # a stage's tokens (20M)


def default_modes(model: str | None, shape: str | None, method: str = "lizard") -> list[str]:
    """Every mode, less the full fine-tune at a shape whose AdamW state does not fit one GPU, and less
    stage 1 for Liger (it adds nothing for stage 1 to train)."""
    modes = list(MODES)
    if model is None and not SHAPES[shape].full_fine_tune_fits:
        modes.remove("full")
    if method == "liger":
        modes.remove("stage1")
    return modes


def point_settings(model: str | None, shape: str | None, quick: bool, overrides: dict) -> dict:
    """FULL / QUICK (a shape's own), `overrides` (seq_lens, tokens_per_step, batch, steps, checkpointing,
    time_limit) replacing their entries; ValueError (one line) for a combination that cannot run."""
    base = (SHAPE_QUICK if quick else SHAPE_FULL) if model is None else (QUICK if quick else FULL)
    settings = {**base, "batch": None, **{k: v for k, v in overrides.items() if v is not None}}
    settings["seq_lens"] = sorted(set(settings["seq_lens"]))
    if settings["batch"] is not None:
        settings["tokens_per_step"] = None  # the same batch at every length
    else:
        uneven = [n for n in settings["seq_lens"] if settings["tokens_per_step"] % n]
        if uneven:
            raise ValueError(f"--tokens-per-step {settings['tokens_per_step']} is not a multiple of the sequence "
                             f"length(s) {', '.join(map(str, uneven))}: every point trains on whole sequences")
    if settings["checkpointing"] not in CHECKPOINTING:
        raise ValueError(f"gradient checkpointing must be one of {', '.join(CHECKPOINTING)}, "
                         f"got {settings['checkpointing']!r}")
    return settings


def batch_of(settings: dict, seq_len: int) -> int:
    return settings["batch"] or settings["tokens_per_step"] // seq_len


def build(settings: dict, cfg: DistillConfig, mode: str, rt: Runtime, dtype: torch.dtype):
    """(model on the device, its trained parameters) for one mode, with gradient checkpointing off."""
    stage = MODES[mode][1]
    if settings["model"]:  # as the trainer builds it: loaded in the dtype it trains in, then on the device
        from ..loading import load_model

        weights = weights_dtype(rt, sharded=False)
        model = build_student(cfg, None, dtype=weights) if stage else load_model(cfg.model, dtype=weights)
    else:  # in `dtype` on the device from the start; new and trained parameters float32, as the trainer has them
        model = random_model(settings["shape"], device=rt.device, dtype=dtype, **settings.get("shape_overrides", {}))
        if stage:
            model = linearized_student(model, cfg)
    if mode != "full":
        model, _ = prepare_stage(model, cfg, stage or 2)
    model.to(rt.device)  # a loaded teacher's move (a shape's is built there)
    params = [p for p in model.parameters() if p.requires_grad]
    upcast_to_float32(params)  # the full fine-tune's: prepare_stage made the other modes' float32
    return model.train(), params


def release_step(model, params) -> None:
    """Drop what a step, finished or cut short by an OOM, leaves on the model: gradients, and the stage-1
    losses (with their graphs, and so the activations, of the layers that ran) and rotated q, k of the
    linearized layers. Otherwise the next point would start with a failed one's memory still held."""
    for p in params:
        p.grad = None
    for layer in linearized_layers(model):
        layer.transfer_loss, layer.rotated, layer.projected = None, None, ()


def set_checkpointing(model, on: bool) -> None:
    """Activation checkpointing per decoder layer, as `prepare_stage` turns it on for
    DistillConfig.gradient_checkpointing."""
    if on:
        enable_checkpointing(model)
    else:
        model.gradient_checkpointing_disable()


def measure(model, params, cfg: DistillConfig, mode: str, rt: Runtime, settings: dict, *, seq_len: int,
            checkpointing: bool, profile_to: Path | None = None) -> dict:
    """One point: a fresh optimizer and TrainStep on `model`, timed over `settings`' steps."""
    stage = MODES[mode][1] or 2  # the teacher's fine-tunes take stage 2's loss and learning rate
    batch = batch_of(settings, seq_len)
    set_checkpointing(model, checkpointing)
    cuda_graph = settings.get("cuda_graph", False)
    optimizer = make_optimizer([{"params": params, "lr": cfg.lr(stage)}], rt.device, cuda_graph=cuda_graph,
                               betas=cfg.betas, weight_decay=cfg.weight_decay)
    # Drawn on the CPU, as the trainer's batches are: an earlier point's failed graph capture can leave
    # the CUDA generator unusable outside a capture.
    ids = torch.randint(model.config.vocab_size, (batch, seq_len)).to(rt.device)
    train_step = TrainStep(lambda ids: stage_loss(model, ids, stage), params, optimizer, cfg.clip, rt.autocast,
                           cuda_graph=cuda_graph)
    reset_peak(rt.device)
    # A graphed step's warm-up covers its eager steps and the capture.
    warmup = max(settings["warmup"], WARMUP_STEPS + 1) if train_step.graphed else settings["warmup"]
    ms = time_ms(lambda: train_step([ids]), rt.device, warmup=warmup, iters=settings["steps"])
    peak = peak_bytes(rt.device)
    reserved = torch.cuda.max_memory_reserved(rt.device) if rt.device.type == "cuda" else None
    if profile_to is not None:
        write_profile(lambda: train_step([ids]), rt.device, profile_to)
    return {"step_ms": ms, "tokens_per_s": batch * seq_len * 1e3 / ms, "peak_bytes": peak,
            "peak_reserved_bytes": reserved, "fits_80gb": None if peak is None else peak <= FIT_80GB_BYTES,
            "step_path": train_step.path}


def profile_name(mode: str, seq_len: int, checkpointing: bool) -> str:
    return f"profile-{mode}-{size_label(seq_len)}{'-checkpointing' if checkpointing else ''}.txt"


def bench(out: Path, *, model: str | None = None, shape: str | None = None, method: str = "lizard",
          options: dict | None = None, modes: list[str] | None = None, quick: bool = False, profile: bool = False,
          cuda_graph: bool = False, shape_overrides: dict | None = None, dtype: torch.dtype | None = None,
          **overrides) -> list[Path]:
    """Time every point of `modes` (default: `default_modes`) on `model` (loaded) or `shape` (random weights;
    `shape_overrides` replace entries of its config, e.g. a layer count); without either, `--model smollm2`.
    `overrides` replace entries of the settings (`point_settings`). `dtype` is a shape's build dtype
    (default bf16 on CUDA, float32 on a CPU).

    With `profile`, each point also writes `profile_name(...)` (the top ops of one more step). With
    `cuda_graph`, each point's step replays a CUDA graph, as `distill --cuda-graph` trains (each row's
    `step_path` says whether it did).
    """
    if model is None and shape is None:
        model = "smollm2"
    if model is not None and shape is not None:
        raise ValueError("give a model to load or a shape to build, not both")
    modes = list(modes or default_modes(model, shape, method))
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"unknown mode(s) {', '.join(unknown)}: choose among {', '.join(MODES)}")
    settings = point_settings(model, shape, quick, overrides)
    rt = Runtime.start(None, "auto")
    dtype = dtype or (torch.bfloat16 if rt.device.type == "cuda" else torch.float32)  # CPU bf16 is unrepresentative
    # The stages timed; checked as distill checks them (Liger has no stage 1; STILL's budget must leave its
    # linear state tokens at the shortest length).
    cfg = DistillConfig(model=model or shape, method=method, out=str(out), stage="both" if "stage1" in modes else "2",
                        seq_len=settings["seq_lens"][0], batch=batch_of(settings, settings["seq_lens"][0]),
                        options=options or {})
    settings.update(model=model, shape=shape, method=method, options=options or {}, modes=modes, quick=quick,
                    precision="bf16 autocast" if rt.bf16 else "float32", attention=attention_path(method, rt.device),
                    recipe_tokens=RECIPE_TOKENS, lora={"r": cfg.lora_r, "alpha": cfg.lora_alpha,
                                                       "targets": list(cfg.lora_targets)})
    if shape is not None:
        settings.update(weights=str(dtype).removeprefix("torch."), shape_overrides=shape_overrides or {})
    if cuda_graph:
        settings["cuda_graph"] = True
    label = model or f"{shape} shape, random weights"
    results = new_results("train", f"Training throughput: {label}, {method}", rt.device, settings)
    results["rows"] = []
    points = [(c, n) for c in CHECKPOINTING[settings["checkpointing"]] for n in settings["seq_lens"]]
    end = time.monotonic() + settings["time_limit"]
    last = 0.0  # seconds of the last measured point (with its model's build, for a mode's first); 0: none yet
    for mode in modes:
        name, stage = MODES[mode]
        started = time.monotonic()
        built, why = None, None
        if last and started + last > end:
            why = {"status": "skipped", "reason": "would pass the time limit"}
        else:
            try:
                built = build(settings, cfg, mode, rt, dtype)
            except Exception as e:  # noqa: BLE001 (an OOM building it: its points say so, the other modes run)
                why = failure(e)
            free_memory()
        for checkpointing, seq_len in points:
            row = {"mode": name, "key": mode, "stage": stage, "seq_len": seq_len,
                   "batch": batch_of(settings, seq_len), "gradient_checkpointing": checkpointing}
            if built is not None:
                row["trained_parameters"] = sum(p.numel() for p in built[1])
            if why is not None:
                row.update(why)
            elif last and time.monotonic() + last > end:
                row.update(status="skipped", reason="would pass the time limit")
            else:
                try:
                    profile_to = out / profile_name(mode, seq_len, checkpointing) if profile else None
                    row.update(status="ok", **measure(*built, cfg, mode, rt, settings, seq_len=seq_len,
                                                      checkpointing=checkpointing, profile_to=profile_to))
                except Exception as e:  # noqa: BLE001 (OOM or a broken mode: record it, time the other points)
                    row.update(failure(e))
                release_step(*built)
                free_memory()  # after the except block, so an OOM's traceback no longer holds its tensors
                last = time.monotonic() - started
                row["wall_s"] = last
                started = time.monotonic()
            record_row(results, "rows", row, out)
        del built
        free_memory()
    return write_outputs(results, out, tables, plots)


def attention_path(method: str, device: torch.device) -> str:
    """Which attention code the student runs here, for the record (`--backend torch` turns the kernels off)."""
    from ..ops import backend

    if device.type != "cuda" or not backend.use_kernels():
        return "PyTorch ops"
    if method == "still":
        return "STILL Triton kernels (routing in PyTorch)"
    if method not in ("lizard", "liger"):
        return "PyTorch ops"
    from ..ops.gla_window.triton import Config

    return f"Triton kernel, {Config.default(torch.bfloat16)}"


# Tables. A row without `key`, `seq_len` or `gradient_checkpointing` (a run of one length without
# checkpointing, as the train.json files under docs/results/h200/ are) takes its key from its mode's
# label, its length from the settings, and checkpointing off.
LABEL_KEYS = {label: key for key, (label, _) in MODES.items()}


def row_key(r: dict) -> str:
    return r.get("key") or LABEL_KEYS.get(r["mode"], r["mode"])


def point_of(r: dict, settings: dict) -> tuple[int, bool]:
    return r.get("seq_len", settings.get("seq_len")), r.get("gradient_checkpointing", False)


def point_label(r: dict, settings: dict) -> str:
    """"stage 2 (LoRA), 8K, checkpointing": a row's mode and point, for the notes under the table."""
    seq_len, checkpointing = point_of(r, settings)
    return f"{r['mode']}, {size_label(seq_len)}{', checkpointing' if checkpointing else ''}"


def gib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / GIB:.2f}"


def fits(r: dict) -> str:
    return "n/a" if r.get("peak_bytes") is None else ("yes" if r["peak_bytes"] <= FIT_80GB_BYTES else "no")


def hours(tokens: int, tokens_per_s: float) -> float:
    """GPU-hours to train on `tokens` at `tokens_per_s` (one GPU)."""
    return tokens / tokens_per_s / 3600


def tables(results: dict) -> list[str]:
    s, rows = results["settings"], results["rows"]
    attention = (f" Student attention: {s['attention']}." if "attention" in s else "") + options_note(s)
    if s.get("tokens_per_step"):
        batches = f"{s['tokens_per_step']:,} tokens a step (batch × sequence length)"
    elif "seq_lens" in s:
        batches = f"batch {s['batch']} at every sequence length"
    else:
        batches = f"Batch {s['batch']} × {s['seq_len']} tokens"
    weights = f", {s['weights']} weights" if s.get("weights") else ""
    lines = [
        (f"{batches}, {s['precision']}{weights}, AdamW; median of {s['steps']} optimizer steps after "
         f"{s['warmup']} warm-up steps. Peak GiB: torch.cuda.max_memory_allocated, weights included; fits 80 GB: "
         f"a peak of at most {FIT_80GB_BYTES // GIB} GiB.{attention}"),
        "",
    ]
    by_point = {(row_key(r), *point_of(r, s)): r for r in rows if r["status"] == "ok"}
    references = [key for key in ("full", "lora") if any(row_key(r) == key for r in rows)]
    header = ["mode", "seq len × batch", "checkpointing", "trained parameters", "tokens/s",
              *(f"vs the {MODES[key][0].split(' (')[0]}" for key in references), "ms per step", "peak GiB",
              "fits 80 GB"]
    lines += ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]

    def ratio(key):
        def fmt(r):
            reference = by_point.get((key, *point_of(r, s)))
            return "–" if reference is None else f"{r['tokens_per_s'] / reference['tokens_per_s']:.2f}x"
        return fmt

    columns = (lambda r: number(r["tokens_per_s"]), *(ratio(key) for key in references),
               lambda r: number(r["step_ms"]), lambda r: gib(r["peak_bytes"]), fits)
    for r in rows:
        seq_len, checkpointing = point_of(r, s)
        batch = r.get("batch", s.get("batch"))
        trained = f"{r['trained_parameters']:,}" if r.get("trained_parameters") else "–"  # known after an OOM too
        lines.append(f"| {r['mode']} | {size_label(seq_len)} × {batch} | {'on' if checkpointing else 'off'} | "
                     f"{trained} | " + " | ".join(cell(r, fmt) for fmt in columns) + " |")
    reasons = [f"- {point_label(r, s)}: {r['reason']}" for r in rows if r.get("reason")]
    if s.get("cuda_graph"):
        reasons += [f"- {point_label(r, s)}: step {r['step_path']}" for r in rows if r.get("step_path")]
    lines += [""] + reasons + ([""] if reasons else [])
    return lines + projection(results)


def fastest(rows: list[dict], key: str, seq_len: int, settings: dict, within: int | None) -> dict | None:
    """The fastest measured point of mode `key` at `seq_len`, among those whose peak is at most `within` bytes."""
    candidates = [r for r in rows if r["status"] == "ok" and row_key(r) == key and point_of(r, settings)[0] == seq_len
                  and (within is None or (r["peak_bytes"] is not None and r["peak_bytes"] <= within))]
    return max(candidates, key=lambda r: r["tokens_per_s"], default=None)


def projection(results: dict) -> list[str]:
    """GPU-hours of the papers' recipe at the measured speeds: `recipe_tokens` a stage at each stage's fastest
    point (with or without checkpointing), on this GPU and within an 80 GB GPU's memory."""
    s, rows = results["settings"], results["rows"]
    tokens = s.get("recipe_tokens", RECIPE_TOKENS)
    keys = [k for k in ("stage1", "stage2", "lora") if any(row_key(r) == k for r in rows)]
    if not tokens or not {"stage1", "stage2"} & set(keys):
        return []
    env = results["environment"]
    budgets = [(f"this {'GPU' if env['device_type'] == 'cuda' else 'device'} ({env['device']})", None)]
    if any(r.get("peak_bytes") is not None for r in rows):
        budgets.append(("80 GB", FIT_80GB_BYTES))
    lines = [
        (f"**Projection: the papers' recipe, {tokens / 1e6:g}M tokens a stage ({2 * tokens / 1e6:g}M in all) on one "
         "GPU.** Hours = tokens / tokens/s / 3600, at each mode's fastest point (checkpointing on or off) at "
         "that length; \"80 GB\" takes the fastest point whose peak fits an 80 GB GPU (at this GPU's speed)."),
        "",
        "| seq len | memory | " + " | ".join(f"{MODES[k][0]}: hours" for k in keys)
        + (" | both stages: GPU-hours |" if {"stage1", "stage2"} <= set(keys) else " |"),
        "|---|---|" + "---|" * (len(keys) + ({"stage1", "stage2"} <= set(keys))),
    ]
    for seq_len in sorted({point_of(r, s)[0] for r in rows}):
        for name, within in budgets:
            best = {k: fastest(rows, k, seq_len, s, within) for k in keys}
            cells = []
            for k in keys:
                r = best[k]
                if r is not None:
                    cells.append(f"{hours(tokens, r['tokens_per_s']):,.1f} (checkpointing "
                                 f"{'on' if point_of(r, s)[1] else 'off'}, {number(r['tokens_per_s'])} tokens/s)")
                elif within is not None and fastest(rows, k, seq_len, s, None) is not None:
                    cells.append("does not fit")
                else:  # nothing measured: every point ran out of memory, failed or was skipped
                    statuses = {r["status"] for r in rows if row_key(r) == k and point_of(r, s)[0] == seq_len}
                    cells.append("OOM" if statuses == {"oom"} else "–")
            if {"stage1", "stage2"} <= set(keys):
                both = [best["stage1"], best["stage2"]]
                cells.append("–" if None in both else
                             f"{sum(hours(tokens, r['tokens_per_s']) for r in both):,.1f}")
            lines.append(f"| {size_label(seq_len)} | {name} | " + " | ".join(cells) + " |")
    return lines + [""]


def plots(results: dict, out: Path) -> list[Path]:
    s = results["settings"]
    rows = [r for r in results["rows"] if r["status"] == "ok"]
    labels = [f"{r['mode']}, {size_label(point_of(r, s)[0])}{', ckpt' if point_of(r, s)[1] else ''}" for r in rows]
    fig = Figure(figsize=(7, 1.5 + 0.3 * max(1, len(rows))), layout="constrained")
    ax = fig.add_subplot()
    ax.barh(labels, [r["tokens_per_s"] for r in rows])
    ax.invert_yaxis()
    ax.set(xlabel="training tokens/s", title=results["title"])
    ax.title.set_fontsize(9)
    ax.tick_params(axis="y", labelsize=8)
    ax.grid(alpha=0.3, axis="x")
    path = out / "train.png"
    save_png(fig, path, dpi=120)
    return [path]
