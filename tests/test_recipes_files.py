"""Recipe files: the shipped layout (main rows, ablations, the Gemma rows; one shared evaluation per teacher),
`extends`, command-line overrides, lookup by name, `recipe list`, and one-line errors for every bad file."""

import itertools
import json
from collections import Counter
from pathlib import Path

import pytest
import yaml

from linearize.cli import main
from linearize.recipes import RECIPES_DIR, Recipe, RecipeError, find, shipped

# The rows the README and the results table lead with; everything else is an ablation.
MAIN_ROWS = {"teacher", "lizard", "lizard-window-256", "lizard-window-256-10m", "lizard-hybrid-50-error", "still",
             "still-uncapped-seq4096-10m", "lolcats", "liger", "lizard-window-256-recall", "lizard-window-256-delta",
             "lizard-window-256-delta-recall", "lizard-window-256-delta-decay-recall", "still-recall", "still-delta",
             "still-delta-recall"}
BASE_EVAL = RECIPES_DIR / "base" / "eval.yaml"
# The rows on the second teacher: their own folder and their own evaluation block, to 128K.
GEMMA_ROWS = {"gemma3-teacher", "gemma3-lizard", "gemma3-lizard-full", "gemma3-still-full", "gemma3-lizard-full-seq8k",
              "gemma3-lizard-full-delta-decay-recall",
              "gemma3-still-full-seq8k"}
GEMMA_BASE = RECIPES_DIR / "base" / "gemma3.yaml"
# The hybrid layer-selection rows (recipes/hybrids/): their own evaluation block over the shared one, RULER to 16K;
# on Gemma, the same to the teacher's 32K positions.
HYBRIDS_BASE = RECIPES_DIR / "base" / "hybrids.yaml"
GEMMA_HYBRIDS_BASE = RECIPES_DIR / "base" / "gemma3-hybrids.yaml"


def chain(path: Path) -> list[Path]:
    """The files a shipped recipe resolves through, itself first (read here, independently of the loader)."""
    files = [path]
    while "extends" in (raw := yaml.safe_load(files[-1].read_text())):
        files.append(find_parent(raw["extends"], files[-1]))
    return files


def find_parent(parent: str, child: Path) -> Path:
    for candidate in (child.parent / parent, child.parent / f"{parent}.yaml", RECIPES_DIR / parent,
                      RECIPES_DIR / f"{parent}.yaml"):
        if candidate.is_file():
            return candidate.resolve()
    raise AssertionError(f"{child}: no {parent}")


def write(path: Path, content) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content if isinstance(content, str) else yaml.safe_dump(content, sort_keys=False))
    return path


def test_main_rows_sit_in_recipes_and_ablations_in_their_folder():
    recipes = shipped()
    names = [r.name for r in recipes]
    assert len(names) == len(set(names)) == len([p for p in RECIPES_DIR.rglob("*.yaml") if p.parent.name != "base"])
    main_rows = {r.name for r in recipes if r.source.parent == RECIPES_DIR}
    assert main_rows == MAIN_ROWS
    assert {r.name for r in recipes if r.source.parent == RECIPES_DIR / "gemma3"} == GEMMA_ROWS
    others = {r.source.parent for r in recipes if r.name not in MAIN_ROWS | GEMMA_ROWS}
    assert RECIPES_DIR / "ablations" in others and all(p.parent == RECIPES_DIR and p.name != "base" for p in others)
    assert names[:len(MAIN_ROWS)] == sorted(MAIN_ROWS)  # main rows first
    assert all(r.source.suffix == ".yaml" for r in recipes)
    assert not list(RECIPES_DIR.rglob("*.json"))
    assert "base" not in {p for r in recipes for p in r.source.relative_to(RECIPES_DIR).parts}


