"""What a recipe is: its file read with its `extends` chain and command-line overrides, checked before any
work, and the shipped recipes found by name."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import yaml

# linearize.eval and linearize.train (torch, lm-eval) are imported inside the functions that use them: the
# command's parser stays fast.

# `linearize.eval.evaluate`'s arguments, and "set": inference options of the distilled model for this
# evaluation (`convert.set_inference_options`).
EVAL_KEYS = {"tasks", "limit", "task_limits", "task_lengths", "lengths", "depths", "samples", "batch", "harness_batch",
             "seed", "set", "chat_template", "prompt_shape"}
RECIPE_KEYS = ("name", "row", "model", "distill", "eval")
SUFFIXES = (".yaml", ".yml", ".json")
RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"  # the shipped recipes (a source checkout)
BASE_DIR = "base"  # under RECIPES_DIR: what recipes extend, not rows


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
    def load(cls, path: str | Path, overrides: list[str] | tuple[str, ...] = (), *, smoke: bool = False) -> Recipe:
        """The recipe in `path` with its `extends` chain resolved, made CPU-sized with `smoke` (`smoke_overrides`)
        and `overrides` ("a.b=value") applied over that."""
        path = Path(path)
        if path.resolve().is_relative_to(RECIPES_DIR / BASE_DIR):
            raise RecipeError(f"recipe {path} is a base that recipes extend, not a row")
        raw = _resolve(path, ())
        overrides = (*(smoke_overrides(raw) if smoke else ()), *overrides)
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
        self.eval_config()

    def eval_config(self):
        """The `eval` section (less its "set") as the evaluation's typed `EvalConfig` (RecipeError if bad)."""
        from ..eval.config import EvalConfig, EvalSettingError
        from ..eval.tasks import TaskNotInRun

        where = display_path(self.source) if self.source is not None else self.name
        if "tasks" not in self.eval:
            raise RecipeError(f"recipe {where}: eval: no 'tasks' to evaluate (e.g. tasks: ppl,zeroshot)")
        try:
            return EvalConfig(**{key: value for key, value in self.eval.items() if key != "set"})
        except EvalSettingError as e:
            if isinstance(e.__cause__, TaskNotInRun):
                raise RecipeError(f"recipe {where}: {_task_conflicts(self.eval)}") from None
            raise RecipeError(f"recipe {where}: eval: {e}") from None
        except TypeError as e:  # a key EvalConfig does not have
            raise RecipeError(f"recipe {where}: eval: {e}") from None

    def distill_config(self, out: Path, model: str | None = None):
        """`out`: the row's model folder, RUNS/<row>/model; a `stage1_from` names another row in RUNS."""
        from ..train import DistillConfig

        settings = {**self.distill, "model": model or self.model, "out": str(out)}
        if isinstance(settings.get("stage1_from"), str):
            settings["stage1_from"] = str(Path(out).parent.parent / settings["stage1_from"] / "model")
        return DistillConfig(**settings)


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
        found = shipped_named(parent, bases=True)
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


def shipped_named(name: str, bases: bool = False) -> Path | None:
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
        found = shipped_named(spec)
        if found:
            return found
        raise RecipeError(f"recipe {spec} is not a file nor a shipped recipe's name (`linearize recipe list`)")
    raise RecipeError(f"recipe {path} is not a file")


def shipped() -> list[Recipe]:
    """Every shipped row's recipe: main rows (recipes/*.yaml), then ablations, each group by name."""
    return [Recipe.load(p) for p in _shipped()]


# `recipe run --smoke`: the recipe made small enough for a 2-core CPU (a few minutes: two steps a stage on
# short sequences, a couple of samples a task, one short length), every stage and task it names still run.
# The per-task mappings go: they name the full run's lengths and limits.
SMOKE_STEPS = 2
SMOKE_DISTILL = {"seq_len": 256, "batch": 2, "grad_accum": 1, "save_every": SMOKE_STEPS, "eval_every": SMOKE_STEPS,
                 "val_batches": 1}
SMOKE_EVAL = {"limit": 2, "samples": 1, "lengths": "1k", "depths": "50", "batch": 2, "task_lengths": None,
              "task_limits": None}


