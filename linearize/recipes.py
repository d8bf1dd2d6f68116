"""Recipes: one file per results row, run by one command, gathered into one table.

    linearize recipe list                                   # the shipped rows: name, file, row label
    linearize recipe run lizard-window-256 [more ...] --out runs/ [--model SPEC] [KEY=VALUE ...]
    linearize recipe run recipes/lizard.yaml --out runs/ distill.max_tokens=100000 eval.samples=1
    linearize recipe table runs/ [--into docs/results.md]

A recipe is a YAML (or JSON) mapping that names its row and holds the `distill` settings
(`DistillConfig` fields without `out`; absent or null for the teacher's own row), the `eval` settings
(`linearize.eval.evaluate` arguments) and the teacher `model`. `extends: PARENT` starts from another
recipe: mappings merge key by key (but `eval.task_limits` and `eval.task_lengths`, which name the tasks of
one evaluation, replace the parent's whole), any other value (a list too) replaces the parent's, and `name` and
`row` are never inherited (they default to the file's stem). PARENT is a path relative to the file, or
relative to the shipped `recipes/` folder, or the name of a shipped recipe (`recipes/**/NAME.yaml`).

The shipped recipes: the main rows in `recipes/`, the ablations in `recipes/ablations/`, the rows on the
second teacher in `recipes/gemma3/`, the hybrids' layer-selection rows (`distill.softmax_by`) in
`recipes/hybrids/`, rows scored by generation too in `recipes/generative/`, and the bases they extend in
`recipes/base/` (`eval.yaml`, the evaluation every row runs; `distill.yaml`, the training every student
shares; `gemma3.yaml`, the Gemma rows' teacher and their evaluation to 128K; `hybrids.yaml`, the hybrid
rows' evaluation: RULER at 4K, BABILong and niah_single to 16K; `gemma3-hybrids.yaml`, the same on Gemma
to 32K), which are not rows themselves. `recipe run` takes a file or a shipped recipe's
name, and KEY=VALUE overrides of the resolved recipe (dotted keys, YAML values) for every recipe it runs.

A run keeps everything under OUT/<name>/: the distilled `model/`, `eval.json` (+ .md and plots) and
`run.json` (the resolved recipe, the file it came from and the overrides, the wall times, the training
tokens). Rerunning continues where it stopped: a finished model is not trained again, an interrupted one
resumes from its checkpoint, a finished eval is kept; a rerun with other training settings (`distill`,
the teacher) is refused, naming them, and leaves the run as it was.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import json
import re
import shutil
import time
from pathlib import Path

import yaml

# linearize.eval (torch, lm-eval) is imported inside the functions that use it: the parser stays fast.

# `linearize.eval.evaluate`'s arguments, and "set": inference options of the distilled model for this
# evaluation (`convert.set_inference_options`).
EVAL_KEYS = {"tasks", "limit", "task_limits", "task_lengths", "lengths", "depths", "samples", "batch", "harness_batch",
             "seed", "set", "chat_template"}
RECIPE_KEYS = ("name", "row", "model", "distill", "eval")
SUFFIXES = (".yaml", ".yml", ".json")
RECIPES_DIR = Path(__file__).resolve().parents[1] / "recipes"  # the shipped recipes (a source checkout)
BASE_DIR = "base"  # under RECIPES_DIR: what recipes extend, not rows
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
    # Where it came from (not settings): the file, and the command line's KEY=VALUE overrides.
    source: Path | None = dataclasses.field(default=None, compare=False)
    overrides: tuple[str, ...] = dataclasses.field(default=(), compare=False)

    @classmethod
    def load(cls, path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
        """The recipe in `path` with its `extends` chain resolved and `overrides` ("a.b=value") applied."""
        path = Path(path)
        if path.resolve().is_relative_to(RECIPES_DIR / BASE_DIR):
            raise RecipeError(f"recipe {path} is a base that recipes extend, not a row")
        raw = _resolve(path, ())
        for item in overrides:
            _override(raw, path, item)
        unknown = set(raw) - set(RECIPE_KEYS)
        if unknown or "eval" not in raw:
            raise RecipeError(f"recipe {path}: needs 'eval' and takes {'/'.join(RECIPE_KEYS)}/extends, "
                              f"got {sorted(raw)}")
        if not isinstance(raw["eval"], dict):
            raise RecipeError(f"recipe {path}: 'eval' must be a mapping, got {raw['eval']!r}")
        bad_eval = set(raw["eval"]) - EVAL_KEYS
        if bad_eval:
            raise RecipeError(f"recipe {path}: unknown eval settings {sorted(bad_eval)} (known: {sorted(EVAL_KEYS)})")
        name = raw.get("name", path.stem)
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9._-]+", name):
            raise RecipeError(f"recipe {path}: name {name!r} must be letters, digits, '.', '_' or '-'")
        distill = raw.get("distill")
        if isinstance(distill, dict) and type(distill.get("stage")) is int:  # YAML reads `stage: 2` as a number
            distill["stage"] = str(distill["stage"])
        recipe = cls(name=name, row=str(raw.get("row", name)), distill=distill, eval=raw["eval"],
                     model=raw.get("model", "smollm2"), source=path, overrides=tuple(overrides))
        if recipe.distill is not None:
            _check_distill(path, recipe)
        if raw["eval"].get("set"):
            _check_inference_options(path, raw.get("distill"), raw["eval"]["set"])
        return recipe

    def settings(self) -> dict:
        """What the row runs: name, row, distill, eval and model (not where they came from)."""
        return {key: getattr(self, key) for key in RECIPE_KEYS}

    def check_eval(self) -> None:
        """Parse the eval settings as the evaluation will (task names, lengths, depths), so that a bad
        one fails before a row trains, not after. Imports the evaluation (torch): run, not list."""
        from .eval import api

        where = _display(self.source) if self.source is not None else self.name
        if "tasks" not in self.eval:
            raise RecipeError(f"recipe {where}: eval: no 'tasks' to evaluate (e.g. tasks: ppl,zeroshot)")
        try:
            tasks = api.parse_tasks(self.eval["tasks"])
            for key, parse in (("lengths", api.parse_lengths), ("depths", api.parse_depths)):
                if key in self.eval:
                    parse(self.eval[key])
            for key, check, what in (("task_lengths", api.parse_task_lengths, "lengths"),
                                     ("task_limits", api.check_task_limits, "limits")):
                try:
                    check(tasks, self.eval.get(key) or {})
                except api.TaskNotInRun as e:
                    # Most often inherited from a parent that runs more tasks (`extends` or `eval.tasks=`).
                    raise RecipeError(f"recipe {where}: eval: {e}; override eval.{key}=null (or set {what} for "
                                      "this run's tasks)") from None
            if "chat_template" in self.eval:
                api.check_chat_template(self.eval["chat_template"])
        except RecipeError:
            raise
        except (ValueError, TypeError, AttributeError) as e:
            raise RecipeError(f"recipe {where}: eval: {e}") from None

    def distill_config(self, out: Path, model: str | None = None):
        from .train import DistillConfig

        return DistillConfig(**{**self.distill, "model": model or self.model, "out": str(out)})


def _read(path: Path) -> dict:
    """One file's own mapping, its keys checked (`extends` unresolved)."""
    if not path.is_file():
        raise RecipeError(f"recipe {path} is not a file")
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise RecipeError(f"recipe {path} is not UTF-8 text") from None
    if path.suffix == ".json":
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise RecipeError(f"recipe {path} is not valid JSON: {e}") from None
    else:
        try:
            raw = yaml.safe_load(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
            problem = getattr(e, "problem", None) or type(e).__name__
            raise RecipeError(f"recipe {path} is not valid YAML: {problem}{where}") from None
    if not isinstance(raw, dict):
        raise RecipeError(f"recipe {path}: needs a mapping with 'eval', got {type(raw).__name__}")
    unknown = sorted(str(key) for key in set(raw) - {*RECIPE_KEYS, "extends"})
    if unknown:
        raise RecipeError(f"recipe {path}: unknown key {unknown[0]!r}: a recipe needs 'eval' and takes "
                          f"{'/'.join(RECIPE_KEYS)}/extends, got {sorted(str(key) for key in raw)}")
    return raw


def _resolve(path: Path, chain: tuple[Path, ...]) -> dict:
    """`path`'s mapping merged over its `extends` chain's; `chain` holds the files that extend it."""
    here = path.resolve()
    if here in chain:
        cycle = " -> ".join(str(p) for p in (*chain, here)[chain.index(here):])
        raise RecipeError(f"recipe {chain[-1]}: extends cycle {cycle}")
    raw = _read(path)
    parent = raw.pop("extends", None)
    if parent is None:
        return raw
    if not isinstance(parent, str) or not parent:
        raise RecipeError(f"recipe {path}: 'extends' names one recipe (a path or a name), got {parent!r}")
    inherited = _resolve(_find_parent(parent, path), (*chain, here))
    for key in ("name", "row"):  # they label this file's row: a child that does not set them takes its stem
        inherited.pop(key, None)
    return _merge(inherited, raw)


# Per-task mappings of an evaluation: a child's names the tasks of its own evaluation, so it replaces.
REPLACED = {("eval", "task_limits"), ("eval", "task_lengths")}


def _merge(base: dict, child: dict, path: tuple = ()) -> dict:
    """`child` over `base`: mappings merge key by key (except those in REPLACED); anything else in
    `child` replaces."""
    merged = dict(base)
    for key, value in child.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict) and (*path, key) not in REPLACED:
            merged[key] = _merge(merged[key], value, (*path, key))
        else:
            merged[key] = value
    return merged


