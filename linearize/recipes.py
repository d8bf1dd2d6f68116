"""Recipes: one JSON file per results row, run by one command, gathered into one table.

    linearize recipe run recipes/lizard.json [more.json ...] --out runs/ [--model SPEC]
    linearize recipe table runs/ [--into docs/results.md]

A recipe names its row and holds the `distill` settings (`DistillConfig` fields without `out`; absent
for the teacher's own row) and the `eval` settings (`linearize.eval.evaluate` arguments). A run keeps
everything under OUT/<name>/: the distilled `model/`, `eval.json` (+ .md and plots) and `run.json`
(the recipe, the wall times, the training tokens). Rerunning continues where it stopped: a finished
model is not trained again, an interrupted one resumes from its checkpoint, a finished eval is kept.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from pathlib import Path

from .eval.api import RULER
from .eval.harness import AVERAGE_METRIC, ZEROSHOT
from .eval.report import length_label

# `linearize.eval.evaluate`'s arguments, and "set": inference options of the distilled model for this
# evaluation (`convert.set_inference_options`).
EVAL_KEYS = {"tasks", "limit", "task_limits", "task_lengths", "lengths", "depths", "samples", "batch", "harness_batch",
             "seed", "set"}
TABLE_START, TABLE_END = "<!-- recipe table -->", "<!-- end of recipe table -->"


class RecipeError(ValueError):
    """A recipe file that cannot be run as written."""


@dataclasses.dataclass(frozen=True)
class Recipe:
    name: str
    row: str  # the row's label in the results table
    distill: dict | None  # DistillConfig fields except `out`; None: evaluate the model as it is
    eval: dict
    model: str = "smollm2"

    @classmethod
    def load(cls, path: str | Path) -> Recipe:
        path = Path(path)
        if not path.is_file():
            raise RecipeError(f"recipe {path} is not a file")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise RecipeError(f"recipe {path} is not valid JSON: {e}") from None
        unknown = set(raw) - {f.name for f in dataclasses.fields(cls)}
        if unknown or "eval" not in raw:
            raise RecipeError(f"recipe {path}: needs 'eval' and takes name/row/distill/eval/model, got {sorted(raw)}")
        bad_eval = set(raw["eval"]) - EVAL_KEYS
        if bad_eval:
            raise RecipeError(f"recipe {path}: unknown eval settings {sorted(bad_eval)} (known: {sorted(EVAL_KEYS)})")
        if raw.get("distill") is not None and "out" in raw["distill"]:
            raise RecipeError(f"recipe {path}: 'distill' must not set 'out' (the run directory decides it)")
        if raw["eval"].get("set"):
            _check_inference_options(path, raw.get("distill"), raw["eval"]["set"])
        name = raw.get("name", path.stem)
        if not re.fullmatch(r"[A-Za-z0-9._-]+", name):
            raise RecipeError(f"recipe {path}: name {name!r} must be letters, digits, '.', '_' or '-'")
        return cls(name=name, row=raw.get("row", name), distill=raw.get("distill"), eval=raw["eval"],
                   model=raw.get("model", "smollm2"))

    def distill_config(self, out: Path, model: str | None = None):
        from .train import DistillConfig

        return DistillConfig(**{**self.distill, "model": model or self.model, "out": str(out)})


def _check_inference_options(path: Path, distill: dict | None, options: dict) -> None:
    """An eval's "set" must name inference options of the recipe's method, with valid values."""
    from .config import ConfigError, with_inference_options

    if distill is None:
        raise RecipeError(f"recipe {path}: eval 'set' changes a distilled model; this recipe distils none")
    try:
        with_inference_options(distill.get("method"), distill.get("options", {}), options)
    except ConfigError as e:
        raise RecipeError(f"recipe {path}: eval 'set': {e}") from None


def run(recipe: Recipe, out_root: str | Path, *, model: str | None = None, device: str | None = None,
        progress: bool = True, evaluate_model: bool = True) -> Path:
    """Distil (unless the recipe is a teacher row) and evaluate, or only distil (`evaluate_model=False`:
    a later run evaluates the model it finds); returns OUT/<name>."""
    import torch

    from .eval.api import evaluate
    from .eval.report import write_json, write_report
    from .loading import load_model, load_tokenizer
    from .train import ensure_distilled

    out = Path(out_root) / recipe.name
    out.mkdir(parents=True, exist_ok=True)
    record_path = out / "run.json"
    record = json.loads(record_path.read_text()) if record_path.exists() else {}
    record["recipe"] = dataclasses.asdict(recipe)
    teacher = model or recipe.model

    def add_time(key: str, started: float) -> None:
        # Interrupted calls count too: the table reports the GPU minutes a row really took.
        record[key] = record.get(key, 0.0) + time.perf_counter() - started
        record_path.write_text(json.dumps(record, indent=2))

    subject = teacher
    if recipe.distill is not None:
        cfg = recipe.distill_config(out / "model", teacher)
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
    previous = json.loads(eval_path.read_text()) if eval_path.exists() else None
    if previous is not None and not previous["provenance"].get("partial") and record.get("evaluated") == recipe.eval:
        return out
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    started = time.perf_counter()
    try:
        tokenizer = load_tokenizer(subject)
        # bf16 on a GPU, as scripts/gpu/teacher_eval.sh evaluates the teacher; float32 on a CPU.
        settings = dict(recipe.eval)
        model = load_model(subject, device=device, dtype="bfloat16" if device == "cuda" else None,
                           inference_options=settings.pop("set", None))
        results = evaluate(model, tokenizer, **settings, model_spec=subject, resume=previous,
                           on_progress=lambda partial: write_json(partial, eval_path))
        write_report(results, eval_path)
        record["evaluated"] = recipe.eval  # a changed recipe runs again, keeping the tasks it still shares
    finally:
        add_time("eval_wall_s", started)
    return out


def _percent(value) -> str:
    return "–" if value is None else f"{100 * value:.1f}"


def _row_cells(run_dir: Path) -> dict[str, str]:
    """Column name -> cell text for one finished run directory."""
    record = json.loads((run_dir / "run.json").read_text())
    results = json.loads((run_dir / "eval.json").read_text())
    tasks = results["tasks"]
    recipe = record["recipe"]
    cells = {"row": recipe["row"], "recipe": f"`recipes/{recipe['name']}.json`"}
    tokens = record.get("training_tokens")
    cells["train tokens"] = "–" if tokens is None else f"{tokens / 1e6:g}M" if tokens >= 100_000 else f"{tokens:,}"
    wall = record.get("distill_wall_s")
    cells["train min"] = "–" if wall is None else f"{wall / 60:.1f}"
    for task in ZEROSHOT:
        if task in tasks:
            cells[task] = _percent(tasks[task].get(AVERAGE_METRIC[task]))
    if "zeroshot_average" in results:
        cells["0-shot avg"] = _percent(results["zeroshot_average"]["value"])
    if "mmlu" in tasks:
        cells["mmlu"] = _percent(tasks["mmlu"].get("acc"))
    if "ppl" in tasks:
        for r in tasks["ppl"]["by_length"]:
            cells[f"ppl {length_label(r['length'])}"] = f"{r['ppl']:.1f}"
    for name, result in tasks.items():
        for r in result.get("by_length", []) if "grid" in result else []:
            cells[f"{name} {length_label(r['length'])}"] = _percent(r["score"])
    ruler_lengths = [{r["length"]: r["score"] for r in tasks[name]["by_length"]} for name in RULER if name in tasks]
    if len(ruler_lengths) == len(RULER):
        for length in sorted(set.intersection(*(set(scores) for scores in ruler_lengths))):
            cells[f"RULER {length_label(length)}"] = _percent(sum(s[length] for s in ruler_lengths) / len(RULER))
    if results["provenance"].get("partial"):
        cells["row"] += " (partial)"
    return cells


def table(run_dirs: list[Path]) -> str:
    """A Markdown table with a row per run directory and the union of their columns, in first-seen order."""
    rows = [_row_cells(d) for d in run_dirs]
    if not rows:
        raise RecipeError("no finished runs (directories with run.json and eval.json) to tabulate")
    columns: list[str] = []
    for cells in rows:
        columns += [c for c in cells if c not in columns]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cells.get(c, "–") for c in columns) + " |" for cells in rows]
    return "\n".join(lines) + "\n"


def plot_rows(run_dirs: list[Path], path: Path) -> Path:
    """The rows side by side: perplexity, passkey and niah_single against context length."""
    from matplotlib.figure import Figure

    if not run_dirs:
        raise RecipeError("no finished runs (directories with run.json and eval.json) to plot")

    panels = [("ppl", "perplexity (log scale)"), ("passkey", "passkey accuracy (%)"),
              ("niah_single", "niah_single accuracy (%)")]
    # The legend goes below the panels, three rows' names to a line: inside a panel it hid the curves.
    fig = Figure(figsize=(16, 4.5 + 0.22 * -(-len(run_dirs) // 3)), layout="constrained")
    axes = fig.subplots(1, len(panels))
    lengths = set()
    for i, run_dir in enumerate(run_dirs):
        row = json.loads((run_dir / "run.json").read_text())["recipe"]["row"]
        tasks = json.loads((run_dir / "eval.json").read_text())["tasks"]
        for ax, (task, _) in zip(axes, panels):
            points = [(r["length"], r["ppl"] if task == "ppl" else 100 * r["score"])
                      for r in tasks.get(task, {}).get("by_length", [])]
            if points:
                lengths |= {length for length, _ in points}
                # A row's colour and line in every panel; the style changes once the 10 colours repeat.
                ax.plot(*zip(*points), marker="os^D"[i // 10 % 4], linestyle=["-", "--", ":", "-."][i // 10 % 4],
                        label=row, color=f"C{i % 10}")
    for ax, (task, label) in zip(axes, panels):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(lengths), [length_label(n) for n in sorted(lengths)])
        ax.set(xlabel="context length (tokens)", ylabel=label, title=task)
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    handles = {label: handle for ax in axes for handle, label in zip(*ax.get_legend_handles_labels())}
    fig.legend(handles.values(), handles.keys(), loc="outside lower center", ncols=3, fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def finished_runs(roots: list[Path]) -> list[Path]:
    """Run directories under `roots` (or the roots themselves) that hold both run.json and eval.json."""
    found = []
    for root in roots:
        candidates = [root] if (root / "run.json").exists() else sorted(p for p in root.iterdir() if p.is_dir())
        found += [d for d in candidates if (d / "run.json").exists() and (d / "eval.json").exists()]
    return found


def write_into(markdown_path: Path, text: str) -> None:
    """Replace the section between the table markers of `markdown_path` (appended if it has none)."""
    block = f"{TABLE_START}\n{text}{TABLE_END}\n"
    page = markdown_path.read_text() if markdown_path.exists() else ""
    if TABLE_START in page and TABLE_END in page:
        before, rest = page.split(TABLE_START, 1)
        after = rest.split(TABLE_END, 1)[1].lstrip("\n")
        page = before + block + after
    else:
        page = page + ("\n" if page and not page.endswith("\n") else "") + block
    markdown_path.write_text(page)


def register(subparsers) -> None:
    p = subparsers.add_parser("recipe", help="run results recipes and tabulate them")
    sub = p.add_subparsers(dest="recipe_command", required=True)
    r = sub.add_parser("run", help="distil and evaluate each recipe into OUT/<name>")
    r.add_argument("recipes", nargs="+", help="recipe JSON files")
    r.add_argument("--out", required=True, help="folder of run directories")
    r.add_argument("--model", help="teacher to use instead of each recipe's own (e.g. a local copy)")
    r.add_argument("--device", help="cuda or cpu (default: cuda if available)")
    r.add_argument("--no-eval", dest="evaluate", action="store_false",
                   help="distil only; a later run without it evaluates the models it finds")
    r.set_defaults(func=_run_command)
    t = sub.add_parser("table", help="a Markdown table of finished runs")
    t.add_argument("runs", nargs="+", type=Path, help="run directories or folders of them")
    t.add_argument("--into", type=Path, help="replace the recipe table section of this Markdown file")
    t.add_argument("--plot", type=Path, help="also draw the rows' perplexity and retrieval by length into this PNG")
    t.set_defaults(func=_table_command)
    g = sub.add_parser("plot", help="draw chosen finished runs' perplexity and retrieval by length (no table)")
    g.add_argument("runs", nargs="+", type=Path, help="run directories or folders of them, in legend order")
    g.add_argument("--out", type=Path, required=True, help="the PNG to write")
    g.set_defaults(func=_plot_command)


def _run_command(args) -> int:
    recipes = [Recipe.load(path) for path in args.recipes]  # every file checked before any work starts
    names = [r.name for r in recipes]
    if len(set(names)) != len(names):
        raise RecipeError(f"two recipes share a name: {names}")
    for recipe in recipes:
        out = run(recipe, args.out, model=args.model, device=args.device, evaluate_model=args.evaluate)
        print(f"recipe {recipe.name}: {out}")
    return 0


def _finished_runs_of(paths: list[Path]) -> list[Path]:
    for path in paths:
        if not path.is_dir():
            raise RecipeError(f"{path} is not a directory")
    return finished_runs(paths)


def _plot_command(args) -> int:
    print(f"wrote {plot_rows(_finished_runs_of(args.runs), args.out)}")
    return 0


def _table_command(args) -> int:
    runs = _finished_runs_of(args.runs)
    text = table(runs)
    if args.plot:
        print(f"wrote {plot_rows(runs, args.plot)}")
    if args.into:
        write_into(args.into, text)
        print(f"wrote {args.into}")
    else:
        print(text, end="")
    return 0
