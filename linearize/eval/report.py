"""Write eval results as FILE.json, a Markdown summary FILE.md and PNG plots next to them."""

from __future__ import annotations

import json
import math
from pathlib import Path

from matplotlib.figure import Figure  # no pyplot: Figure.savefig renders with Agg, no display needed

from linearize.cli_args import read_json_files
from linearize.eval.api import task_settings
from linearize.eval.babilong import BABILONG_TASKS
from linearize.eval.generative import CHOICE_TASKS
from linearize.eval.generative import TASKS as GENERATIVE_TASKS
from linearize.eval.harness import AVERAGE_METRIC
from linearize.eval.results_file import samples_path, write_results
from linearize.eval.ruler import MISSING as RULER_MISSING
from linearize.eval.ruler import RULER_TASKS
from linearize.figures import save_png

# Task families reported together, a table and a task x length heatmap each: (title, plot name, tasks).
FAMILIES = (("RULER", "ruler", RULER_TASKS), ("BABILong", "babilong", BABILONG_TASKS))


def write_json(results: dict, out: str | Path) -> Path:
    """The results at `out` (the scores as JSON, the per-sample records in FILE.samples.jsonl.gz beside
    it: `linearize.eval.results_file`), each replaced atomically (a partial file is never half written)."""
    return write_results(results, out)


def write_report(results: dict, out: str | Path) -> list[Path]:
    """Write the JSON (and its per-sample records), the Markdown summary and the plots; returns the paths written."""
    out = write_json(results, out)
    md, plots = write_summary(results, out)
    records = samples_path(out)
    return [out, *([records] if records.exists() else []), md, *plots.values()]


def write_summary(results: dict, out: Path) -> tuple[Path, dict[str, Path]]:
    """The Markdown summary and the plots of the results file `out`: (Markdown path, {plot name: PNG path})."""
    plots = write_plots(results, out)
    md = out.with_suffix(".md")
    md.write_text(markdown(results, plots), encoding="utf-8")
    return md, plots


def length_label(length: int) -> str:
    return f"{length // 1024}K" if length % 1024 == 0 else str(length)


def write_plots(results: dict, out: Path) -> dict[str, Path]:
    """{plot name: PNG path}: ppl vs length and loss vs position for ppl, a depth x length heatmap per
    long-context task, and a task x length heatmap per family (RULER, BABILong) in place of its tasks'
    own: a family's twelve or five small figures would bury the one that compares them."""
    plots = {}
    families = families_run(results["tasks"])
    in_family = {name for *_, rows in families for name, _ in rows}
    for name, result in results["tasks"].items():
        if name == "ppl":
            plots["ppl_by_length"] = plot_ppl(result, out.with_name(f"{out.stem}.ppl_by_length.png"))
            plots["loss_by_position"] = plot_positions(result, out.with_name(f"{out.stem}.loss_by_position.png"))
        elif "grid" in result and name not in in_family:
            plots[name] = plot_heatmap(name, result, out.with_name(f"{out.stem}.{name}.png"))
    for title, key, _, rows in families:
        plots[key] = plot_family(title, rows, out.with_name(f"{out.stem}.{key}.png"))
    return plots


def plot_ppl(result: dict, path: Path) -> Path:
    rows = result["by_length"]
    fig = Figure(figsize=(6, 4), layout="constrained")
    ax = fig.add_subplot()
    ax.plot([r["length"] for r in rows], [r["ppl"] for r in rows], marker="o")
    ax.set_xscale("log", base=2)
    ax.set_xticks([r["length"] for r in rows], [length_label(r["length"]) for r in rows])
    ax.set(xlabel="context length (tokens)", ylabel="perplexity", title=f"Perplexity on {Path(result['text']).name}")
    ax.grid(alpha=0.3)
    save_png(fig, path, dpi=120)
    return path


def plot_positions(result: dict, path: Path) -> Path:
    curve = result["loss_by_position"]
    buckets = curve["buckets"]
    fig = Figure(figsize=(6, 4), layout="constrained")
    ax = fig.add_subplot()
    ax.plot([(b["start"] + b["end"] - 1) / 2 for b in buckets], [b["loss"] for b in buckets], marker=".")
    ax.set_xscale("log")
    ax.set(
        xlabel="token position",
        ylabel="mean loss (nats)",
        title=f"Loss vs position ({curve['windows']} windows of {length_label(curve['length'])})",
    )
    ax.grid(alpha=0.3)
    save_png(fig, path, dpi=120)
    return path