@pytest.mark.parametrize("recipe", shipped(), ids=lambda r: r.name)
def test_every_row_shares_its_teachers_one_evaluation_block(recipe):
    files = chain(recipe.source)
    assert files[-1] == BASE_EVAL.resolve()
    gemma = recipe.name in GEMMA_ROWS
    hybrid = HYBRIDS_BASE.resolve() in files
    gemma_hybrid = GEMMA_HYBRIDS_BASE.resolve() in files
    assert (GEMMA_BASE.resolve() in files) == gemma and not (gemma and hybrid) and (not gemma_hybrid or hybrid)
    assert (recipe.model == "gemma3") == (gemma or gemma_hybrid)
    # The evaluation block is base/eval.yaml's; for the Gemma rows base/gemma3.yaml's over it; for the
    # hybrid rows base/hybrids.yaml's over it, and on Gemma base/gemma3-hybrids.yaml's over that.
    owners = {BASE_EVAL.resolve()}
    base = yaml.safe_load(BASE_EVAL.read_text())["eval"]
    for owner, applies in ((GEMMA_BASE, gemma), (HYBRIDS_BASE, hybrid), (GEMMA_HYBRIDS_BASE, gemma_hybrid)):
        if applies:
            owners.add(owner.resolve())
            base = {**base, **yaml.safe_load(owner.read_text())["eval"]}
    if recipe.source.parent == RECIPES_DIR / "generative":  # a row re-scored: its own tasks over its parent's
        owners.add(recipe.source.resolve())
        base = {**base, **yaml.safe_load(recipe.source.read_text())["eval"]}
    # A row may change how many prompts go through at once, and an ablation may leave tasks out (it
    # answers one question), never how a task is measured: its lengths, samples and limits stay.
    for path in files:
        if path not in owners:
            assert set(yaml.safe_load(path.read_text()).get("eval", {})) <= {"batch", "harness_batch", "tasks"}, path
    narrowed = recipe.eval["tasks"] != base["tasks"]
    assert not narrowed or (set(recipe.eval["tasks"].split(",")) < set(base["tasks"].split(","))
                            and recipe.name not in MAIN_ROWS)
    own = ("batch", "harness_batch", "tasks")
    assert recipe.eval == {**base, **{k: v for k, v in recipe.eval.items() if k in own}}
    assert narrowed or recipe.eval["tasks"].split(",")[0] == "zeroshot"
    assert ("16k" if hybrid else "32k") in recipe.eval["lengths"]
    assert ("32k" in recipe.eval["lengths"]) == (not hybrid or gemma_hybrid)
    assert ("128k" in recipe.eval["lengths"]) == gemma


def test_every_row_label_is_unique():
    """`recipe table` shows a row by its label alone: two recipes sharing one (the hybrids' rows evaluated on
    RULER and BABILong, and the same training evaluated on the shared block) would read as one row twice."""
    recipes = shipped()
    assert len(recipes) == len([p for p in RECIPES_DIR.rglob("*.yaml") if p.parent.name != "base"])
    shared = {row: count for row, count in Counter(r.row for r in recipes).items() if count > 1}
    assert not shared


def test_rows_set_only_what_they_change():
    # Every student extends the shared training base; no file repeats a value its parent already has.
    for recipe in shipped():
        files = chain(recipe.source)
        if recipe.distill is not None:
            assert RECIPES_DIR / "base" / "distill.yaml" in files
        inherited = {}
        for path in reversed(files):
            own = yaml.safe_load(path.read_text())
            for section in ("distill", "eval"):
                for key, value in (own.get(section) or {}).items():
                    if key == "options":
                        for option, setting in value.items():
                            assert inherited.get(("options", option)) != setting, (path, option)
                            inherited["options", option] = setting
                    else:
                        assert inherited.get((section, key)) != value, (path, key)
                        inherited[section, key] = value


