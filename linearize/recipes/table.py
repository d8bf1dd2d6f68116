"""The results table and figure of finished recipe runs, and the table's place in a Markdown page."""

from __future__ import annotations

import fnmatch
import json
import re
from pathlib import Path

from .files import RecipeError, display_path, shipped_named

# linearize.eval and linearize.train (torch, lm-eval) are imported inside the functions that use them: the
# command's parser stays fast.

TABLE_START, TABLE_END = "<!-- recipe table -->", "<!-- end of recipe table -->"


def _command_cell(record: dict) -> str:
    """The table's `recipe` cell: the file the row ran (a record without one: the shipped recipe of its
    name), then any command-line overrides."""
    source = record.get("source")
    if source is None:
        shipped_file = shipped_named(record["recipe"]["name"])
        source = display_path(shipped_file) if shipped_file else record["recipe"]["name"]
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


LEAD_COLUMNS = ("row", "GPU", "recipe", "train tokens", "train min", "softmax layers")


def _gpu(device: str | None) -> str:
    """The evaluation's device as a reader names it: "cuda:0 (NVIDIA H200)" -> "H200"."""
    if not device:
        return "–"
    name = re.fullmatch(r"cuda(?::\d+)? \((.*)\)", device)
    return name[1].removeprefix("NVIDIA ") if name else device


def _row_cells(run_dir: Path) -> dict[str, str]:
    """Column name -> cell text for one finished run directory."""
    from ..eval.api import RULER
    from ..eval.babilong import BABILONG_TASKS
    from ..eval.generative import ZEROSHOT_GEN
    from ..eval.harness import AVERAGE_METRIC, ZEROSHOT
    from ..eval.report import length_label
    from ..eval.ruler import RULER_TASKS

    record = json.loads((run_dir / "run.json").read_text())
    results = json.loads((run_dir / "eval.json").read_text())
    tasks = results["tasks"]
    recipe = record["recipe"]
    cells = {"row": recipe["row"], "GPU": _gpu(results["provenance"].get("device")), "recipe": _command_cell(record)}
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
    with `keep` (shell-style patterns such as "BABILong *"), the row column and those matching one. The GPU
    column shows where the rows ran on different GPUs (or where `keep` asks for it): a table of one GPU
    names it in its title."""
    rows = [_row_cells(d) for d in run_dirs]
    if not rows:
        raise RecipeError("no finished runs (directories with run.json and eval.json) to tabulate")
    columns: list[str] = []
    for cells in rows:
        columns += [c for c in cells if c not in columns]
    if keep is None and len({cells["GPU"] for cells in rows}) == 1:
        columns.remove("GPU")
    # What a row is leads, whichever row brings it: a hybrid's softmax layers sit by its training.
    columns.sort(key=lambda c: LEAD_COLUMNS.index(c) if c in LEAD_COLUMNS else len(LEAD_COLUMNS))
    if keep is not None:
        for pattern in keep:
            if not any(fnmatch.fnmatchcase(c, pattern) for c in columns):
                raise RecipeError(f"--columns: {pattern!r} matches none of these rows' columns: {', '.join(columns)}")
        mixed = len({cells["GPU"] for cells in rows}) > 1  # rows from two GPUs say so whatever was kept
        columns = ["row", *(c for c in columns if c != "row" and (any(fnmatch.fnmatchcase(c, k) for k in keep)
                                                                  or (c == "GPU" and mixed)))]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cells.get(c, "–") for c in columns) + " |" for cells in rows]
    return "\n".join(lines) + "\n"


def _curves(tasks: dict) -> dict[str, list[tuple[int, float]]]:
    """{panel: [(length, value)]} of one run's results: perplexity, passkey and niah_single accuracy (%),
    and the BABILong tasks' average (%) at each length all of them ran."""
    from ..eval.report import families_run, family_average

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

    from ..eval.report import length_label

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
    from ..figures import save_png

    save_png(fig, path, dpi=110)
    return path


def finished_runs(roots: list[Path]) -> list[Path]:
    """Run directories under `roots` (or the roots themselves) that hold both run.json and eval.json."""
    found = []
    for root in roots:
        candidates = [root] if (root / "run.json").exists() else sorted(p for p in root.iterdir() if p.is_dir())
        found += [d for d in candidates if (d / "run.json").exists() and (d / "eval.json").exists()]
    return found


def table_markers(section: str | None = None) -> tuple[str, str]:
    """The comments around a page's recipe table; a named section lets one page hold several tables."""
    if section is None:
        return TABLE_START, TABLE_END
    if not re.fullmatch(r"[A-Za-z0-9_-]+", section):
        raise RecipeError(f"--section {section!r}: a table's name is letters, digits, '-' and '_' only")
    return f"<!-- recipe table: {section} -->", f"<!-- end of recipe table: {section} -->"


def write_into(markdown_path: Path, text: str, section: str | None = None) -> None:
    """Replace the section between the table markers of `markdown_path` (appended if it has none)."""
    start, end = table_markers(section)
    block = f"{start}\n{text}{end}\n"
    page = markdown_path.read_text() if markdown_path.exists() else ""
    if start in page and end in page:
        before, rest = page.split(start, 1)
        after = rest.split(end, 1)[1].lstrip("\n")
        page = before + block + after
    else:
        page = page + ("\n" if page and not page.endswith("\n") else "") + block
    markdown_path.write_text(page)