def plot_heatmap(name: str, result: dict, path: Path) -> Path:
    lengths, depths = result["lengths"], result["depths"]
    cells = {(c["length"], c["depth"]): c["score"] for c in result["grid"]}
    grid = [[cells.get((length, depth), float("nan")) for length in lengths] for depth in depths]
    fig = Figure(figsize=(1.2 * len(lengths) + 2, 0.6 * len(depths) + 1.8), layout="constrained")
    ax = fig.add_subplot()
    image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    for row, depth_scores in enumerate(grid):
        for col, value in enumerate(depth_scores):
            ax.text(col, row, f"{value:.2f}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(lengths)), [length_label(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d}" if result.get("depth_free") else f"{d}%" for d in depths])
    ylabel = "seed group (no needle depth)" if result.get("depth_free") else "needle depth"
    ax.set(xlabel="context length (tokens)", ylabel=ylabel, title=f"{name}: score {result['score']:.3f}")
    fig.colorbar(image, ax=ax, label="score")
    save_png(fig, path, dpi=120)
    return path


def fmt(value) -> str:
    return f"{value:.4f}" if isinstance(value, float) else ("–" if value is None else str(value))


def generative_section(results: dict) -> list[str]:
    """The generate-then-score tasks' table, their average, and the zero-shot tasks scored both ways."""
    tasks = results["tasks"]
    rows = [(n, tasks[n]) for n in GENERATIVE_TASKS if n in tasks]
    if not rows:
        return []
    about = ("The answer generated greedily and read from the text (docs/evaluation.md, \"Generative scoring\"); "
             "answered: the share of answers in which an option letter was found.")
    lines = ["## Generative tasks", "", about, "",
             "| task | acc | answered | exact match | F1 | samples | split | data | time (s) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows:
        lines.append(
            f"| {name} | {fmt(r.get('acc'))} | {fmt(r.get('answered'))} | {fmt(r.get('exact_match'))} "
            f"| {fmt(r.get('f1'))} | {r['num_samples']} | {', '.join(r['split'])} | {', '.join(r['data'])} "
            f"| {r['wall_time_s']:.1f} |"
        )
    if "zeroshot_gen_average" in results:
        average = results["zeroshot_gen_average"]
        lines += ["", (f"Generative zero-shot average: **{fmt(average['value'])}** "
                       f"(acc of {', '.join(average['metrics'])}).")]
    both = [(task.twin, name) for name, task in CHOICE_TASKS.items() if name in tasks and task.twin in tasks]
    if both:
        lines += ["", "| task | log-likelihood | generative |", "|---|---|---|"]
        lines += [f"| {twin} | {fmt(tasks[twin].get(AVERAGE_METRIC[twin]))} ({AVERAGE_METRIC[twin]}) "
                  f"| {fmt(tasks[name].get('acc'))} (acc) |" for twin, name in both]
        if "zeroshot_average" in results and "zeroshot_gen_average" in results:
            lines.append(f"| average | {fmt(results['zeroshot_average']['value'])} "
                         f"| {fmt(results['zeroshot_gen_average']['value'])} |")
    return [*lines, ""]


def markdown(results: dict, plots: dict[str, Path]) -> str:
    prov, tasks = results["provenance"], results["tasks"]
    lines = [f"# Evaluation of {prov['model']}", ""]
    method = prov.get("method_config")
    lines += [
        f"- model class: {prov['model_class']}" + (f", method config: `{json.dumps(method, default=str)}`" if method else ""),
        f"- device {prov['device']}, dtype {prov['dtype']}, batch {prov['batch']}, seed {prov['seed']}, limit {prov['limit']}",
        f"- started {prov.get('started_at')}, wall time {prov.get('wall_time_s', 0):.1f} s",
        "",
    ]
    if prov.get("partial"):
        missing = [name for name in prov["tasks"] if name not in tasks]
        cut = [name for name, r in tasks.items() if r.get("partial")]
        lines += ["**Partial: the run stopped before it finished.** "
                  + (f"Not run: {', '.join(missing)}. " if missing else "")
                  + (f"Cut short (its finished lengths below): {', '.join(cut)}. " if cut else "")
                  + "`linearize eval --resume` (or rerunning its recipe) continues it.", ""]
    harness_rows = [(n, r) for n, r in tasks.items() if "lm_eval_task" in r and n not in GENERATIVE_TASKS]
    if harness_rows:
        lines += ["## lm-eval tasks", "", "| task | acc | acc_norm | shots | samples | split | data | time (s) |"]
        lines += ["|---|---|---|---|---|---|---|---|"]
        for name, r in harness_rows:
            lines.append(
                f"| {name} | {fmt(r.get('acc'))} | {fmt(r.get('acc_norm'))} | {r['num_fewshot']} | {r['num_samples']} "
                f"| {', '.join(r['split'])} | {', '.join(r['data'])} | {r['wall_time_s']:.1f} |"
            )
        if "zeroshot_average" in results:
            used = ", ".join(f"{t} {m}" for t, m in AVERAGE_METRIC.items())
            lines += ["", f"Zero-shot average: **{fmt(results['zeroshot_average']['value'])}** ({used})."]
        lines.append("")
    lines += generative_section(results)
    if "ppl" in tasks:
        ppl = tasks["ppl"]
        lines += [f"## Perplexity on {Path(ppl['text']).name}", "", "| length | ppl | mean NLL | windows |"]
        lines += ["|---|---|---|---|"]
        lines += [f"| {length_label(r['length'])} | {r['ppl']:.3f} | {r['nll']:.4f} | {r['windows']} |" for r in ppl["by_length"]]
        lines += ["", f"![perplexity by length]({plots['ppl_by_length'].name})", ""]
        lines += [f"![loss by position]({plots['loss_by_position'].name})", ""]
    long_rows = [(n, r) for n, r in tasks.items() if "grid" in r]
    if long_rows:
        # A cut task's columns: the lengths it was to run, "–" where it did not get to.
        planned = {n: task_settings(prov, n)["lengths"] if r.get("partial") else r["lengths"] for n, r in long_rows}
        lengths = sorted({length for n, _ in long_rows for length in planned[n]})
        lines += ["## Long context", "", "| task | " + " | ".join(map(length_label, lengths)) + " | mean |"]
        lines += ["|---" * (len(lengths) + 2) + "|"]
        for name, r in long_rows:
            scores = {b["length"]: b["score"] for b in r["by_length"]}
            cells = (f"{scores[n]:.3f}" if n in scores else "–" for n in lengths)
            lines.append(f"| {name}{' (partial)' if r.get('partial') else ''} | " + " | ".join(cells)
                         + f" | {r['score']:.3f} |")
        lines.append("")
        lines += [f"![{name}]({plots[name].name})" for name, _ in long_rows if name in plots]
        lines.append("")
        for name, r in long_rows:
            if not r.get("depth_free") and name in plots:
                lines += depth_table(name, r)
    for title, key, names, rows in families_run(tasks):
        lines += family_section(title, key, names, rows, plots)
    versions = ", ".join(f"{k} {v}" for k, v in prov["versions"].items() if v)
    lines += ["## Provenance", "", f"- versions: {versions}", f"- lengths {prov['lengths']}, depths {prov['depths']}"]
    if prov.get("task_lengths"):
        lines.append(f"- lengths of single tasks: {prov['task_lengths']}")
    if prov.get("prompt_shape"):
        lines.append(f"- prompt shape of passkey and niah_single: {prov['prompt_shape']}")
    return "\n".join(lines) + "\n"


def depth_table(name: str, result: dict) -> list[str]:
    """A long-context task's score per needle depth (rows) and length (columns), the depth's mean last:
    where in the context a model loses the needle."""
    lengths = [b["length"] for b in result["by_length"]]
    cells = {(c["length"], c["depth"]): c["score"] for c in result["grid"]}
    means = {b["depth"]: b["score"] for b in result.get("by_depth", [])}
    lines = [f"### {name} by depth", "", "| depth | " + " | ".join(map(length_label, lengths)) + " | mean |",
             "|---" * (len(lengths) + 2) + "|"]
    for depth in result["depths"]:
        row = [f"{cells[length, depth]:.3f}" if (length, depth) in cells else "–" for length in lengths]
        mean_cell = f"{means[depth]:.3f}" if depth in means else "–"
        lines.append(f"| {depth:g}% | " + " | ".join(row) + f" | {mean_cell} |")
    return [*lines, ""]


# --- task families (RULER, BABILong): a table and a task x length heatmap, with their average by length


def family_rows(tasks: dict, names) -> list[tuple[str, dict]]:
    """The (name, result) of the family's tasks that ran, in the family's order (a family gets its section
    where two or more did: niah_multivalue alone, one of the six synthetic tasks too, is no RULER run)."""
    return [(name, tasks[name]) for name in names if name in tasks and "grid" in tasks[name]]


def families_run(tasks: dict) -> list[tuple[str, str, tuple, list[tuple[str, dict]]]]:
    """(title, plot name, task names, `family_rows`) of each family with a section of its own: two or
    more of its tasks ran."""
    return [(title, key, names, rows) for title, key, names in FAMILIES if len(rows := family_rows(tasks, names)) > 1]


def family_lengths(rows: list[tuple[str, dict]]) -> list[int]:
    return sorted({b["length"] for _, r in rows for b in r["by_length"]})


def family_average(rows: list[tuple[str, dict]]) -> dict[int, float]:
    """{length: mean score of the tasks} at each length that every task of `rows` has."""
    scores = [{b["length"]: b["score"] for b in r["by_length"]} for _, r in rows]
    shared = set.intersection(*(set(s) for s in scores))
    return {length: sum(s[length] for s in scores) / len(scores) for length in sorted(shared)}


def plot_family(title: str, rows: list[tuple[str, dict]], path: Path) -> Path:
    """Task x length heatmap of a family's scores, their average in the last row."""
    lengths, average = family_lengths(rows), family_average(rows)
    labels = [name for name, _ in rows] + ["average"]
    by_task = [{b["length"]: b["score"] for b in r["by_length"]} for _, r in rows] + [average]
    grid = [[scores.get(length, float("nan")) for length in lengths] for scores in by_task]
    fig = Figure(figsize=(1.1 * len(lengths) + 3, 0.45 * len(labels) + 1.6), layout="constrained")
    ax = fig.add_subplot()
    image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    for row, scores in enumerate(grid):
        for col, value in enumerate(scores):
            ax.text(col, row, "–" if math.isnan(value) else f"{value:.2f}", ha="center", va="center", fontsize=8)
    ax.axhline(len(rows) - 0.5, color="black", linewidth=1)
    ax.set_xticks(range(len(lengths)), [length_label(n) for n in lengths])
    ax.set_yticks(range(len(labels)), labels)
    ax.set(xlabel="context length (tokens)", title=f"{title}: score by task and length")
    fig.colorbar(image, ax=ax, label="score")
    save_png(fig, path, dpi=120)
    return path


def family_section(title: str, key: str, names, rows: list[tuple[str, dict]], plots: dict[str, Path]) -> list[str]:
    """A family's Markdown: its tasks' scores by length and their average at each length all of them ran."""
    lengths, average = family_lengths(rows), family_average(rows)
    lines = [f"## {title}", "", "| task | " + " | ".join(map(length_label, lengths)) + " |",
             "|---" * (len(lengths) + 1) + "|"]
    for name, r in rows:
        scores = {b["length"]: b["score"] for b in r["by_length"]}
        lines.append(f"| {name}{' (partial)' if r.get('partial') else ''} | "
                     + " | ".join(f"{scores[n]:.3f}" if n in scores else "–" for n in lengths) + " |")
    lines.append("| **average** | " + " | ".join(f"**{average[n]:.3f}**" if n in average else "–" for n in lengths)
                 + " |")
    missing = RULER_MISSING if key == "ruler" else {}
    note = (f"The average is over the {len(rows)} of {len(names) + len(missing)} {title} tasks run here, "
            "at each length all of them ran")
    if missing:
        note += "; RULER's papers report it at 4K. Not run: " + ", ".join(f"{n} ({why})" for n, why in missing.items())
    return [*lines, "", note + ".", "", f"![{title}]({plots[key].name})", ""]


def results_problem(results) -> str | None:
    """Why `results` is not what `linearize eval` writes, or None."""
    if not isinstance(results, dict) or not isinstance(results.get("tasks"), dict) or "provenance" not in results:
        return "no tasks and provenance"
    return None


def main(argv: list[str] | None = None) -> int:
    """`python -m linearize.eval.report FILE.json ...`: each results file's Markdown and plots, written again."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m linearize.eval.report", description=main.__doc__)
    parser.add_argument("results", nargs="+", type=Path, help="eval.json files written by `linearize eval`")
    args = parser.parse_args(argv)
    loaded = read_json_files(parser, args.results, "results file of `linearize eval`", results_problem)
    for path, results in loaded:  # every file checked before any is written
        print(write_summary(results, path)[0])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