def test_extends_merges_mappings_replaces_the_rest_and_never_inherits_name_or_row(tmp_path):
    """Mappings merge, except an evaluation's per-task ones (task_limits, task_lengths), which name the
    tasks of that evaluation and so replace the parent's."""
    write(tmp_path / "parent.yaml", {"name": "parent", "row": "Parent", "model": "m",
                                     "eval": {"tasks": "ppl", "task_limits": {"mmlu": 5, "ppl": 2}},
                                     "distill": {"method": "lizard", "softmax_layers": [1, 2, 3], "batch": 8,
                                                 "options": {"window": 64, "num_sinks": 2}}})
    write(tmp_path / "sub" / "child.yaml", {"extends": "../parent.yaml", "eval": {"task_limits": {"mmlu": 7}},
                                            "distill": {"softmax_layers": [4], "options": {"window": 32}}})
    child = Recipe.load(tmp_path / "sub" / "child.yaml")
    assert (child.name, child.row, child.model) == ("child", "child", "m")
    assert child.eval == {"tasks": "ppl", "task_limits": {"mmlu": 7}}
    assert child.distill == {"method": "lizard", "softmax_layers": [4], "batch": 8,
                             "options": {"window": 32, "num_sinks": 2}}
    # A JSON recipe extends a YAML one (and the other way round), and null removes the parent's distill.
    write(tmp_path / "sub" / "teacher.json", json.dumps({"extends": "child", "row": "T", "distill": None}))
    write(tmp_path / "grandchild.yml", "extends: sub/teacher.json\nmodel: other\n")
    teacher = Recipe.load(tmp_path / "sub" / "teacher.json")
    assert (teacher.name, teacher.row, teacher.distill, teacher.eval) == ("teacher", "T", None, child.eval)
    assert Recipe.load(tmp_path / "grandchild.yml").settings() == {
        "name": "grandchild", "row": "grandchild", "distill": None, "eval": child.eval, "model": "other"}


def test_a_users_recipe_extends_a_shipped_one_by_name(tmp_path):
    path = write(tmp_path / "mine.yaml", "extends: lizard-window-256\ndistill:\n  options:\n    window: 512\n")
    mine, theirs = Recipe.load(path), Recipe.load(find("lizard-window-256"))
    assert mine.distill == {**theirs.distill, "options": {**theirs.distill["options"], "window": 512}}
    assert mine.eval == theirs.eval and mine.name == "mine"


def test_recipes_are_found_by_name(tmp_path, monkeypatch):
    assert find("lizard-window-256") == RECIPES_DIR / "lizard-window-256.yaml"
    assert find("still-hedgehog") == RECIPES_DIR / "ablations" / "still-hedgehog.yaml"
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "lizard", "not the recipe")  # a file of that name in the working directory wins
    assert find("lizard") == Path("lizard")
    for spec in ("eval", "distill"):  # bases are not rows
        with pytest.raises(RecipeError, match=f"recipe {spec} is not a file nor a shipped recipe's name"):
            find(spec)
    with pytest.raises(RecipeError, match="recipe nested/none.yaml is not a file"):
        find("nested/none.yaml")
    with pytest.raises(RecipeError, match="eval.yaml is a base that recipes extend, not a row"):
        Recipe.load(BASE_EVAL)


