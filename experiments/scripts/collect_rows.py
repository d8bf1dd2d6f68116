"""Results rows back from the GPU into docs/results/<device>/runs/<row>/: each row's eval.json (and its
per-sample records, eval.samples.jsonl.gz), run.json and layer record (stage1_layer_errors.json), with its report drawn again.
The figures stay out of git (.gitignore): a page that shows a row's layer figure draws it with
`python -m linearize.train.layer_report` and adds it with `git add -f`.

    python experiments/scripts/collect_rows.py /work/.device/N [--device h100] [--rows still-kl-25,lizard-gen]

Reads the `rows-<row>.tgz` archives and `runs-so-far.tgz` a `background.sh wait` brought back (a row's own
archive first: it is written when the row ends; runs-so-far holds rows cut short, their eval.json partial).
A row whose evaluation never began has no eval.json: its layer record alone is copied, unless the row is
published with a finished evaluation, which is kept whole. Prints what it took from where; the tables and
figures are then the pages' own commands.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tarfile
import tempfile
from pathlib import Path

from linearize.eval.report import write_report
from linearize.eval.results_file import read_results

ROOT = Path(__file__).resolve().parents[2]
KEPT = {"eval.json": "eval.json", "eval.samples.jsonl.gz": "eval.samples.jsonl.gz", "run.json": "run.json",
        "model/stage1_layer_errors.json": "stage1_layer_errors.json"}


def unpacked_runs(folder: Path, scratch: Path) -> dict[str, Path]:
    """{row: its run folder} from the archives in `folder`; a row's own archive wins over runs-so-far."""
    runs: dict[str, Path] = {}
    so_far = folder / "runs-so-far.tgz"
    if so_far.exists():
        with tarfile.open(so_far) as archive:
            archive.extractall(scratch / "so-far", filter="data")
        runs |= {p.name: p for p in sorted((scratch / "so-far" / "runs").glob("*")) if p.is_dir()}
    for path in sorted(folder.glob("rows-*.tgz")):
        target = scratch / path.stem
        with tarfile.open(path) as archive:
            archive.extractall(target, filter="data")
        runs |= {p.name: p for p in sorted(target.glob("*")) if p.is_dir() and (p / "run.json").exists()}
    return runs


def evaluated(path: Path | None) -> bool:
    """Whether `path` is a finished (not partial) eval.json."""
    return path is not None and path.exists() and not json.loads(path.read_text())["provenance"].get("partial")


def collect(folder: Path, out_root: Path, rows: set[str] | None = None) -> list[str]:
    """Copy each row's kept files into out_root/<row>/ and draw its report; returns one line a row."""
    lines = []
    with tempfile.TemporaryDirectory() as scratch:
        for row, run in sorted(unpacked_runs(folder, Path(scratch)).items()):
            if rows is not None and row not in rows:
                continue
            present = {name: run / source for source, name in KEPT.items() if (run / source).exists()}
            if not present:
                continue
            target = out_root / row
            if evaluated(target / "eval.json") and not evaluated(present.get("eval.json")):
                # A row trained again only for the rows that take its stage 1 (`distill ROW`) comes back
                # unevaluated: its files would replace the published row's with what no table can show.
                lines.append(f"{row}: not copied; {target} holds its finished evaluation and this run has none")
                continue
            target.mkdir(parents=True, exist_ok=True)
            for name, source in present.items():
                shutil.copyfile(source, target / name)
            state = "no evaluation"
            if "eval.json" in present:
                # Written again, records and all: an eval.json that carries them inline comes out split.
                results = read_results(target / "eval.json")
                write_report(results, target / "eval.json")
                state = "partial evaluation" if results["provenance"].get("partial") else "evaluated"
            lines.append(f"{row}: {state}; {', '.join(sorted(present))} -> {target}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="where the device tool put a call's files (its files_at)")
    parser.add_argument("--device", default="h100", help="docs/results/<device>/runs/ (default h100)")
    parser.add_argument("--rows", default=None, help="only these rows, comma-separated")
    args = parser.parse_args()
    rows = set(args.rows.split(",")) if args.rows else None
    lines = collect(args.folder, ROOT / "docs" / "results" / args.device / "runs", rows)
    print("\n".join(lines) if lines else f"no rows with results in {args.folder}")


if __name__ == "__main__":
    main()
