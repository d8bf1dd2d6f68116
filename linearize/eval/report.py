"""Write eval results as FILE.json, a Markdown summary FILE.md and PNG plots next to them."""

from __future__ import annotations

import json
from pathlib import Path

from matplotlib.figure import Figure  # no pyplot: Figure.savefig renders with Agg, no display needed

from linearize.eval.api import task_settings
from linearize.eval.harness import AVERAGE_METRIC


def write_json(results: dict, out: str | Path) -> Path:
    """The results as JSON at `out`, replaced atomically (a partial file is never half written)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    try:
        tmp.write_text(json.dumps(results, indent=2, default=str) + "\n", encoding="utf-8")
        tmp.replace(out)
    except BaseException:
        tmp.unlink(missing_ok=True)  # no NAME.tmp left behind
        raise
    return out


def write_report(results: dict, out: str | Path) -> list[Path]:
    """Write the JSON, the Markdown summary and the plots; returns the paths written."""
    out = write_json(results, out)
    plots = write_plots(results, out)
    md = out.with_suffix(".md")
    md.write_text(markdown(results, plots), encoding="utf-8")
    return [out, md, *plots.values()]


def length_label(length: int) -> str:
    return f"{length // 1024}K" if length % 1024 == 0 else str(length)


def write_plots(results: dict, out: Path) -> dict[str, Path]:
    """{plot name: PNG path}: ppl vs length and loss vs position for ppl, a heatmap per long-context task."""
    plots = {}
    for name, result in results["tasks"].items():
        if name == "ppl":
            plots["ppl_by_length"] = plot_ppl(result, out.with_name(f"{out.stem}.ppl_by_length.png"))
            plots["loss_by_position"] = plot_positions(result, out.with_name(f"{out.stem}.loss_by_position.png"))
        elif "grid" in result:
            plots[name] = plot_heatmap(name, result, out.with_name(f"{out.stem}.{name}.png"))
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
    fig.savefig(path, dpi=120)
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
    fig.savefig(path, dpi=120)
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
    ax.set_yticks(range(len(depths)), [f"{d}%" for d in depths])
    ax.set(xlabel="context length (tokens)", ylabel="needle depth", title=f"{name}: score {result['score']:.3f}")
    fig.colorbar(image, ax=ax, label="score")
    fig.savefig(path, dpi=120)
    return path


def fmt(value) -> str:
    return f"{value:.4f}" if isinstance(value, float) else ("–" if value is None else str(value))


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
    harness_rows = [(n, r) for n, r in tasks.items() if "lm_eval_task" in r]
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
        lines += [f"![{name}]({plots[name].name})" for name, _ in long_rows]
        lines.append("")
    versions = ", ".join(f"{k} {v}" for k, v in prov["versions"].items() if v)
    lines += ["## Provenance", "", f"- versions: {versions}", f"- lengths {prov['lengths']}, depths {prov['depths']}"]
    if prov.get("task_lengths"):
        lines.append(f"- lengths of single tasks: {prov['task_lengths']}")
    return "\n".join(lines) + "\n"
