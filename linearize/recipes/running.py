"""Running a recipe: distil (resuming what a run left), evaluate, and keep the run's record (`run.json`)."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from .files import Recipe, display_path

# linearize.eval and linearize.train (torch, lm-eval) are imported inside the functions that use them: the
# command's parser stays fast.


def run(recipe: Recipe, out_root: str | Path, *, model: str | None = None, device: str | None = None,
        progress: bool = True, evaluate_model: bool = True) -> Path:
    """Distil (unless the recipe is a teacher row) and evaluate, or only distil (`evaluate_model=False`:
    a later run evaluates the model it finds); returns OUT/<name>."""
    recipe.check_eval()  # also with evaluate_model=False: the later run would find it bad after the training
    root = Path(out_root)
    out = root / recipe.name
    made_root, made_out = not root.exists(), not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        return _run_in(out, recipe, model=model, device=device, progress=progress, evaluate_model=evaluate_model)
    except Exception:
        # A run refused before any work (bad input) leaves nothing behind; one that trained keeps its
        # checkpoint, so that rerunning resumes it. The runs folder goes only if empty: runs started
        # beside this one (other processes) may have made theirs in it since.
        if made_out and all(p.name == "run.json" for p in out.rglob("*") if p.is_file()):
            shutil.rmtree(out)
        if made_root:
            try:
                root.rmdir()
            except OSError:
                pass
        raise


def _run_in(out: Path, recipe: Recipe, *, model, device, progress, evaluate_model) -> Path:
    from ..cli_args import default_device
    from ..eval.api import evaluate
    from ..eval.report import write_json, write_report
    from ..eval.results_file import read_results
    from ..loading import load_model, load_tokenizer
    from ..train import ensure_distilled
    from ..train.run_dir import check_saved_run

    teacher = model or recipe.model
    cfg = recipe.distill_config(out / "model", teacher) if recipe.distill is not None else None
    if cfg is not None:
        # Before the record takes this call's settings: a model trained with others is refused, and its
        # run.json keeps saying what it was trained with.
        check_saved_run(cfg)
    record_path = out / "run.json"
    record = json.loads(record_path.read_text()) if record_path.exists() else {}
    record["recipe"] = recipe.settings()
    record["source"] = display_path(recipe.source) if recipe.source is not None else None
    record["overrides"] = list(recipe.overrides)

    def add_time(key: str, started: float) -> None:
        # Interrupted calls count too: the table reports the GPU minutes a row really took.
        record[key] = record.get(key, 0.0) + time.perf_counter() - started
        record_path.write_text(json.dumps(record, indent=2))

    subject = teacher
    if cfg is not None:
        record["training_tokens"] = cfg.max_tokens * len(cfg.stages)
        subject = str(out / "model")
        finished_before = (out / "model" / "config.json").exists()
        started = time.perf_counter()
        try:
            ensure_distilled(cfg, progress=progress)
        finally:
            if not finished_before:
                add_time("distill_wall_s", started)
    record_path.write_text(json.dumps(record, indent=2))
    if not evaluate_model:
        return out

    eval_path = out / "eval.json"
    previous = read_results(eval_path) if eval_path.exists() else None
    if previous is not None and not previous["provenance"].get("partial") and record.get("evaluated") == recipe.eval:
        return out
    device = default_device(device)
    started = time.perf_counter()
    try:
        tokenizer = load_tokenizer(subject)
        # bf16 on a GPU, as experiments/gpu/teacher_eval.sh evaluates the teacher; float32 on a CPU.
        model = load_model(subject, device=device, dtype="bfloat16" if device == "cuda" else None,
                           inference_options=recipe.eval.get("set"))
        results = evaluate(model, tokenizer, recipe.eval_config(), model_spec=subject, resume=previous,
                           on_progress=lambda partial: write_json(partial, eval_path))
        write_report(results, eval_path)
        record["evaluated"] = recipe.eval  # a changed recipe runs again, keeping the tasks it still shares
    finally:
        add_time("eval_wall_s", started)
    return out
