"""`linearize bench train`: training tokens/s of distillation stage 1 and stage 2 vs a full fine-tune of the teacher.

Each mode builds its model as the trainer does (`build_student` + `prepare_stage`: float32 master weights, bf16
autocast on CUDA), then times whole optimizer steps on random tokens: forward, backward, gradient clipping and
AdamW. tokens/s = batch * seq_len / median step time over the timed steps after the warm-up ones. The full
fine-tune trains every teacher parameter with the same loss as stage 2 (next-token cross-entropy).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from matplotlib.figure import Figure  # no pyplot: Figure.savefig renders with Agg, no display needed

from ..train.config import DistillConfig
from ..train.distillation import build_student, frozen_projections_to, prepare_stage, stage_loss
from ..train.runtime import Runtime
from ..train.step import WARMUP_STEPS, TrainStep, step_optimizer
from .common import (
    GIB,
    cell,
    failure,
    free_memory,
    new_results,
    number,
    options_note,
    peak_bytes,
    reset_peak,
    save_json,
    time_ms,
    write_outputs,
    write_profile,
)

MODES = {"full fine-tune (teacher)": None, "stage 1 (attention transfer)": 1, "stage 2 (LoRA)": 2}  # name: stage

FULL = {"seq_len": 2048, "batch": 8, "steps": 10, "warmup": 3}
QUICK = {"seq_len": 64, "batch": 2, "steps": 2, "warmup": 1}


def build(cfg: DistillConfig, stage: int | None):
    """(model, its trained parameters) for one mode, on the CPU as the trainer builds it."""
    if stage is None:
        from ..loading import load_model

        model = load_model(cfg.model)
        return model, list(model.parameters())
    model, _ = prepare_stage(build_student(cfg, None), cfg, stage)
    return model, [p for p in model.parameters() if p.requires_grad]


def measure(model, params, cfg: DistillConfig, stage: int | None, rt: Runtime, settings: dict,
            profile_to: Path | None = None) -> dict:
    model.to(rt.device).train()
    if rt.bf16:
        frozen_projections_to(model, torch.bfloat16)  # as the trainer stores them (a no-op for the full fine-tune)
    cuda_graph = settings.get("cuda_graph", False)
    optimizer = step_optimizer([{"params": params, "lr": cfg.lr(stage or 2)}], rt.device, cuda_graph=cuda_graph,
                               betas=cfg.betas, weight_decay=cfg.weight_decay)
    # Drawn on the CPU, as the trainer's batches are: an earlier mode's failed graph capture can leave
    # the CUDA generator unusable outside a capture.
    ids = torch.randint(model.config.vocab_size, (cfg.batch, cfg.seq_len)).to(rt.device)
    train_step = TrainStep(lambda batch: stage_loss(model, batch, stage or 2), params, optimizer, cfg.clip,
                           rt.autocast, cuda_graph=cuda_graph)

    reset_peak(rt.device)
    # A graphed step's warm-up covers its eager steps and the capture.
    warmup = max(settings["warmup"], WARMUP_STEPS + 1) if train_step.graphed else settings["warmup"]
    ms = time_ms(lambda: train_step([ids]), rt.device, warmup=warmup, iters=settings["steps"])
    if profile_to is not None:
        write_profile(lambda: train_step([ids]), rt.device, profile_to)
    return {"step_ms": ms, "tokens_per_s": cfg.batch * cfg.seq_len * 1e3 / ms, "peak_bytes": peak_bytes(rt.device),
            "trained_parameters": sum(p.numel() for p in params), "step_path": train_step.path}


def bench(out: Path, *, model: str = "smollm2", method: str = "lizard", options: dict | None = None,
          quick: bool = False, profile: bool = False, cuda_graph: bool = False, **overrides) -> list[Path]:
    """Time the three modes; `overrides` (seq_len, batch, steps) replace entries of FULL / QUICK.

    With `profile`, each mode also writes `profile-<stage>.txt` (the top ops of one more step). With
    `cuda_graph`, each mode's step replays a CUDA graph, as `distill --cuda-graph` trains (each row's
    `step_path` says whether it did).
    """
    settings = dict(QUICK if quick else FULL, **{k: v for k, v in overrides.items() if v is not None})
    if cuda_graph:
        settings["cuda_graph"] = True
    rt = Runtime.start(None, "auto")
    settings.update(model=model, method=method, options=options or {},
                    precision="bf16 autocast" if rt.bf16 else "float32", quick=quick,
                    attention=attention_path(method, rt.device))
    cfg = DistillConfig(model=model, method=method, out=str(out), seq_len=settings["seq_len"], batch=settings["batch"],
                        options=options or {})
    results = new_results("train", f"Training throughput: {model}, {method}", rt.device, settings)
    results["rows"] = []
    for mode, stage in MODES.items():
        row = {"mode": mode, "stage": stage}
        started = time.perf_counter()
        try:
            profile_to = out / f"profile-{stage or 'teacher'}.txt" if profile else None
            row.update(status="ok", **measure(*build(cfg, stage), cfg, stage, rt, settings, profile_to))
        except Exception as e:  # noqa: BLE001 (OOM or a broken mode: record it, time the others)
            row.update(failure(e))
        row["wall_s"] = time.perf_counter() - started
        free_memory()  # after the except block, so an OOM's traceback no longer holds its tensors
        results["rows"].append(row)
        save_json(results, out)
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


def tables(results: dict) -> list[str]:
    s = results["settings"]
    attention = (f" Student attention: {s['attention']}." if "attention" in s else "") + options_note(s)
    lines = [
        (f"Batch {s['batch']} × {s['seq_len']} tokens, {s['precision']}, AdamW; median of {s['steps']} optimizer "
         f"steps after {s['warmup']} warm-up steps.{attention}"),
        "",
        "| mode | trained parameters | tokens/s | vs the full fine-tune | ms per step | peak GiB |",
        "|---|---|---|---|---|---|",
    ]
    # The targets are ratios to the teacher's full fine-tune measured in the same run.
    full = next((r for r in results["rows"] if r["stage"] is None and r["status"] == "ok"), None)
    columns = (lambda r: f"{r['trained_parameters']:,}", lambda r: number(r["tokens_per_s"]),
               lambda r: "–" if full is None else f"{r['tokens_per_s'] / full['tokens_per_s']:.2f}x",
               lambda r: number(r["step_ms"]),
               lambda r: "n/a" if r["peak_bytes"] is None else f"{r['peak_bytes'] / GIB:.2f}")
    for r in results["rows"]:
        lines.append(f"| {r['mode']} | " + " | ".join(cell(r, fmt) for fmt in columns) + " |")
    reasons = [f"- {r['mode']}: {r['reason']}" for r in results["rows"] if r.get("reason")]
    if s.get("cuda_graph"):
        reasons += [f"- {r['mode']}: step {r['step_path']}" for r in results["rows"] if r.get("step_path")]
    return lines + [""] + reasons + ([""] if reasons else [])


def plots(results: dict, out: Path) -> list[Path]:
    rows = [r for r in results["rows"] if r["status"] == "ok"]
    fig = Figure(figsize=(6.5, 3.5), layout="constrained")
    ax = fig.add_subplot()
    ax.barh([r["mode"] for r in rows], [r["tokens_per_s"] for r in rows])
    ax.invert_yaxis()
    ax.set(xlabel="training tokens/s", title=results["title"])
    ax.title.set_fontsize(9)
    ax.grid(alpha=0.3, axis="x")
    path = out / "train.png"
    fig.savefig(path, dpi=120)
    return [path]