def _with_suffixes(path: Path) -> list[Path]:
    return [path] if path.suffix in SUFFIXES else [path.with_name(path.name + s) for s in SUFFIXES]


def _find_parent(parent: str, child: Path) -> Path:
    for folder in (child.parent, RECIPES_DIR):
        for candidate in _with_suffixes(folder / parent):
            if candidate.is_file():
                return candidate
    if "/" not in parent:
        found = _shipped_named(parent, bases=True)
        if found:
            return found
    raise RecipeError(f"recipe {child}: extends {parent!r}, which is neither a file next to it or under "
                      f"{RECIPES_DIR} nor a recipe's name")


def _shipped(bases: bool = False) -> list[Path]:
    """The shipped recipe files: main rows, then the ablations (and other folders), each by name."""
    if not RECIPES_DIR.is_dir():
        return []
    files = [p for p in RECIPES_DIR.rglob("*") if p.suffix in SUFFIXES and p.is_file()]
    if not bases:
        files = [p for p in files if p.relative_to(RECIPES_DIR).parts[0] != BASE_DIR]
    return sorted(files, key=lambda p: (len(p.relative_to(RECIPES_DIR).parts) > 1, p.parent, p.stem))


def _shipped_named(name: str, bases: bool = False) -> Path | None:
    found = [p for p in _shipped(bases) if p.stem == name]
    if len(found) > 1:
        raise RecipeError(f"recipe {name}: more than one shipped recipe has that name: {[str(p) for p in found]}")
    return found[0] if found else None


