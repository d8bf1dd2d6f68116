"""Results files written with every sample's record inline, rewritten as `linearize eval` writes them:
the scores in eval.json, the per-sample records in eval.samples.jsonl.gz beside it.

    python experiments/scripts/split_samples.py [FILE.json ...]     # default: every eval.json under docs/results

The results read the same before and after (`linearize.eval.results_file.read_results` puts the records
back), so every table, figure and report drawn from them is unchanged; a file already split is written
again byte for byte. Prints each file's bytes before and after.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from linearize.eval.results_file import read_results, samples_path, write_results

ROOT = Path(__file__).resolve().parents[2]


def size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def split(path: Path) -> tuple[int, int]:
    """Rewrite the results file `path` split; (its bytes with any records file before, after)."""
    before = size(path) + size(samples_path(path))
    results = read_results(path)
    if read_results(write_results(results, path)) != results:
        raise SystemExit(f"{path}: the rewritten results do not read back the same")
    return before, size(path) + size(samples_path(path))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", type=Path, help="results files (default: docs/results/**/eval.json)")
    args = parser.parse_args()
    files = args.files or sorted((ROOT / "docs" / "results").rglob("eval.json"))
    total_before = total_after = 0
    for path in files:
        before, after = split(path)
        total_before, total_after = total_before + before, total_after + after
        print(f"{path}: {before} -> {after} bytes")
    print(f"{len(files)} files: {total_before} -> {total_after} bytes")


if __name__ == "__main__":
    main()
