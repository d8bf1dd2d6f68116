"""`python -m linearize.bench.report DIR...`: merge `linearize bench` results into docs/benchmarks.md.

Every DIR/kernels.json, DIR/model.json, DIR/train.json, DIR/serve.json and DIR/serve_chat.json becomes one
section (`--doc docs/serving.md` for the serving figures), titled with what was measured, on
which device and with which method options, and carrying the command that produced it. Sections are found again
by title, so merging a rerun replaces its section instead of adding a copy; everything else in the document is
left as it is.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import chat, kernels, model, serve, train
from .common import provenance

DOC = Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md"
TABLES = {"kernels": kernels.tables, "model": model.tables, "train": train.tables, "serve": serve.tables,
          chat.NAME: chat.tables}
START = "<!-- bench section: {} -->"
END = "<!-- end of bench section -->"


def title(results: dict) -> str:
    """The run's title, plus its method options (`--set`), the model bench's methods other than its
    default, a compiled decode step and the code-path switches set in its environment: a run with
    other options is another section."""
    settings = results["settings"]
    options = [f"{k}={v}" for k, v in settings.get("options", {}).items()]
    options += [f"{k}={v}" for k, v in results["environment"].get("switches", {}).items()]
    if tuple(settings.get("methods", model.DEFAULT_METHODS)) != model.DEFAULT_METHODS:
        options.append(f"methods {'+'.join(settings['methods'])}")
    if settings.get("ops"):
        options.append(f"ops {'+'.join(settings['ops'])}")
    if settings.get("cuda_graph"):
        options.append("cuda graph")
    if settings.get("prefill_budget"):
        options.append(f"prefill budget {settings['prefill_budget']:g}")
    if settings.get("compile_decode"):
        options.append(f"decode compiled ({settings['compile_decode']})")
    return f"{results['title']} ({', '.join(options)})" if options else results["title"]


def section(results: dict) -> str:
    lines = [START.format(title(results)), f"### {title(results)}", "", *provenance(results), "",
             *TABLES[results["bench"]](results), END]
    return "\n".join(lines)


def merge(doc: str, results: dict) -> str:
    start = START.format(title(results))
    if start in doc:
        head, rest = doc.split(start, 1)
        return head + section(results) + rest.split(END, 1)[1]
    return (doc.rstrip("\n") + "\n\n" if doc.strip() else "") + section(results) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m linearize.bench.report", description=__doc__.splitlines()[0])
    parser.add_argument("dirs", nargs="+", type=Path, help="--out directories of `linearize bench` runs")
    parser.add_argument("--doc", type=Path, default=DOC, help=f"document to update (default {DOC})")
    args = parser.parse_args(argv)
    files = [d / f"{name}.json" for d in args.dirs for name in TABLES if (d / f"{name}.json").is_file()]
    if not files:
        parser.error(f"no {', '.join(f'{n}.json' for n in TABLES)} in {', '.join(map(str, args.dirs))}")
    doc = args.doc.read_text(encoding="utf-8") if args.doc.exists() else ""
    for path in files:
        doc = merge(doc, json.loads(path.read_text(encoding="utf-8")))
        print(f"merged {path}")
    args.doc.write_text(doc, encoding="utf-8")
    print(f"wrote {args.doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