def find(spec: str | Path) -> Path:
    """The recipe file `spec` names: a path, or the name of a shipped recipe (not a base)."""
    path = Path(spec)
    if path.is_file():
        return path
    if isinstance(spec, str) and "/" not in spec and path.suffix not in SUFFIXES:
        found = _shipped_named(spec)
        if found:
            return found
        raise RecipeError(f"recipe {spec} is not a file nor a shipped recipe's name (`linearize recipe list`)")
    raise RecipeError(f"recipe {path} is not a file")


def shipped() -> list[Recipe]:
    """Every shipped row's recipe: main rows (recipes/*.yaml), then ablations, each group by name."""
    return [Recipe.load(p) for p in _shipped()]


def _override(raw: dict, path: Path, item: str) -> None:
    """Set one dotted KEY=VALUE (the value read as YAML) in the resolved mapping `raw`."""
    key, sep, text = item.partition("=")
    parts = key.split(".")
    if not sep or not all(re.fullmatch(r"[A-Za-z0-9_-]+", p) for p in parts):
        raise RecipeError(f"recipe {path}: override {item!r} is not KEY=VALUE with a dotted KEY "
                          "(e.g. distill.max_tokens=100000)")
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise RecipeError(f"recipe {path}: override {item!r}: the value is not YAML "
                          f"({getattr(e, 'problem', None) or type(e).__name__})") from None
    node = raw
    for depth, part in enumerate(parts):
        at = tuple(parts[:depth])
        known = _known_keys(at)
        if known is not None and part not in known and part not in node:
            where = f"'{'.'.join(at)}'" if at else "a recipe"
            raise RecipeError(f"recipe {path}: override {item!r}: unknown key {key!r} "
                              f"({where} takes {', '.join(sorted(known))})")
        if depth == len(parts) - 1:
            node[part] = value
            return
        if node.get(part) is None:
            if (*at, part) == ("distill",):
                raise RecipeError(f"recipe {path}: override {item!r}: this recipe distils no model (no 'distill')")
            node[part] = {}
        elif not isinstance(node[part], dict):
            raise RecipeError(f"recipe {path}: override {item!r}: {'.'.join((*at, part))!r} is "
                              f"{node[part]!r}, not a mapping")
        node = node[part]