@pytest.mark.parametrize("files, message", [
    ({"a.yaml": "extends: a\neval: {}\n"}, r"recipe .*a.yaml: extends cycle .*a.yaml -> .*a.yaml$"),
    ({"a.yaml": "extends: b.yaml\neval: {}\n", "b.yaml": "extends: c\n", "c.yaml": "extends: a.yaml\n"},
     r"extends cycle .*a.yaml -> .*b.yaml -> .*c.yaml -> .*a.yaml$"),
    ({"a.yaml": "extends: nowhere\neval: {}\n"}, r"recipe .*a.yaml: extends 'nowhere', which is neither a file"),
    ({"a.yaml": "extends: [b, c]\neval: {}\n"}, r"recipe .*a.yaml: 'extends' names one recipe"),
    ({"a.yaml": "extends: b\n", "b.yaml": "eval: {}\ncolour: red\n"}, r"recipe .*b.yaml: unknown key 'colour'"),
    ({"a.yaml": "extends: b\n", "b.yaml": "eval: [1\n"}, r"recipe .*b.yaml is not valid YAML: .*\(line 2, column 1\)"),
    ({"a.yaml": "- eval\n"}, r"recipe .*a.yaml: needs a mapping with 'eval', got list"),
    ({"a.yaml": ""}, r"recipe .*a.yaml: needs a mapping with 'eval', got NoneType"),
    ({"a.yaml": "eval: {}\ndistill: {method: lizard, max_token: 5}\n"}, r"unknown distill settings \['max_token'\]"),
    ({"a.yaml": "eval: {}\ndistill: {method: lizard, stage: 3}\n"}, r"recipe .*a.yaml: distill: --stage must be"),
    ({"a.yaml": "eval: {set: 5}\ndistill: {method: lizard}\n"}, r"eval 'set' must be a mapping"),
    ({"a.yaml": "eval: {}\n3: x\n"}, r"unknown key '3'"),
    ({"a.yaml": "eval: {}\ndistill: {method: lizard, options: {windw: 3}}\n"}, r"recipe .*a.yaml: distill: .*windw"),
    ({"a.yaml": "eval: {}\ndistill: {stage: both}\n"}, r"'distill' needs a 'method'"),
    ({"a.yaml": "eval: 5\n"}, r"'eval' must be a mapping"),
])
def test_bad_recipe_files_are_one_line_errors_naming_the_file(files, message, tmp_path):
    for name, text in files.items():
        write(tmp_path / name, text)
    with pytest.raises(RecipeError, match=message) as error:
        Recipe.load(tmp_path / "a.yaml")
    assert "\n" not in str(error.value) and str(tmp_path) in str(error.value)


def test_overrides_set_dotted_keys_as_yaml_values():
    path = RECIPES_DIR / "lizard.yaml"
    plain = Recipe.load(path)
    recipe = Recipe.load(path, ["distill.max_tokens=100000", "eval.samples=1", "eval.tasks=passkey,ppl",
                                "distill.options.window=64", "distill.cuda_graph=true", "eval.set.window=32",
                                "distill.softmax_layers=[0, 29]", "row=Smoke test", "name=smoke",
                                "eval.task_limits.mmlu=3", "distill.stage=1"])
    assert recipe.distill == {**plain.distill, "max_tokens": 100000, "options": {"window": 64}, "cuda_graph": True,
                              "softmax_layers": [0, 29], "stage": "1"}  # stage=1, a YAML number, is the string "1"
    assert recipe.eval == {**plain.eval, "samples": 1, "tasks": "passkey,ppl", "set": {"window": 32},
                           "task_limits": {"mmlu": 3}}
    assert (recipe.name, recipe.row, recipe.source, recipe.overrides[0]) == (
        "smoke", "Smoke test", path, "distill.max_tokens=100000")
    assert Recipe.load(path) == plain  # the file is untouched
    teacher = Recipe.load(RECIPES_DIR / "teacher.yaml", ["eval.batch=4", "model=/models/smollm2"])
    assert teacher.eval["batch"] == 4 and teacher.model == "/models/smollm2"


@pytest.mark.parametrize("override, message", [
    ("distill.max_token=5", r"override 'distill.max_token=5': unknown key 'distill.max_token' \('distill' takes "),
    ("eval.sample=1", r"unknown key 'eval.sample' \('eval' takes batch, chat_template, depths, "),
    ("colour=red", r"unknown key 'colour' \(a recipe takes distill, eval, model, name, row\)"),
    ("distill.max_tokens", r"override 'distill.max_tokens' is not KEY=VALUE"),
    ("=3", r"is not KEY=VALUE"),
    ("distill..seed=3", r"is not KEY=VALUE"),
    ("eval.samples=[1", r"override 'eval.samples=\[1': the value is not YAML"),
    ("row.x=1", r"'row' is .*, not a mapping"),
    ("distill.stage=3", r"distill: --stage must be 1, 2 or both"),
    ("eval.set.window=x", r"eval 'set': "),
])
def test_bad_overrides_are_one_line_errors_naming_the_key_and_file(override, message):
    path = RECIPES_DIR / "lizard.yaml"
    with pytest.raises(RecipeError, match=message) as error:
        Recipe.load(path, [override])
    assert str(error.value).startswith(f"recipe {path}") and "\n" not in str(error.value)


