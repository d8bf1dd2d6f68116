"""Side by side, the question's attention on the passkey in several models (`still_routing.py --parts mass`).

    python -m experiments.scripts.compare_mass LABEL=DIR [LABEL=DIR ...] --out PNG

Each DIR holds a mass.json. Prints a Markdown table (per model and length: the key's share of the best
head's normaliser, and the linear terms' mean share) and draws both against the prompt length.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from matplotlib.figure import Figure

from experiments.routing import MASS_SHARES
from linearize.eval.report import length_label
from linearize.figures import save_png


def load(pairs: list[str]) -> dict[str, dict]:
    runs = {}
    for pair in pairs:
        label, sep, folder = pair.partition("=")
        if not sep or not label:
            raise SystemExit(f"expected LABEL=DIR, got {pair!r}")
        path = Path(folder) / "mass.json"
        if not path.is_file():
            raise SystemExit(f"{path} not found: run python -m experiments.scripts.still_routing --parts mass --out {folder}")
        runs[label] = json.loads(path.read_text())
    return runs


def all_lengths(runs: dict[str, dict]) -> list[int]:
    return sorted({n for result in runs.values() for n in result["lengths"]})


def series(result: dict, name: str) -> list[float]:
    return [result["results"][str(n)][name]["best"] for n in result["lengths"]]


def markdown(runs: dict[str, dict]) -> str:
    lengths = all_lengths(runs)
    labels = [length_label(n) for n in lengths]
    lines = ["| model | " + " | ".join(f"key {label}" for label in labels) + " | "
             + " | ".join(f"linear {label}" for label in labels) + " |",
             "|---|" + "---|" * (2 * len(lengths))]
    for label, result in runs.items():
        cells = {name: dict(zip(result["lengths"], series(result, name))) for name in ("needle", "linear")}
        row = [f"{cells[name][n]:.2f}" if n in cells[name] else "–" for name in ("needle", "linear") for n in lengths]
        lines.append(f"| {label} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def plot(runs: dict[str, dict], path: Path) -> None:
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    lengths = all_lengths(runs)
    for ax, name in zip(axes, ("needle", "linear")):
        for label, result in runs.items():
            ax.plot(result["lengths"], series(result, name), marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [length_label(n) for n in lengths])
        ax.set(xlabel="prompt length (tokens)", title=MASS_SHARES[name], ylim=(0, 1))
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("share at the question")
    axes[1].legend(fontsize=7)
    save_png(fig, path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", metavar="LABEL=DIR")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    runs = load(args.runs)
    print(markdown(runs))
    plot(runs, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