def _known_keys(at: tuple[str, ...]) -> set[str] | None:
    """The keys a recipe's mapping at `at` takes (None: any)."""
    if at == ():
        return set(RECIPE_KEYS)
    if at == ("eval",):
        return EVAL_KEYS
    if at == ("distill",):
        from .train import DistillConfig

        return {f.name for f in dataclasses.fields(DistillConfig)} - {"out"}
    return None


def _check_distill(path: Path, recipe: Recipe) -> None:
    """`distill` must make a valid DistillConfig and method config."""
    from .config import ConfigError, make_method_config
    from .train import DistillConfig

    if not isinstance(recipe.distill, dict):
        raise RecipeError(f"recipe {path}: 'distill' must be a mapping (or null), got {recipe.distill!r}")
    if "out" in recipe.distill:
        raise RecipeError(f"recipe {path}: 'distill' must not set 'out' (the run directory decides it)")
    unknown = set(recipe.distill) - {f.name for f in dataclasses.fields(DistillConfig)}
    if unknown:
        raise RecipeError(f"recipe {path}: unknown distill settings {sorted(unknown)} (DistillConfig's fields)")
    if "method" not in recipe.distill:
        raise RecipeError(f"recipe {path}: 'distill' needs a 'method'")
    try:
        cfg = recipe.distill_config(Path("model"))
        make_method_config(cfg.method, **cfg.options)
    except (ConfigError, TypeError, ValueError) as e:
        raise RecipeError(f"recipe {path}: distill: {e}") from None


def _check_inference_options(path: Path, distill: dict | None, options: dict) -> None:
    """An eval's "set" must name inference options of the recipe's method, with valid values."""
    from .config import ConfigError, with_inference_options

    if distill is None:
        raise RecipeError(f"recipe {path}: eval 'set' changes a distilled model; this recipe distils none")
    if not isinstance(options, dict):
        raise RecipeError(f"recipe {path}: eval 'set' must be a mapping of inference options, got {options!r}")
    try:
        with_inference_options(distill.get("method"), distill.get("options", {}), options)
    except ConfigError as e:
        raise RecipeError(f"recipe {path}: eval 'set': {e}") from None