def test_an_override_cannot_give_the_teacher_a_distillation():
    with pytest.raises(RecipeError, match="override 'distill.max_tokens=5': this recipe distils no model"):
        Recipe.load(RECIPES_DIR / "teacher.yaml", ["distill.max_tokens=5"])


def test_recipe_list_shows_main_rows_then_ablations(capsys):
    assert main(["recipe", "list"]) == 0
    header, *lines = capsys.readouterr().out.splitlines()
    shipped = [p for p in RECIPES_DIR.rglob("*.yaml") if p.parent.name != "base"]
    assert header.split() == ["name", "file", "row"] and len(lines) == len(shipped)
    rows = [line.split(None, 2) for line in lines]
    assert rows[0] == ["liger", "recipes/liger.yaml", "Liger-GLA (stage 2 only)"]
    files = [file for _, file, _ in rows]
    main_rows = sum(p.parent == RECIPES_DIR for p in shipped)
    assert all("/" not in f.removeprefix("recipes/") for f in files[:main_rows])
    # Then each folder's recipes together, ablations first.
    folders = [f.split("/")[1] for f in files[main_rows:]]
    assert folders[0] == "ablations" and folders == sorted(folders, key=folders.index)
    assert len(set(folders)) == len([k for k, _ in itertools.groupby(folders)])
    assert all(Path(RECIPES_DIR.parent / f).stem == name for name, f, _ in rows)


