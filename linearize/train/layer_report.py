"""A figure of a run's `stage1_layer_errors.json`: each linearized layer's stage-1 error and, with KL-guided
selection, its KL gain, the layers the run keeps softmax in red. `distill` writes it beside the record
(`stage1_layer_errors.png`) once the choice is made; to draw records again:

    python -m linearize.train.layer_report RUN/stage1_layer_errors.json ...
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

from matplotlib.figure import Figure  # no pyplot: Figure.savefig renders with Agg, no display needed

from ..cli_args import read_json_files
from ..figures import save_png

PICKED, OTHER = "tab:red", "tab:gray"


def layer_figure(record: dict) -> Figure:
    """One bar panel per score the record holds, on a shared axis of the layers it names. Layers an even
    rule kept softmax from the start have no stage-1 error and no bar, only a red label."""
    picked = set(record.get("picked", ()))
    layers = sorted({int(i) for i in record["mse"]} | picked)
    panels = [("stage-1 validation MSE against the teacher's attention output", record["mse"])]
    if "kl_gain" in record:
        steps = record.get("kl_train_steps", 0)
        trained = f"each candidate trained {steps} steps" if steps else "candidates untrained"
        if "kl_seq_len" in record:
            trained += f", scored on {record['kl_seq_len']:,}-token sequences"
        panels.append((f"KL gain: KL(all linear) - KL(this layer alone softmax), {trained}", record["kl_gain"]))
    fig = Figure(figsize=(max(6.0, 0.3 * len(layers) + 2), 2.4 * len(panels) + 0.8), layout="constrained")
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (title, scores) in zip(axes, panels):
        ax.bar(range(len(layers)), [scores.get(str(i), math.nan) for i in layers],
               color=[PICKED if i in picked else OTHER for i in layers])
        ax.axhline(0, color="black", linewidth=0.6)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[-1].set_xticks(range(len(layers)), [str(i) for i in layers], fontsize=8)
    for label, layer in zip(axes[-1].get_xticklabels(), layers):
        label.set_color(PICKED if layer in picked else "black")
    axes[-1].set_xlabel("layer")
    rule = record.get("softmax_by")
    kept = f"the {len(picked)} layers" if len(picked) != 1 else "the layer"
    fig.suptitle(f"{rule}: {kept} kept softmax in red" if rule else "stage-1 layer errors")
    return fig


def record_problem(record) -> str | None:
    """What keeps `record` from being drawn, or None."""
    if not isinstance(record, dict) or not isinstance(record.get("mse"), dict):
        return "no mse"
    for key in ("mse", "kl_gain"):
        scores = record.get(key, {})
        if not isinstance(scores, dict) or not all(
                k.isdigit() and isinstance(v, (int, float)) and not isinstance(v, bool) for k, v in scores.items()):
            return f"{key} is not a layer-to-number mapping"
    picked = record.get("picked", [])
    if not isinstance(picked, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in picked):
        return "picked is not a list of layers"
    return None


def write_layer_figure(record: dict, path: str | Path) -> Path:
    """The figure as a PNG at `path`, replaced whole: an interrupted write leaves the last one."""
    path = Path(path)
    partial = path.with_name(f".{path.name}.partial")
    save_png(layer_figure(record), partial, dpi=120)
    os.replace(partial, path)
    return path


def main(argv: list[str] | None = None) -> int:
    """`python -m linearize.train.layer_report FILE.json ...`: each record's figure, FILE.png beside it."""
    parser = argparse.ArgumentParser(prog="python -m linearize.train.layer_report", description=main.__doc__)
    parser.add_argument("records", nargs="+", type=Path, help="stage1_layer_errors.json files written by distill")
    args = parser.parse_args(argv)
    loaded = read_json_files(parser, args.records, "stage1_layer_errors.json of `linearize distill`", record_problem)
    for path, record in loaded:
        print(write_layer_figure(record, path.with_suffix(".png")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