def run(recipe: Recipe, out_root: str | Path, *, model: str | None = None, device: str | None = None,
        progress: bool = True, evaluate_model: bool = True) -> Path:
    """Distil (unless the recipe is a teacher row) and evaluate, or only distil (`evaluate_model=False`:
    a later run evaluates the model it finds); returns OUT/<name>."""
    recipe.check_eval()  # also with evaluate_model=False: the later run would find it bad after the training
    out = Path(out_root) / recipe.name
    created = [d for d in (Path(out_root), out) if not d.exists()]
    out.mkdir(parents=True, exist_ok=True)
    try:
        return _run_in(out, recipe, model=model, device=device, progress=progress, evaluate_model=evaluate_model)
    except Exception:
        # A run refused before any work (bad input) leaves nothing behind; one that trained keeps its
        # checkpoint, so that rerunning resumes it.
        for folder in reversed(created):
            if all(p.name == "run.json" for p in folder.rglob("*") if p.is_file()):
                shutil.rmtree(folder)
        raise


def _run_in(out: Path, recipe: Recipe, *, model, device, progress, evaluate_model) -> Path:
    from .cli_args import default_device
    from .eval.api import evaluate
    from .eval.report import write_json, write_report
    from .loading import load_model, load_tokenizer
    from .train import ensure_distilled
    from .train.distillation import check_saved_run

    teacher = model or recipe.model
    cfg = recipe.distill_config(out / "model", teacher) if recipe.distill is not None else None
    if cfg is not None:
        # Before the record takes this call's settings: a model trained with others is refused, and its
        # run.json keeps saying what it was trained with.
        check_saved_run(cfg)
    record_path = out / "run.json"
    record = json.loads(record_path.read_text()) if record_path.exists() else {}
    record["recipe"] = recipe.settings()
    record["source"] = _display(recipe.source) if recipe.source is not None else None
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
    previous = json.loads(eval_path.read_text()) if eval_path.exists() else None
    if previous is not None and not previous["provenance"].get("partial") and record.get("evaluated") == recipe.eval:
        return out
    device = default_device(device)
    started = time.perf_counter()
    try:
        tokenizer = load_tokenizer(subject)
        # bf16 on a GPU, as experiments/gpu/teacher_eval.sh evaluates the teacher; float32 on a CPU.
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


def _display(path: Path) -> str:
    """How a run's record names its recipe file: under `recipes/` for a shipped one, else as found."""
    path = Path(path).resolve()
    for root in (RECIPES_DIR.parent, Path.cwd()):
        if path.is_relative_to(root):
            return path.relative_to(root).as_posix()
    return str(path)


def _command_cell(record: dict) -> str:
    """The table's `recipe` cell: the file the row ran (a record without one: the shipped recipe of its
    name), then any command-line overrides."""
    source = record.get("source")
    if source is None:
        shipped_file = _shipped_named(record["recipe"]["name"])
        source = _display(shipped_file) if shipped_file else record["recipe"]["name"]
    return " ".join([f"`{source}`", *(f"`{o}`" for o in record.get("overrides", []))])


def _percent(value) -> str:
    return "–" if value is None else f"{100 * value:.1f}"


def _layer_ranges(layers: list[int]) -> str:
    """[0, 1, 3, 4, 5, 9] -> "0, 1, 3-5, 9": runs of three or more consecutive layers as a range."""
    runs: list[list[int]] = []
    for layer in sorted(layers):
        if runs and layer == runs[-1][-1] + 1:
            runs[-1].append(layer)
        else:
            runs.append([layer])
    return ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 2 else ", ".join(map(str, run)) for run in runs)


LEAD_COLUMNS = ("row", "recipe", "train tokens", "train min", "softmax layers")


