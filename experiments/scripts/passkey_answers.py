"""What the passkey answers are, for results rows, from their committed eval.json files: per length,
how many predictions hold a number at all (3 or more digits) and how many are the key.

    python experiments/scripts/passkey_answers.py docs/results/h200/runs/teacher docs/results/h200/runs/lizard ...

A row that answers with numbers that are not the key retrieves something and copies it badly; a row
that answers without one ("a key that is used to open a door") never found the key. Also prints
one answer without a number per row, the first by length and depth.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from linearize.eval.report import length_label
from linearize.eval.results_file import read_results

NUMBER = re.compile(r"\d{3,}")


def row_cells(samples: list[dict]) -> list[str]:
    cells = []
    for length in sorted({s["length"] for s in samples}):
        at = [s for s in samples if s["length"] == length]
        numbers = sum(bool(NUMBER.search(s["prediction"])) for s in at)
        keys = sum(s["score"] == 1 for s in at)
        cells.append(f"{numbers} / {keys} of {len(at)}")
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rows", nargs="+", type=Path)
    args = parser.parse_args()
    rows = {row.name: read_results(row / "eval.json")["tasks"]["passkey"]["samples"] for row in args.rows}
    lengths = sorted({s["length"] for samples in rows.values() for s in samples})
    print("Per length: predictions holding a number / predictions that are the key, of the prompts.\n")
    print("| row | " + " | ".join(length_label(n) for n in lengths) + " |")
    print("|---|" + "---|" * len(lengths))
    for name, samples in rows.items():
        print(f"| {name} | " + " | ".join(row_cells(samples)) + " |")
    print("\nThe first answer without a number, per row:\n")
    for name, samples in rows.items():
        first = next((s for s in samples if not NUMBER.search(s["prediction"])), None)
        if first is not None:
            print(f"- {name} ({first['length']} tokens, depth {first['depth']:g}%): {first['prediction'].strip()!r}")


if __name__ == "__main__":
    main()
