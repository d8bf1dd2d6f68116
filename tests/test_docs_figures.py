"""The targets tables' generator (experiments.docs.figures) and the small table generators it sits beside."""

import json
import shutil
from pathlib import Path

import pytest
import yaml

from experiments.docs import figures, generated, tables


@pytest.fixture
def bench_file(tmp_path):
    record = {"environment": {"device": "cuda:0 (NVIDIA H200)"},
              "points": [{"model": "lizard", "context": 1024, "ms": 2.0}, {"model": "lizard", "context": 2048, "ms": 5.0},
                         {"model": "sdpa", "context": 2048, "ms": 20.0}]}
    path = tmp_path / "model.json"
    path.write_text(json.dumps(record))
    return path


def _render(tmp_path, spec: dict) -> str:
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return figures.render(path, tmp_path)


def test_placeholders_read_filter_and_compute_from_the_named_files(tmp_path, bench_file):
    spec = {"files": {"m": bench_file.name}, "header": ["target", "measured"],
            "rows": [["at most 0.5x SDPA",
                      ("{{<m#points[model=lizard&context=2048].ms> / <m#points[model=sdpa].ms> ; .2f}}x; "
                       "{{m#points[model=lizard].ms}} ms at 1K; {{max(<m#points.0.ms>, <m#points.1.ms>) ; .1f}}")]]}
    text = _render(tmp_path, spec)
    assert text.splitlines()[0] == "Measured on: H200."
    assert "| at most 0.5x SDPA | 0.25x; 2 ms at 1K; 5.0 |" in text


def test_a_run_operand_is_the_cell_its_recipe_table_prints(tmp_path):
    runs = generated.ROOT / "docs/results/h200/runs"
    spec = {"runs": str(runs), "title": "T", "header": ["a", "b"],
            "rows": [["{{teacher|0-shot avg}}", "{{<lizard-window-256-10m|0-shot avg> - <teacher|0-shot avg> ; .1f}}"],
                     ["{{teacher|ppl 1K..4K}}", "{{teacher|passkey 32K ; .0f}}"]]}
    text = _render(tmp_path, spec)
    from linearize.recipes.table import _row_cells

    teacher, student = _row_cells(runs / "teacher"), _row_cells(runs / "lizard-window-256-10m")
    assert text.startswith("**T** (measured on: H200)")
    assert f"| {teacher['0-shot avg']} | {float(student['0-shot avg']) - float(teacher['0-shot avg']):.1f} |" in text
    assert f"| {teacher['ppl 1K']} / {teacher['ppl 2K']} / {teacher['ppl 4K']} | " in text


@pytest.mark.parametrize(("cell", "message"), [
    ("{{m#points[model=none].ms}}", "no item of points has model=none"),
    ("{{m#nothing}}", "no 'nothing' there"),
    ("{{other#points}}", "has no 'other'"),
    ("{{<m#points.0.model> + 1}}", "is 'lizard', not a number"),
    ("{{__import__('os') + <m#points.0.ms>}}", "only numbers"),
    ("{{run|col}}", "RUN|COLUMN (with `runs:` in the spec)"),
])
def test_an_operand_that_names_nothing_is_refused_with_its_text(tmp_path, bench_file, cell, message):
    spec = {"files": {"m": bench_file.name}, "header": ["a"], "rows": [[cell]]}
    with pytest.raises(figures.FigureError, match=message.replace("(", r"\(").replace(")", r"\)").replace("|", r"\|")):
        _render(tmp_path, spec)


def test_a_row_with_the_wrong_number_of_cells_is_refused(tmp_path, bench_file, capsys):
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump({"header": ["a", "b"], "rows": [["only one"]]}))
    assert figures.main([str(path)]) == 2
    assert "a row has 1 cells for 2 columns" in capsys.readouterr().err


