"""Recipes: every shipped file is valid, a run distils + evaluates + resumes, the table gathers the runs."""

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from tiny_models import save_tiny_teacher

from linearize.cli import main
from linearize.config import make_method_config
from linearize.recipes import (
    RECIPES_DIR,
    Recipe,
    RecipeError,
    finished_runs,
    plot_rows,
    run,
    shipped,
    table,
    write_into,
)
from linearize.recipes.table import TABLE_END, TABLE_START, _curves
from linearize.train import DistillConfig

SHIPPED = [recipe.source for recipe in shipped()]


def test_every_recipe_is_shipped():
    assert len(SHIPPED) >= 36 and all(p.is_relative_to(RECIPES_DIR) for p in SHIPPED)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_shipped_recipes_are_valid(path, tmp_path):
    recipe = Recipe.load(path)
    assert recipe.name == path.stem
    if recipe.distill is not None:
        cfg = recipe.distill_config(tmp_path / "model")
        assert isinstance(cfg, DistillConfig)
        make_method_config(cfg.method, **cfg.options)
        assert all(0 <= i < 30 for i in cfg.softmax_layers)  # the teacher has 30 layers


def test_the_main_rows_share_data_budget_and_seed():
    main_rows = [Recipe.load(p) for p in SHIPPED if p.stem in ("lizard", "still", "lolcats", "liger")]
    assert len(main_rows) == 4
    keys = ("data", "max_tokens", "seed")
    budgets = {tuple(r.distill_config(Path("x")).__dict__[k] for k in keys) for r in main_rows}
    assert len(budgets) == 1
    # STILL trains at its paper's 1024 tokens a sequence (where its slots never overflow), on as many tokens a step.
    steps = {r.name: (r.distill["seq_len"], r.distill["batch"]) for r in main_rows}
    assert steps.pop("still") == (1024, 16) and set(steps.values()) == {(2048, 8)}
    assert {r.name: r.distill.get("stage", "both") for r in main_rows}["liger"] == "2"


@pytest.mark.parametrize("content, message", [
    (None, "is not a file"),
    ("{", "not valid JSON"),
    ('{"eval": {}, "colour": 1}', "needs 'eval'"),
    ('{"distill": {}}', "needs 'eval'"),
    ('{"eval": {"text": "x"}}', "unknown eval settings"),
    ('{"eval": {}, "distill": {"out": "x"}}', "must not set 'out'"),
    ('{"name": "a/b", "eval": {}}', "must be letters"),
    ('{"eval": {"set": {"budget": 1024}}}', "distils none"),
    ('{"eval": {"set": {"window": 64}}, "distill": {"method": "still"}}', "still cannot change window after training"),
    ('{"eval": {"set": {"budget": 64}}, "distill": {"method": "still"}}', "eval 'set': "),
])
def test_bad_recipes_are_clear_errors(content, message, tmp_path):
    path = tmp_path / "r.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(RecipeError, match=message):
        Recipe.load(path)


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    path = tmp_path_factory.mktemp("teacher") / "tiny"
    save_tiny_teacher(path)
    return str(path)


def tiny_recipe(tmp_path, name, distill):
    recipe = {"name": name, "row": name.upper(), "eval": {"tasks": "passkey", "lengths": "1k", "depths": "50",
                                                        "samples": 1, "batch": 2}}
    if distill:
        recipe["distill"] = {"method": "lizard", "data": distill, "max_tokens": 2 * 4 * 32, "seq_len": 32,
                             "batch": 4, "options": {"window": 8, "num_sinks": 2}, "save_every": 1}
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(recipe))
    return path