def _row_cells(run_dir: Path) -> dict[str, str]:
    """Column name -> cell text for one finished run directory."""
    from .eval.api import RULER
    from .eval.babilong import BABILONG_TASKS
    from .eval.generative import ZEROSHOT_GEN
    from .eval.harness import AVERAGE_METRIC, ZEROSHOT
    from .eval.report import length_label
    from .eval.ruler import RULER_TASKS

    record = json.loads((run_dir / "run.json").read_text())
    results = json.loads((run_dir / "eval.json").read_text())
    tasks = results["tasks"]
    recipe = record["recipe"]
    cells = {"row": recipe["row"], "recipe": _command_cell(record)}
    tokens = record.get("training_tokens")
    cells["train tokens"] = "–" if tokens is None else f"{tokens / 1e6:g}M" if tokens >= 100_000 else f"{tokens:,}"
    wall = record.get("distill_wall_s")
    cells["train min"] = "–" if wall is None else f"{wall / 60:.1f}"
    kept = (results["provenance"].get("method_config") or {}).get("softmax_layers")
    if kept:  # a hybrid: the layers the student keeps softmax
        cells["softmax layers"] = _layer_ranges(kept)
    for task in ZEROSHOT:
        if task in tasks:
            cells[task] = _percent(tasks[task].get(AVERAGE_METRIC[task]))
    if "zeroshot_average" in results:
        cells["0-shot avg"] = _percent(results["zeroshot_average"]["value"])
    # Generative scoring (docs/evaluation.md), only for rows that ran it: its average next to the 0-shot one.
    if "zeroshot_gen_average" in results:
        cells["gen avg"] = _percent(results["zeroshot_gen_average"]["value"])
    for task in ZEROSHOT_GEN:
        if task in tasks:
            cells[task.removesuffix("_gen") + " gen"] = _percent(tasks[task].get("acc"))
    if "squad_gen" in tasks:
        cells["squad EM"] = _percent(tasks["squad_gen"].get("exact_match"))
        cells["squad F1"] = _percent(tasks["squad_gen"].get("f1"))
    if "mmlu" in tasks:
        cells["mmlu"] = _percent(tasks["mmlu"].get("acc"))
    if "ppl" in tasks:
        for r in tasks["ppl"]["by_length"]:
            cells[f"ppl {length_label(r['length'])}"] = f"{r['ppl']:.1f}"
    for name, result in tasks.items():
        for r in result.get("by_length", []) if "grid" in result else []:
            cells[f"{name} {length_label(r['length'])}"] = _percent(r["score"])
    # A family's average at each length all its tasks ran at: the four RULER-style tasks of the main
    # rows ("RULER"), RULER's own twelve ("RULER-12") and BABILong's five.
    for label, family in (("RULER", RULER), ("RULER-12", RULER_TASKS), ("BABILong", BABILONG_TASKS)):
        by_length = [{r["length"]: r["score"] for r in tasks[name]["by_length"]} for name in family if name in tasks]
        if len(by_length) == len(family):
            for length in sorted(set.intersection(*(set(scores) for scores in by_length))):
                cells[f"{label} {length_label(length)}"] = _percent(sum(s[length] for s in by_length) / len(family))
    if results["provenance"].get("partial"):
        cells["row"] += " (partial)"
    return cells


def table(run_dirs: list[Path], keep: list[str] | None = None) -> str:
    """A Markdown table with a row per run directory and the union of their columns, in first-seen order;
    with `keep` (shell-style patterns such as "BABILong *"), the row column and those matching one."""
    rows = [_row_cells(d) for d in run_dirs]
    if not rows:
        raise RecipeError("no finished runs (directories with run.json and eval.json) to tabulate")
    columns: list[str] = []
    for cells in rows:
        columns += [c for c in cells if c not in columns]
    # What a row is leads, whichever row brings it: a hybrid's softmax layers sit by its training.
    columns.sort(key=lambda c: LEAD_COLUMNS.index(c) if c in LEAD_COLUMNS else len(LEAD_COLUMNS))
    if keep is not None:
        for pattern in keep:
            if not any(fnmatch.fnmatchcase(c, pattern) for c in columns):
                raise RecipeError(f"--columns: {pattern!r} matches none of these rows' columns: {', '.join(columns)}")
        columns = ["row", *(c for c in columns if c != "row" and any(fnmatch.fnmatchcase(c, k) for k in keep))]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cells.get(c, "–") for c in columns) + " |" for cells in rows]
    return "\n".join(lines) + "\n"


