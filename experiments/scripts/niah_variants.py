"""niah_single by variant, length and depth for results rows, from their committed eval.json files
(the per-sample records in eval.samples.jsonl.gz beside each).

    python experiments/scripts/niah_variants.py docs/results/h200/runs/teacher docs/results/h200/runs/still ...
                                    [--max-length 4096]

Variant 1 hides a 7-digit number in noise, 2 a number in essays, 3 a UUID in essays (RULER's
niah_single_1/2/3). Per row and length: prompts answered per variant; for the UUIDs also how many
predictions start with the UUID's first 8 characters (found, not necessarily copied whole) and the
depths of the whole copies.
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

from linearize.eval.results_file import read_results


def common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def row_lines(row: Path, max_length: int) -> list[str]:
    samples = read_results(row / "eval.json")["tasks"]["niah_single"]["samples"]
    lines = []
    for length in sorted({s["length"] for s in samples if s["length"] <= max_length}):
        at = [s for s in samples if s["length"] == length]
        right = {v: f"{sum(s['score'] == 1 for s in at if s['variant'] == v)}/{sum(s['variant'] == v for s in at)}"
                 for v in (1, 2, 3)}
        uuids = [s for s in at if s["variant"] == 3]
        started = sum(common_prefix(s["prediction"].lstrip(": \n"), s["answers"][0]) >= 8 for s in uuids)
        depths = Counter(s["depth"] for s in uuids if s["score"] == 1)
        lines.append(f"| {row.name} | {length} | {right[1]} | {right[2]} | {right[3]} | {started}/{len(uuids)} | "
                     + (", ".join(f"{d:g}: {n}" for d, n in sorted(depths.items())) or "-") + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rows", nargs="+", type=Path)
    parser.add_argument("--max-length", type=int, default=4096)
    args = parser.parse_args()
    print("| row | length | numbers in noise (1) | numbers in essays (2) | UUIDs (3) | UUID's first 8 characters | "
          "depths of whole UUIDs (%: prompts) |")
    print("|---|---|---|---|---|---|---|")
    for row in args.rows:
        print("\n".join(row_lines(row, args.max_length)))


if __name__ == "__main__":
    main()
