"""Which device each task of a resumed results file ran on, written into its provenance.

    python experiments/scripts/resumed_devices.py RESUMED/eval.json EARLIER/eval.json

`linearize eval --resume` keeps the tasks (and a cut long-context task's finished lengths) of the file
it resumes and records only its own device. This compares the two files and writes
provenance["devices_by_task"]: {task: device} for a task taken whole, {task: {length: device}} for a
long-context task whose earlier lengths were kept; nothing else in the file changes.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from linearize.eval.results_file import read_results, write_results


def devices_by_task(resumed: dict, earlier: dict) -> dict:
    here, there = resumed["provenance"]["device"], earlier["provenance"]["device"]
    devices = {}
    for name, result in resumed["tasks"].items():
        before = earlier["tasks"].get(name)
        if before == result:
            devices[name] = there
        elif before is not None and "by_length" in result:
            kept = {b["length"] for b in before["by_length"]}
            if [b for b in result["by_length"] if b["length"] in kept] != before["by_length"]:
                raise SystemExit(f"{name}: the earlier lengths' scores differ; not a resumed task")
            devices[name] = {str(b["length"]): there if b["length"] in kept else here for b in result["by_length"]}
        else:
            devices[name] = here
    return devices


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("resumed", type=Path)
    parser.add_argument("earlier", type=Path)
    args = parser.parse_args()
    resumed = read_results(args.resumed)
    resumed["provenance"]["devices_by_task"] = devices_by_task(resumed, read_results(args.earlier))
    write_results(resumed, args.resumed)
    print(args.resumed, resumed["provenance"]["devices_by_task"])


if __name__ == "__main__":
    main()