def test_run_distils_evaluates_resumes_and_tabulates(teacher, tmp_path, workspace_text, capsys):
    runs = tmp_path / "runs"
    path = tiny_recipe(tmp_path, "student", str(workspace_text))
    student = Recipe.load(path)
    assert main(["recipe", "run", str(path), "--out", str(runs), "--model", teacher, "--device", "cpu",
                 "--no-eval"]) == 0
    out = runs / "student"
    assert (out / "model" / "config.json").exists() and not (out / "eval.json").exists()
    trained = (out / "model" / "config.json").stat().st_mtime_ns
    out = run(student, runs, model=teacher, device="cpu", progress=False)  # evaluates the model it finds
    assert (out / "model" / "config.json").stat().st_mtime_ns == trained
    record = json.loads((out / "run.json").read_text())
    assert record["training_tokens"] == 2 * 2 * 4 * 32 and record["distill_wall_s"] > 0
    assert (out / "model" / "config.json").exists()
    results = json.loads((out / "eval.json").read_text())
    assert results["provenance"]["model"] == str(out / "model")
    assert results["provenance"]["method_config"]["method"] == "lizard"

    first_eval = (out / "eval.json").stat().st_mtime_ns
    run(student, runs, model=teacher, device="cpu", progress=False)  # finished: nothing is redone
    assert json.loads((out / "run.json").read_text())["distill_wall_s"] == record["distill_wall_s"]
    assert (out / "eval.json").stat().st_mtime_ns == first_eval

    partial = json.loads((out / "eval.json").read_text())  # as if cut short after its only task
    partial["provenance"]["partial"] = True
    partial["tasks"]["passkey"]["kept"] = True
    (out / "eval.json").write_text(json.dumps(partial))
    run(student, runs, model=teacher, device="cpu", progress=False)
    resumed = json.loads((out / "eval.json").read_text())
    assert resumed["tasks"]["passkey"]["kept"] is True and "partial" not in resumed["provenance"]
    assert json.loads((out / "run.json").read_text())["eval_wall_s"] > record["eval_wall_s"]

    grown = dataclasses.replace(student, eval={**student.eval, "tasks": "passkey,variable_tracking",
                                               "task_lengths": {"variable_tracking": "1k"}})
    run(grown, runs, model=teacher, device="cpu", progress=False)  # a task added: only it runs
    extended = json.loads((out / "eval.json").read_text())
    assert extended["tasks"]["passkey"]["kept"] is True and "variable_tracking" in extended["tasks"]
    run(student, runs, model=teacher, device="cpu", progress=False)  # back to the file's tasks: only passkey
    extended_at = (out / "eval.json").stat().st_mtime_ns

    run(Recipe.load(tiny_recipe(tmp_path, "teacher", None)), runs, model=teacher, device="cpu", progress=False)
    text = table(finished_runs([runs]))
    plot = plot_rows(finished_runs([runs]), tmp_path / "plots" / "rows.png")
    assert plot.read_bytes().startswith(b"\x89PNG")
    header, _, *rows = text.splitlines()
    assert header.startswith("| row | recipe | train tokens | train min | passkey 1K |")
    assert [row.split(" | ")[0] for row in rows] == ["| STUDENT", "| TEACHER"]
    assert rows[0].split(" | ")[2] == "512"
    assert rows[1].split(" | ")[2:4] == ["–", "–"]
    # The recipe cell names the file the row came from, not recipes/<name>.json.
    assert rows[0].split(" | ")[1] == f"`{path.resolve()}`"
    assert rows[1].split(" | ")[1] == f"`{(tmp_path / 'teacher.json').resolve()}`"

    # Through the CLI, with an override (the value it already has: nothing is redone), `run` ends with the
    # row as the table shows it, and the table records the override beside the file.
    capsys.readouterr()
    assert main(["recipe", "run", str(path), "eval.samples=1", "--out", str(runs), "--model", teacher,
                 "--device", "cpu"]) == 0
    assert (out / "eval.json").stat().st_mtime_ns == extended_at
    printed = capsys.readouterr().out.splitlines()
    assert printed[-3].startswith("| row | recipe | train tokens | train min | passkey 1K |")
    assert printed[-1].startswith(f"| STUDENT | `{path.resolve()}` `eval.samples=1` | 512 |")
    assert json.loads((out / "run.json").read_text())["overrides"] == ["eval.samples=1"]