def smoke_overrides(raw: dict) -> list[str]:
    """KEY=VALUE overrides that make the resolved recipe `raw` CPU-sized (SMOKE_DISTILL, SMOKE_EVAL)."""
    items = [f"eval.{key}={json.dumps(value)}" for key, value in SMOKE_EVAL.items()]
    if isinstance(raw.get("eval"), dict) and "harness_batch" in raw["eval"]:
        items.append(f"eval.harness_batch={SMOKE_EVAL['batch']}")
    distill = raw.get("distill")
    if isinstance(distill, dict):
        settings = {**SMOKE_DISTILL, "seq_len": _smoke_seq_len(distill)}
        settings["max_tokens"] = SMOKE_STEPS * settings["batch"] * settings["seq_len"]
        items += [f"distill.{key}={value}" for key, value in settings.items()]
        if distill.get("kl_seq_len"):
            items.append("distill.kl_seq_len=0")  # candidates scored at the smoke's seq_len
        if distill.get("kl_train_steps"):
            items.append("distill.kl_train_steps=1")
    return items


def _smoke_seq_len(distill: dict) -> int:
    """SMOKE_DISTILL's seq_len, or the recipe's own where the method trains nothing that short (a STILL
    budget that holds every token of it, a LoLCATs window as long)."""
    from ..train import DistillConfig

    short = SMOKE_DISTILL["seq_len"]
    try:
        DistillConfig(model="m", method=distill.get("method"), out="o", seq_len=short, batch=1,
                      stage=str(distill.get("stage", "both")), options=distill.get("options") or {})
    except (TypeError, ValueError):  # what the recipe's own check then reports, if it is not the length
        return distill.get("seq_len", short) if isinstance(distill.get("seq_len"), int) else short
    return short


def shipped_rows() -> list[tuple[str, Path, str]]:
    """(name, file, row label) of every shipped row, in `shipped`'s order: read from the files and their
    `extends` chains alone, without the checks that import the training and evaluation code (torch)."""
    rows = []
    for path in _shipped():
        raw = _resolve(path, ())
        name = raw.get("name", path.stem)
        rows.append((str(name), path, str(raw.get("row", name))))
    return rows


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
        from ..train import DistillConfig

        return {f.name for f in dataclasses.fields(DistillConfig)} - {"out"}
    return None


def _check_distill(path: Path, recipe: Recipe) -> None:
    """`distill` must make a valid DistillConfig and method config."""
    from ..config import ConfigError
    from ..train import DistillConfig

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
        recipe.distill_config(Path("model"))  # which parses the method's options too (`DistillConfig.method_config`)
    except (ConfigError, TypeError, ValueError) as e:
        given = [item for item in recipe.overrides if item.startswith("distill.")
                 and item.partition("=")[0].rsplit(".", 1)[-1] in str(e)]
        source = f" (from {', '.join(given)})" if given else ""
        raise RecipeError(f"recipe {path}: distill: {e}{source}") from None


def _check_inference_options(path: Path, distill: dict | None, options: dict) -> None:
    """An eval's "set" must name inference options of the recipe's method, with valid values."""
    from ..config import ConfigError, make_method_config, with_inference_options

    if distill is None:
        raise RecipeError(f"recipe {path}: eval 'set' changes a distilled model; this recipe distils none")
    if not isinstance(options, dict):
        raise RecipeError(f"recipe {path}: eval 'set' must be a mapping of inference options, got {options!r}")
    try:
        with_inference_options(make_method_config(distill.get("method"), **(distill.get("options") or {})), options)
    except ConfigError as e:
        raise RecipeError(f"recipe {path}: eval 'set': {e}") from None



def display_path(path: Path) -> str:
    """How a run's record names its recipe file: under `recipes/` for a shipped one, else as found."""
    path = Path(path).resolve()
    for root in (RECIPES_DIR.parent, Path.cwd()):
        if path.is_relative_to(root):
            return path.relative_to(root).as_posix()
    return str(path)


def _task_conflicts(settings: dict) -> str:
    """Every per-task setting of an eval section that names a task the run leaves out, most often inherited
    from a parent that runs more tasks (`extends` or `eval.tasks=`): all named at once, so one retry fixes them."""
    from ..eval.tasks import TaskNotInRun, check_task_limits, parse_task_lengths, parse_tasks

    tasks = parse_tasks(settings["tasks"])
    conflicts = []
    for key, check in (("task_lengths", parse_task_lengths), ("task_limits", check_task_limits)):
        try:
            check(tasks, settings.get(key) or {})
        except TaskNotInRun as e:
            conflicts.append((key, str(e)))
    problems = "; ".join(f"eval.{key}: {problem}" for key, problem in conflicts)
    fixes = " ".join(f"eval.{key}=null" for key, _ in conflicts)
    return f"{problems}; override {fixes} (or name this run's tasks there)"