def _curves(tasks: dict) -> dict[str, list[tuple[int, float]]]:
    """{panel: [(length, value)]} of one run's results: perplexity, passkey and niah_single accuracy (%),
    and the BABILong tasks' average (%) at each length all of them ran."""
    from .eval.report import families_run, family_average

    curves = {"ppl": [(r["length"], r["ppl"]) for r in tasks.get("ppl", {}).get("by_length", [])]}
    for task in ("passkey", "niah_single"):
        curves[task] = [(r["length"], 100 * r["score"]) for r in tasks.get(task, {}).get("by_length", [])]
    for title, _, _, family in families_run(tasks):
        if title == "BABILong":
            curves[title] = [(length, 100 * score) for length, score in family_average(family).items()]
    return curves


# The panels `plot_rows` can draw, in order, with their y labels; it draws those some row has.
PLOT_PANELS = {"ppl": "perplexity (log scale)", "passkey": "passkey accuracy (%)",
               "niah_single": "niah_single accuracy (%)", "BABILong": "BABILong QA1-QA5 average (%)"}


def plot_rows(run_dirs: list[Path], path: Path) -> Path:
    """The rows side by side against context length: perplexity, passkey, niah_single and the BABILong
    average, each panel where at least one row has it."""
    from matplotlib.figure import Figure

    from .eval.report import length_label

    if not run_dirs:
        raise RecipeError("no finished runs (directories with run.json and eval.json) to plot")
    rows = [(json.loads((d / "run.json").read_text())["recipe"]["row"],
             _curves(json.loads((d / "eval.json").read_text())["tasks"])) for d in run_dirs]
    panels = [name for name in PLOT_PANELS if any(curves.get(name) for _, curves in rows)]
    if not panels:
        raise RecipeError("none of these runs has perplexity, passkey, niah_single or BABILong by length to plot")
    # The legend goes below the panels (inside one it hid the curves): three names to a line, or one
    # where a name is too long to share its line.
    ncols = 3 if max(len(row) for row, _ in rows) <= 70 else 1
    fig = Figure(figsize=(5.3 * len(panels) + 0.1, 4.5 + 0.22 * -(-len(rows) // ncols)), layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    lengths = set()
    for i, (row, curves) in enumerate(rows):
        for ax, panel in zip(axes, panels):
            if points := curves.get(panel):
                lengths |= {length for length, _ in points}
                # A row's colour and line in every panel; the style changes once the 10 colours repeat.
                ax.plot(*zip(*points), marker="os^D"[i // 10 % 4], linestyle=["-", "--", ":", "-."][i // 10 % 4],
                        label=row, color=f"C{i % 10}")
    for ax, panel in zip(axes, panels):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(lengths), [length_label(n) for n in sorted(lengths)])
        ax.set(xlabel="context length (tokens)", ylabel=PLOT_PANELS[panel], title=panel)
        ax.grid(alpha=0.3)
        if panel == "ppl":
            ax.set_yscale("log")
    handles = {label: handle for ax in axes for handle, label in zip(*ax.get_legend_handles_labels())}
    fig.legend(handles.values(), handles.keys(), loc="outside lower center", ncols=ncols, fontsize=8)
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
    r = sub.add_parser("run", help="distil and evaluate each recipe into OUT/<name>",
                       usage="linearize recipe run RECIPE [RECIPE ...] [KEY=VALUE ...] --out OUT [--model SPEC] "
                             "[--device DEVICE] [--no-eval]",
                       description="KEY=VALUE words override the resolved recipes' settings, e.g. "
                                   "distill.max_tokens=100000 eval.samples=1 (dotted keys, YAML values).")
    r.add_argument("recipes", nargs="*", metavar="RECIPE|KEY=VALUE",
                   help="recipe files (YAML or JSON) or shipped recipes' names, and overrides")
    r.add_argument("--out", required=True, action=_ThenWords, nargs="+", metavar=("OUT", "RECIPE|KEY=VALUE"),
                   help="folder of run directories")
    r.add_argument("--model", action=_ThenWords, nargs="+", metavar=("SPEC", "RECIPE|KEY=VALUE"),
                   help="teacher to use instead of each recipe's own (e.g. a local copy)")
    r.add_argument("--device", action=_ThenWords, nargs="+", metavar=("DEVICE", "RECIPE|KEY=VALUE"),
                   help="cuda or cpu (default: cuda if available)")
    r.add_argument("--no-eval", dest="evaluate", action=_NoEvalThenWords, nargs="*", metavar="RECIPE|KEY=VALUE",
                   help="distil only; a later run without it evaluates the models it finds")
    r.set_defaults(func=_run_command, words_after=[], evaluate=True)
    ls = sub.add_parser("list", help="the shipped recipes: name, file and row label, main rows then ablations")
    ls.set_defaults(func=_list_command)
    t = sub.add_parser("table", help="a Markdown table of finished runs")
    t.add_argument("runs", nargs="+", type=Path, help="run directories or folders of them")
    t.add_argument("--into", type=Path, help="replace the recipe table section of this Markdown file")
    t.add_argument("--plot", type=Path, help="also draw the rows' perplexity and retrieval by length into this PNG")
    t.add_argument("--columns", type=_patterns, metavar="PATTERNS",
                   help="only these columns beside the row's name: comma-separated names or shell-style "
                        "patterns, e.g. '0-shot avg,RULER-12 4K,BABILong *'")
    t.set_defaults(func=_table_command)
    g = sub.add_parser("plot", help="draw chosen finished runs' perplexity and retrieval by length (no table)")
    g.add_argument("runs", nargs="+", type=Path, help="run directories or folders of them, in legend order")
    g.add_argument("--out", type=Path, required=True, help="the PNG to write")
    g.set_defaults(func=_plot_command)


class _ThenWords(argparse.Action):
    """An option's value, then the recipes and overrides written after it: argparse takes a command's
    positionals in one run, so `run lizard --out runs/ eval.samples=1` would otherwise refuse the override."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values[0])
        namespace.words_after = [*namespace.words_after, *values[1:]]


class _NoEvalThenWords(argparse.Action):
    """`--no-eval`, then the recipes and overrides written after it, as `_ThenWords` takes them."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, False)
        namespace.words_after = [*namespace.words_after, *values]


def _is_override(word: str) -> bool:
    # A KEY=VALUE word; a file whose name holds "=" is still a file.
    return "=" in word and not Path(word).is_file()


def _run_command(args) -> int:
    words = [*args.recipes, *args.words_after]
    overrides = [w for w in words if _is_override(w)]
    specs = [w for w in words if not _is_override(w)]
    if not specs:
        raise RecipeError("recipe run: no recipe named (a file, or a shipped recipe's name from `linearize recipe list`)")
    recipes = [Recipe.load(find(spec), overrides) for spec in specs]  # every file checked before any work starts
    names = [r.name for r in recipes]
    if len(set(names)) != len(names):
        raise RecipeError(f"two recipes share a name: {names}")
    for recipe in recipes:  # with --no-eval too: a later run evaluates the model, after the training it took
        recipe.check_eval()
    outs = []
    for recipe in recipes:
        outs.append(run(recipe, args.out, model=args.model, device=args.device, evaluate_model=args.evaluate))
        print(f"recipe {recipe.name}: {outs[-1]}")
    if args.evaluate:
        print(table(outs), end="")  # the rows as `recipe table` shows them
    return 0


def _list_command(args) -> int:
    lines = [("name", "file", "row")] + [(r.name, _display(r.source), r.row) for r in shipped()]
    widths = [max(len(line[i]) for line in lines) for i in range(2)]
    for name, file, row in lines:
        print(f"{name:<{widths[0]}}  {file:<{widths[1]}}  {row}")
    return 0


def _patterns(text: str) -> list[str]:
    """--columns' value: its comma-separated patterns, none empty."""
    patterns = [p.strip() for p in text.split(",")]
    if not all(patterns):
        raise argparse.ArgumentTypeError(f"an empty name in {text!r}")
    return patterns


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
    text = table(runs, args.columns)
    if args.plot:
        print(f"wrote {plot_rows(runs, args.plot)}")
    if args.into:
        write_into(args.into, text)
        print(f"wrote {args.into}")
    else:
        print(text, end="")
    return 0