def run_files(root):
    """Every file under `root` with its bytes: what a refused run may not change."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_rerun_with_other_training_settings_is_refused_and_changes_nothing(teacher, tmp_path, workspace_text,
                                                                             capsys):
    """A row finished at distill.max_tokens=1024, rerun with 2048, is refused: its model is not reused
    nor its run.json made to claim 2048 tokens for the model trained on 1024."""
    runs = tmp_path / "runs"
    path = tiny_recipe(tmp_path, "student", str(workspace_text))
    argv = ["recipe", "run", str(path), "--model", teacher, "--device", "cpu", "--no-eval", "--out", str(runs)]
    assert main(argv) == 0
    out = runs / "student"
    before = run_files(out)
    capsys.readouterr()
    assert main([*argv, "distill.max_tokens=512"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.rstrip().endswith("max_tokens: saved 256, asked 512"), err
    assert run_files(out) == before

    # Cut short (no exported model yet): resuming under the new settings is refused the same way, and
    # run.json is not first rewritten with them (nor with the refused call's wall time).
    for exported in [out / "model" / "config.json", *(out / "model").glob("model*.safetensors")]:
        exported.unlink()
    cut = run_files(out)
    assert main([*argv, "distill.max_tokens=512", "distill.seq_len=16"]) == 2
    assert "max_tokens: saved 256, asked 512; seq_len: saved 32, asked 16" in capsys.readouterr().err
    assert run_files(out) == cut
    assert main(argv) == 0  # its own settings resume it
    assert (out / "model" / "config.json").exists()
    assert json.loads((out / "run.json").read_text())["training_tokens"] == 2 * 2 * 4 * 32


def test_a_refused_run_leaves_the_runs_started_beside_it(tmp_path, monkeypatch):
    """Five rows started at once into a runs folder none had found: the first to fail (a missing
    dependency) removed the whole folder with the others' freshly made ones, and each of them then
    failed on its own folder ("No such file or directory"). Only its own folder goes now."""
    from linearize.recipes import running

    runs = tmp_path / "runs"

    def beside_then_fail(out, *args, **kwargs):
        (runs / "other").mkdir()
        (runs / "other" / "run.json").write_text("{}")  # the row started beside it, not yet trained
        raise ModuleNotFoundError("No module named 'gguf'")

    monkeypatch.setattr(running, "_run_in", beside_then_fail)
    recipe = Recipe.load(tiny_recipe(tmp_path, "student", None))
    with pytest.raises(ModuleNotFoundError):
        run(recipe, runs)
    assert sorted(p.name for p in runs.iterdir()) == ["other"]
    shutil.rmtree(runs)

    def fail(out, *args, **kwargs):
        raise ModuleNotFoundError("No module named 'gguf'")

    monkeypatch.setattr(running, "_run_in", fail)
    with pytest.raises(ModuleNotFoundError):
        run(recipe, runs)
    assert not runs.exists()  # alone, it leaves nothing behind, the runs folder it made included


def test_run_evaluates_with_the_recipes_inference_options(teacher, tmp_path, workspace_text):
    options = {"window": 8, "budget": 14, "chunk_size": 4, "max_chunks": 2}
    path = tmp_path / "still.json"
    path.write_text(json.dumps({
        "eval": {"tasks": "passkey", "lengths": "1k", "depths": "50", "samples": 1, "batch": 2, "set": {"budget": 32}},
        "distill": {"method": "still", "data": str(workspace_text), "max_tokens": 4 * 32, "seq_len": 32, "batch": 4,
                    "stage": "1", "options": options}}))
    out = run(Recipe.load(path), tmp_path / "runs", model=teacher, device="cpu", progress=False)
    evaluated = json.loads((out / "eval.json").read_text())["provenance"]["method_config"]["options"]
    assert evaluated == {**evaluated, **options, "budget": 32}
    # The saved model keeps the options it was trained with.
    assert json.loads((out / "model" / "config.json").read_text())["linearize"]["options"]["budget"] == 14


def test_the_ruler_column_averages_the_ruler_tasks_at_each_length_they_share(tmp_path):
    run_dir = tmp_path / "row"
    run_dir.mkdir()
    (run_dir / "run.json").write_text(json.dumps({"recipe": {"name": "row", "row": "Row"}}))
    scores = {"niah_single": 1.0, "niah_multikey": 0.5, "niah_multivalue": 0.25, "variable_tracking": 0.25}
    tasks = {name: {"grid": [], "by_length": [{"length": 4096, "score": s}] + (
        [{"length": 8192, "score": 1.0}] if name == "niah_single" else [])} for name, s in scores.items()}
    (run_dir / "eval.json").write_text(json.dumps({"provenance": {}, "tasks": tasks}))
    header, _, row = table([run_dir]).splitlines()
    cells = dict(zip(*([c.strip() for c in line.strip("|").split("|")] for line in (header, row))))
    assert cells["RULER 4K"] == "50.0" and "RULER 8K" not in cells and cells["niah_single 8K"] == "100.0"


def test_plot_draws_chosen_runs_without_touching_a_table(tmp_path, capsys):
    for name, ppl in (("a", 50.0), ("b", 80.0)):
        run_dir = tmp_path / "runs" / name
        run_dir.mkdir(parents=True)
        (run_dir / "run.json").write_text(json.dumps({"recipe": {"name": name, "row": name.upper()}}))
        tasks = {"ppl": {"by_length": [{"length": n, "ppl": ppl} for n in (512, 1024)]},
                 "passkey": {"grid": [], "by_length": [{"length": n, "score": 0.5} for n in (512, 1024)]}}
        (run_dir / "eval.json").write_text(json.dumps({"provenance": {}, "tasks": tasks}))
    out = tmp_path / "plots" / "two.png"
    assert main(["recipe", "plot", str(tmp_path / "runs" / "b"), str(tmp_path / "runs" / "a"), "--out", str(out)]) == 0
    assert out.read_bytes().startswith(b"\x89PNG") and f"wrote {out}" in capsys.readouterr().out
    (tmp_path / "empty").mkdir()
    assert main(["recipe", "plot", str(tmp_path / "empty"), "--out", str(out)]) == 2
    assert "no finished runs" in capsys.readouterr().err


def test_plot_draws_the_panels_its_rows_have_and_the_babilong_average(tmp_path, capsys):
    babilong = {f"babilong_qa{k}": {"grid": [], "by_length": [{"length": n, "score": k / 10} for n in (512, 1024)]}
                for k in (1, 2)}
    niah = {"niah_single": {"grid": [], "by_length": [{"length": 512, "score": 1.0}]}}
    assert _curves({**babilong, **niah}) == {"ppl": [], "passkey": [], "niah_single": [(512, 100.0)],
                                             "BABILong": [(512, pytest.approx(15.0)), (1024, pytest.approx(15.0))]}
    run_dir = tmp_path / "runs" / "long"
    run_dir.mkdir(parents=True)
    (run_dir / "run.json").write_text(json.dumps({"recipe": {"name": "long", "row": "a row named " + "x" * 80}}))
    (run_dir / "eval.json").write_text(json.dumps({"provenance": {}, "tasks": {**babilong, **niah}}))
    out = plot_rows([run_dir], tmp_path / "long.png")
    width = int.from_bytes(out.read_bytes()[16:20], "big")  # the PNG header's width: two panels, not four
    assert width == round((5.3 * 2 + 0.1) * 110)
    (run_dir / "eval.json").write_text(json.dumps({"provenance": {}, "tasks": {"piqa": {"acc": 0.5}}}))
    assert main(["recipe", "plot", str(run_dir), "--out", str(tmp_path / "none.png")]) == 2
    assert "none of these runs has perplexity" in capsys.readouterr().err and not (tmp_path / "none.png").exists()


def test_write_into_replaces_only_its_section(tmp_path):
    page = tmp_path / "results.md"
    page.write_text("# Results\n\nintro\n")
    write_into(page, "| a |\n")
    write_into(page, "| b |\n")
    text = page.read_text()
    assert text.startswith("# Results\n\nintro\n") and text.count(TABLE_START) == 1 and text.count(TABLE_END) == 1
    assert "| b |" in text and "| a |" not in text


def test_a_page_holds_several_named_tables_each_rewritten_alone(tmp_path, capsys):
    page = tmp_path / "results.md"
    page.write_text("# Results\n")
    write_into(page, "| main 1 |\n")
    write_into(page, "| gemma 1 |\n", section="gemma3")
    write_into(page, "| main 2 |\n")
    write_into(page, "| gemma 2 |\n", section="gemma3")
    text = page.read_text()
    assert text.count(TABLE_START) == 1 and text.count("<!-- recipe table: gemma3 -->") == 1
    assert "| main 2 |" in text and "| gemma 2 |" in text and "1 |" not in text
    assert text.index("| main 2 |") < text.index("| gemma 2 |")  # each stays where it was first put
    run_dir = tmp_path / "runs" / "a"
    run_dir.mkdir(parents=True)
    (run_dir / "run.json").write_text(json.dumps({"recipe": {"name": "a", "row": "A"}}))
    (run_dir / "eval.json").write_text(json.dumps({"provenance": {}, "tasks": {"ppl": {"by_length": [
        {"length": 512, "ppl": 9.0}]}}}))
    before = page.read_text()
    # A bad name, or a name without a page, is refused before anything is drawn or written.
    for argv in (["--into", str(page), "--section", "gemma 3"], ["--section", "gemma3"]):
        assert main(["recipe", "table", str(run_dir), *argv, "--plot", str(tmp_path / "rows.png")]) == 2
        assert capsys.readouterr().err.count("\n") == 1
        assert page.read_text() == before and not (tmp_path / "rows.png").exists()
    assert main(["recipe", "table", str(run_dir), "--into", str(page), "--section", "gemma3"]) == 0
    assert "| A |" in page.read_text().split("<!-- recipe table: gemma3 -->")[1] and "| main 2 |" in page.read_text()


def test_table_keeps_the_columns_asked_for_beside_the_row(tmp_path, capsys):
    run_dir = tmp_path / "runs" / "a"
    run_dir.mkdir(parents=True)
    (run_dir / "run.json").write_text(json.dumps({"recipe": {"name": "a", "row": "A"}}))
    tasks = {"passkey": {"grid": [], "by_length": [{"length": n, "score": 0.5} for n in (512, 1024)]},
             "ppl": {"by_length": [{"length": 512, "ppl": 9.0}]}}
    (run_dir / "eval.json").write_text(json.dumps({"provenance": {}, "tasks": tasks}))
    header, _, row = table([run_dir], ["passkey *", "ppl 512"]).splitlines()
    assert header == "| row | ppl 512 | passkey 512 | passkey 1K |" and row == "| A | 9.0 | 50.0 | 50.0 |"
    page = tmp_path / "page.md"
    assert main(["recipe", "table", str(run_dir), "--columns", "mmlu,passkey 1K", "--into", str(page)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'mmlu' matches none of these rows' columns: row, GPU, recipe" in err
    assert not page.exists()
    assert main(["recipe", "table", str(run_dir), "--columns", "passkey 1K,"]) == 2
    assert "an empty name" in capsys.readouterr().err


def test_a_hybrid_row_names_its_softmax_layers_beside_its_training(tmp_path):
    rows = []
    for name, method_config in (("reference", None), ("hybrid", {"method": "lizard", "softmax_layers": [0, 1, 3, 4, 5, 9]}),
                                ("linear", {"method": "lizard", "softmax_layers": []})):
        run_dir = tmp_path / "runs" / name
        run_dir.mkdir(parents=True)
        (run_dir / "run.json").write_text(json.dumps({"recipe": {"name": name, "row": name}, "distill_wall_s": 60}))
        tasks = {"ppl": {"by_length": [{"length": 512, "ppl": 9.0}]}}
        (run_dir / "eval.json").write_text(json.dumps({"provenance": {"method_config": method_config}, "tasks": tasks}))
        rows.append(run_dir)
    header, _, reference, hybrid, linear = table(rows).splitlines()
    # The column comes with the second row, yet leads the scores; a range is three or more layers.
    assert header.startswith("| row | recipe | train tokens | train min | softmax layers | ppl 512 |")
    assert hybrid.startswith("| hybrid | `hybrid` | – | 1.0 | 0, 1, 3-5, 9 | 9.0 |")
    assert reference.startswith("| reference | `reference` | – | 1.0 | – |") and linear.startswith("| linear | `linear` | – | 1.0 | – |")
    header, _, hybrid = table(rows[1:2], ["softmax layers"]).splitlines()
    assert header == "| row | softmax layers |" and hybrid == "| hybrid | 0, 1, 3-5, 9 |"


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert main(["recipe", "run", str(tmp_path / "missing.json"), "--out", str(tmp_path)]) == 2
    assert "is not a file" in capsys.readouterr().err
    assert main(["recipe", "table", str(tmp_path)]) == 2
    assert "no finished runs" in capsys.readouterr().err


@pytest.fixture(scope="module")
def workspace_text(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "data.txt"
    words = ["the", "cat", "sat", "on", "a", "mat", "while", "dogs", "ran", "far", "away", "and", "then", "came", "back", "home"]
    path.write_text("\n".join(" ".join(words[(i * 7 + j) % len(words)] for j in range(120)) for i in range(40)))
    return path


@pytest.mark.parametrize("argv", [
    ["lizard", "distill.max_tokens=512", "--out", "runs", "--no-eval"],
    ["--out", "runs", "--no-eval", "lizard", "distill.max_tokens=512"],
    ["lizard", "--no-eval", "--out", "runs", "distill.max_tokens=512"],
])
def test_recipes_and_overrides_may_follow_any_flag_of_recipe_run(argv):
    from linearize.cli import build_parser

    args = build_parser().parse_args(["recipe", "run", *argv])
    assert args.evaluate is False and args.out == "runs"
    assert [*args.recipes, *args.words_after] == ["lizard", "distill.max_tokens=512"]


def test_a_row_cut_inside_its_first_long_length_still_makes_a_table_row(tmp_path):
    """A RULER task saved before its first length ended has answers but no scores yet: its row has
    no cell for it, and no RULER average, rather than failing the table."""
    from linearize.eval.api import RULER
    from linearize.eval.longcontext import result_so_far
    from linearize.recipes.table import _row_cells

    finished = {"lengths": [1024], "by_length": [{"length": 1024, "score": 0.5}], "grid": [], "score": 0.5}
    answered = [{"length": 1024, "depth": 0, "seed": 1, "score": 1.0}]
    tasks = {name: finished for name in RULER} | {"variable_tracking": result_so_far([], answered, [], [0], None)}
    run = tmp_path / "row"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"recipe": {"name": "lizard", "row": "Lizard"}, "source": "r.yaml"}))
    (run / "eval.json").write_text(json.dumps({"provenance": {"partial": True}, "tasks": tasks}))
    cells = _row_cells(run)
    assert cells["row"] == "Lizard (partial)" and cells["niah_single 1K"] == "50.0"
    assert "variable_tracking 1K" not in cells and "RULER 1K" not in cells


@pytest.mark.slow  # about a minute and a half on 2 cores
def test_smoke_runs_a_shipped_recipe_cpu_sized(teacher, tmp_path, workspace_text, capsys):
    """`recipe run FILE --smoke`: the recipe's stages and evaluation, at two steps a stage on short sequences
    and a couple of samples; the overrides it set are in run.json. (The tiny teacher and a small text stand
    in for SmolLM2 and the default mix; the tasks are cut to two, the rest is the smoke's own.)"""
    runs = tmp_path / "runs"
    assert main(["recipe", "run", str(RECIPES_DIR / "lizard-window-256.yaml"), "--smoke", "--out", str(runs),
                 "--model", teacher, "--device", "cpu", f"distill.data={workspace_text}", "eval.tasks=ppl,passkey"]) == 0
    out = runs / "lizard-window-256"
    record = json.loads((out / "run.json").read_text())
    assert "distill.seq_len=256" in record["overrides"] and "eval.limit=2" in record["overrides"]
    assert record["recipe"]["distill"]["options"]["window"] == 256  # the row's own method options stay
    steps = [json.loads(line) for line in (out / "model" / "train_log.jsonl").read_text().splitlines()]
    assert {(r["stage"], r["step"]) for r in steps if "loss" in r} == {(1, 1), (1, 2), (2, 1), (2, 2)}
    results = json.loads((out / "eval.json").read_text())
    assert [row["length"] for row in results["tasks"]["ppl"]["by_length"]] == [1024]


def test_table_names_each_rows_gpu_where_the_rows_ran_on_different_gpus(tmp_path):
    def run(name, device):
        run_dir = tmp_path / name
        run_dir.mkdir()
        (run_dir / "run.json").write_text(json.dumps({"recipe": {"name": name, "row": name.upper()}}))
        tasks = {"ppl": {"by_length": [{"length": 512, "ppl": 9.0}]}}
        (run_dir / "eval.json").write_text(json.dumps({"provenance": {"device": device}, "tasks": tasks}))
        return run_dir

    h200, h100 = run("a", "cuda:0 (NVIDIA H200)"), run("b", "cuda:0 (NVIDIA H100 80GB HBM3)")
    assert "GPU" not in table([h200], ["ppl 512"]).splitlines()[0]  # one GPU: the page's title names it
    lines = table([h200, h100], ["ppl 512"]).splitlines()
    assert lines[0] == "| row | GPU | ppl 512 |"
    assert lines[2:] == ["| A | H200 | 9.0 |", "| B | H100 80GB HBM3 | 9.0 |"]