def test_recipe_list_imports_no_model_code_and_agrees_with_the_loaded_recipes():
    """Listing reads YAML files: no transformers or torch import (seconds), the same rows as loading them."""
    import subprocess
    import sys

    script = ("import sys\nfrom linearize.cli import main\nassert main(['recipe', 'list']) == 0\n"
              "print(sorted(m for m in ('transformers', 'torch') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=RECIPES_DIR.parent, check=True)
    *listed, imported = done.stdout.splitlines()
    assert imported == "[]"
    rows = [line.split(None, 2) for line in listed[1:]]
    assert [(name, row) for name, _, row in rows] == [(r.name, r.row) for r in shipped()]


def test_smoke_overrides_make_every_shipped_row_cpu_sized():
    """`--smoke` on every shipped row loads (its settings still valid together) and is small: a few steps a
    stage, short sequences, a couple of samples, one short length, no per-task mappings."""
    for recipe in shipped():
        small = Recipe.load(recipe.source, smoke=True)
        assert small.eval["limit"] == 2 and small.eval["lengths"] == "1k" and small.eval["samples"] == 1
        assert small.eval["task_lengths"] is None and small.eval["task_limits"] is None
        small.check_eval()
        if small.distill is not None:
            cfg = small.distill_config(Path("model"))
            assert cfg.steps() <= 2 and cfg.seq_len <= max(256, recipe.distill.get("seq_len", 256))
            assert cfg.max_tokens <= 2 * 2 * cfg.seq_len and not cfg.kl_seq_len
    mine = Recipe.load(RECIPES_DIR / "lizard.yaml", ["eval.limit=5"], smoke=True)
    assert mine.eval["limit"] == 5  # the command line's overrides apply over the smoke's


def test_cli_refuses_bad_names_and_overrides_before_any_work(tmp_path, capsys):
    out = tmp_path / "runs"
    assert main(["recipe", "run", "lizzard", "--out", str(out)]) == 2
    assert "recipe lizzard is not a file nor a shipped recipe's name" in capsys.readouterr().err
    assert main(["recipe", "run", "lizard", "still", "distill.max_token=5", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown key 'distill.max_token'" in err and "recipes/lizard.yaml" in err
    # Overrides (and recipes) may follow the options too.
    assert main(["recipe", "run", "--out", str(out), "still", "--device", "cpu", "eval.sampls=1"]) == 2
    assert "recipes/still.yaml: override 'eval.sampls=1': unknown key 'eval.sampls'" in capsys.readouterr().err
    assert main(["recipe", "run", "eval.samples=1", "--out", str(out)]) == 2
    assert "no recipe named" in capsys.readouterr().err
    assert main(["recipe", "run", "lizard", str(RECIPES_DIR / "lizard.yaml"), "--out", str(out)]) == 2
    assert "two recipes share a name" in capsys.readouterr().err
    assert not out.exists()


def test_a_lone_number_is_one_eval_length(tmp_path):
    """YAML reads `lengths: 512` as a number: it is one length, as in `eval.lengths=512` (which said
    "'int' object is not iterable" once the row had trained)."""
    path = write(tmp_path / "r.yaml", "eval:\n  tasks: ppl,passkey\n  lengths: 512\n  depths: 50\n"
                                      "  task_lengths:\n    passkey: 1024\n")
    Recipe.load(path).check_eval()
    Recipe.load(RECIPES_DIR / "lizard.yaml", ["eval.lengths=512", "eval.depths=50", "eval.task_lengths.ppl=512"]
                ).check_eval()


LENGTHS_LEFT = ("eval.task_lengths: task lengths name 'niah_multikey', which is not ppl or a long-context task of "
                "this run (ppl)")
LIMITS_LEFT = "eval.task_limits: a task limit names 'mmlu', which is not an lm-eval task of this run (ppl)"


@pytest.mark.parametrize("overrides, message", [
    (["eval.tasks=ppl"], (f"{LENGTHS_LEFT}; {LIMITS_LEFT}; override eval.task_lengths=null eval.task_limits=null "
                          "(or name this run's tasks there)")),
    (["eval.tasks=ppl", "eval.task_lengths=null"],
     f"{LIMITS_LEFT}; override eval.task_limits=null (or name this run's tasks there)"),
])
def test_per_task_settings_left_from_the_parent_name_their_override(overrides, message):
    """Narrowing a row's tasks leaves its parent's task lengths and limits naming tasks it no longer runs:
    refused (which tasks a setting names is explicit), every such setting at once, with the overrides that
    clear them in the same line."""
    with pytest.raises(RecipeError) as error:
        Recipe.load(RECIPES_DIR / "lizard.yaml", overrides).check_eval()
    assert str(error.value) == f"recipe recipes/lizard.yaml: {message}"
    Recipe.load(RECIPES_DIR / "lizard.yaml", [*overrides, "eval.task_lengths=null", "eval.task_limits=null"]
                ).check_eval()


def test_recipe_run_names_the_override_of_a_parents_task_lengths(tmp_path, capsys):
    out = tmp_path / "runs"
    assert main(["recipe", "run", "lizard", "--out", str(out), "eval.tasks=ppl", "--no-eval"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.rstrip().endswith(
        "override eval.task_lengths=null eval.task_limits=null (or name this run's tasks there)")
    assert not out.exists()


def test_an_eval_without_tasks_is_refused_before_a_run(tmp_path):
    path = write(tmp_path / "r.yaml", "eval:\n  samples: 1\n")
    with pytest.raises(RecipeError, match=r"r.yaml: eval: no 'tasks' to evaluate"):
        Recipe.load(path).check_eval()


# Each teacher's passkey prompt layout, chosen on its own sweep (docs/evaluation.md, "Prompt shapes"): SmolLM2
# finds more keys in v1 (docs/results/cpu/prompt-sweep/smollm2.md), Gemma-3 in space at every length to 32K
# (docs/results/h100/prompt-sweep/gemma3.md).
TEACHER_SHAPES = {"smollm2": "v1", "gemma3": "space"}


@pytest.mark.parametrize("recipe", shipped(), ids=lambda r: r.name)
def test_every_row_evaluates_with_its_teachers_prompt_shape(recipe):
    from linearize.eval.config import EvalConfig

    shape = recipe.eval.get("prompt_shape", EvalConfig("passkey").prompt_shape)
    assert shape == TEACHER_SHAPES[recipe.model or "smollm2"]