def test_a_hand_edit_of_a_targets_table_fails_the_check(tmp_path):
    # The generative targets table and the runs its figures come from, one figure changed by hand.
    for run in ("teacher-gen", "lizard-gen", "still-gen"):
        shutil.copytree(generated.ROOT / "docs/results/h100/runs" / run, tmp_path / "docs/results/h100/runs" / run)
    shutil.copytree(generated.ROOT / "docs/results/targets", tmp_path / "docs/results/targets")
    page = tmp_path / "docs" / "results-generative.md"
    shutil.copy(generated.ROOT / "docs" / "results-generative.md", page)
    (clean,) = [s for s in generated.sections(page, tmp_path) if "figures" in s.command]
    assert not clean.stale and "| the students' generative zero-shot gap" in clean.committed
    text = page.read_text()
    page.write_text(text.replace("(F1 ", "(F1 1", 1))
    (edited,) = [s for s in generated.sections(page, tmp_path) if "figures" in s.command]
    assert edited.stale


def test_kernel_targets_take_each_runs_range_and_say_met_only_within_the_limit(tmp_path):
    def run(name, ours, fla):
        rows = [{"op": op, "mode": "fwd", "B": 1, "L": L, "ms": ms, "status": "ok"}
                for op, values in (("lizard (triton)", ours), ("fla chunk_gla", fla)) for L, ms in zip((8, 16), values)]
        rows.append({"op": "fla chunk_simple_gla", "mode": "fwd+bwd", "B": 1, "L": 8, "status": "error",
                     "reason": "RuntimeError: no backward. Upgrade"})
        folder = tmp_path / name
        folder.mkdir()
        (folder / "kernels.json").write_text(json.dumps({"environment": {"device": "NVIDIA H100"}, "rows": rows}))
        return folder

    text = tables.kernel_targets([run("a", (1.0, 2.0), (4.0, 5.0)), run("b", (3.0, 3.0), (5.0, 5.0))])
    lines = text.splitlines()
    assert lines[2].startswith("| forward at most 0.5x fla's `chunk_gla` | H100 | 0.25-0.40x")
    assert lines[2].endswith("0.60-0.60x | missed |")  # run b's 0.6x passes the 0.5x limit
    assert "| forward+backward against `chunk_simple_gla` | H100 | not measurable: RuntimeError: no backward" in text


def test_decode_memory_and_train_shapes_read_their_runs(monkeypatch):
    monkeypatch.chdir(generated.ROOT)  # the tables link their runs relative to docs/, as the markers name them
    memory = tables.decode_memory([("full", Path("docs/results/h200/model/gemma3-layers-full"))], [1024, 131072])
    record = json.loads((generated.ROOT / "docs/results/h200/model/gemma3-layers-full/model.json").read_text())
    peak = {p["context"]: p["decode_peak_bytes"] for p in record["points"]
            if p["model"] == "lizard" and p.get("sweep") == "context"}
    assert f"| full | H200 | {peak[1024] / 2**30:.3g} GiB | {peak[131072] / 2**30:.3g} GiB |" in memory
    with pytest.raises(ValueError, match="no decode at batch 1 at context 3"):
        tables.decode_memory([("full", Path("docs/results/h200/model/gemma3-layers-full"))], [3])

    shapes = tables.train_shapes([("Llama", Path("docs/results/h100/train/llama3-8b-checkpointing"))])
    assert shapes.count("| Llama | H100 80GB HBM3 |") == 2  # 2K and 8K


def test_an_indented_section_is_regenerated_as_indented(tmp_path):
    # A table inside a list item: its markers and every line the command prints stand at the item's indent.
    page = tmp_path / "page.md"
    page.write_text("- an item:\n\n    <!-- generated: python -m experiments.docs.tables needle-mass "
                    "teacher=docs/results/still-routing -->\n    <!-- end of generated -->\n")
    (section,) = generated.sections(page, generated.ROOT)
    assert section.stale and section.regenerated.startswith("    | model | key 1K |")
    assert all(line.startswith("    |") for line in section.regenerated.splitlines())
    generated.write(page, [section])
    assert not any(s.stale for s in generated.sections(page, generated.ROOT))
