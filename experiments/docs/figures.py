"""Tables whose words are written by hand and whose figures are read from docs/results/: the targets tables.

    python -m experiments.docs.figures docs/results/targets/results.yaml

A spec (YAML) holds the table's header, its rows' cells and where the figures come from:

    runs: docs/results/h200/runs            # `run|COLUMN` operands name a run directory under it (or a list)
    files:                                  # `NAME#KEY.PATH` operands name one of these JSON files
      model: docs/results/h200/model/llama3-8b-rope-shared/model.json
    header: [target, measured, ""]
    rows:
      - ["zero-shot >= teacher ({{teacher|0-shot avg}})", "{{<lizard|0-shot avg> / <teacher|0-shot avg> ; .1%}}", met]

Every `{{EXPR}}` or `{{EXPR ; FORMAT}}` in a cell is replaced by a figure. An operand is `run|COLUMN` (the cell
`linearize recipe table` prints for that run and column) or `NAME#KEY.PATH` (a value of a listed JSON file;
a list is indexed by number or by `[KEY=VALUE&KEY=VALUE]`, its first item that matches). `{{OPERAND}}` alone is
the operand's text as its table prints it (`run|niah_single 512..8K`: the cells from 512 to 8K, " / " between);
in arithmetic, operands stand in angle brackets and are read as numbers, with + - * / ( ), numbers, min(),
max() and abs(), and FORMAT is a Python format spec (default `g`).
The table's title line names the GPUs its figures ran on.
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from experiments.docs.tables import gpu

PLACEHOLDER = re.compile(r"\{\{(?P<expr>.+?)(?:\s;\s*(?P<format>[^}]*?))?\s*\}\}")
OPERAND = re.compile(r"<(?P<operand>[^<>]+)>")
FILTER = re.compile(r"^(?P<key>[^\[]*)\[(?P<where>[^\]]*)\]$")
SERIES = re.compile(r"(?P<name>.+) (?P<first>\d+K?)\.\.(?P<last>\d+K?)")
LENGTHS = ["512", "1K", "2K", "4K", "8K", "16K", "32K", "64K", "128K"]
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_FUNCTIONS = {"min": min, "max": max, "abs": abs}


class FigureError(Exception):
    """A spec whose operand names nothing under docs/results/, or whose expression is not arithmetic."""


@dataclass
class Figures:
    """Reads operands from the files a spec names, and remembers the GPUs they ran on."""

    runs: list[Path]  # where `run|COLUMN` operands' runs are looked up, the first that has the run
    files: dict[str, Path]
    gpus: set[str] = field(default_factory=set)
    _cells: dict[Path, dict[str, str]] = field(default_factory=dict)
    _json: dict[Path, dict] = field(default_factory=dict)

    def text(self, operand: str) -> str:
        operand = operand.strip()
        if "#" in operand:
            return _number_text(self._value(operand))
        run, sep, column = operand.partition("|")
        if not sep or not self.runs:
            raise FigureError(f"{operand!r}: an operand is RUN|COLUMN (with `runs:` in the spec) or NAME#KEY.PATH")
        cells = self._run_cells(next((d / run.strip() for d in self.runs if (d / run.strip()).is_dir()),
                                     self.runs[0] / run.strip()))
        series = SERIES.fullmatch(column.strip())
        if series:  # "niah_single 512..8K": the cells at each length from the first to the last, " / " between
            if not {series["first"], series["last"]} <= set(LENGTHS):
                raise FigureError(f"{operand!r}: a series runs between two of {', '.join(LENGTHS)}")
            first, last = LENGTHS.index(series["first"]), LENGTHS.index(series["last"]) + 1
            return " / ".join(self.text(f"{run}|{series['name']} {length}") for length in LENGTHS[first:last])
        if column.strip() not in cells:
            raise FigureError(f"{operand!r}: the run has no column {column.strip()!r}")
        return cells[column.strip()]

    def number(self, operand: str) -> float:
        if "#" in operand:
            value = self._value(operand.strip())
        else:
            value = self.text(operand).replace(",", "").removesuffix("%")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise FigureError(f"{operand!r} is {value!r}, not a number") from None

    def _run_cells(self, run: Path) -> dict[str, str]:
        from linearize.recipes.table import _row_cells

        if run not in self._cells:
            if not (run / "eval.json").is_file():
                raise FigureError(f"{run}: no eval.json")
            self._cells[run] = _row_cells(run)
            self.gpus.add(self._cells[run]["GPU"])
        return self._cells[run]

    def _value(self, operand: str):
        name, _, path = operand.partition("#")
        if name not in self.files:
            raise FigureError(f"{operand!r}: the spec's `files:` has no {name!r}")
        file = self.files[name]
        if file not in self._json:
            self._json[file] = json.loads(file.read_text(encoding="utf-8"))
            environment = self._json[file].get("environment") or self._json[file].get("provenance") or {}
            if environment.get("device"):
                self.gpus.add(gpu(environment["device"]))
        value = self._json[file]
        for key in path.split("."):
            value = _step(value, key, operand)
        return value


def _step(value, key: str, operand: str):
    """One key of a path: a dict key, a list index, or `key[K=V&K=V]` (the first list item that matches)."""
    found = FILTER.match(key)
    if found:
        items = value.get(found["key"]) if found["key"] else value
        where = dict(pair.split("=", 1) for pair in found["where"].split("&"))
        matches = [item for item in items or [] if all(str(item.get(k)) == v for k, v in where.items())]
        if not matches:
            raise FigureError(f"{operand!r}: no item of {found['key'] or 'the list'} has {found['where']}")
        return matches[0]
    if isinstance(value, list) and key.isdigit() and int(key) < len(value):
        return value[int(key)]
    if isinstance(value, dict) and key in value:
        return value[key]
    raise FigureError(f"{operand!r}: no {key!r} there")


def _number_text(value) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _evaluate(node: ast.AST, values: dict[str, float], expr: str) -> float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, values, expr)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.Name) and node.id in values:
        return values[node.id]
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.left, values, expr), _evaluate(node.right, values, expr))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_evaluate(node.operand, values, expr)
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS
            and not node.keywords):
        return _FUNCTIONS[node.func.id](*(_evaluate(a, values, expr) for a in node.args))
    raise FigureError(f"{{{{{expr}}}}}: only numbers, <operands>, + - * / ( ), min, max and abs")


def figure(expr: str, format_spec: str | None, figures: Figures) -> str:
    """One placeholder's text."""
    if "<" not in expr:
        text = figures.text(expr)
        return text if format_spec is None else format(figures.number(expr), format_spec)
    values: dict[str, float] = {}

    def name(match: re.Match) -> str:
        values[f"v{len(values)}"] = figures.number(match["operand"])
        return f"v{len(values) - 1}"

    source = OPERAND.sub(name, expr).strip()
    try:
        tree = ast.parse(source, mode="eval")
    except SyntaxError:
        raise FigureError(f"{{{{{expr}}}}}: not an arithmetic expression") from None
    return format(_evaluate(tree, values, expr), format_spec or "g")


def fill(cell: str, figures: Figures) -> str:
    return PLACEHOLDER.sub(lambda m: figure(m["expr"], m["format"], figures), cell)


def render(spec_path: Path, root: Path = Path(".")) -> str:
    """The spec's table, its title line naming the GPUs its figures ran on."""
    spec = yaml.safe_load(spec_path.read_text(encoding="utf-8"))
    runs = spec.get("runs") or []
    figures = Figures([root / d for d in ([runs] if isinstance(runs, str) else runs)],
                      {name: root / path for name, path in (spec.get("files") or {}).items()})
    header = spec["header"]
    rows = []
    for row in spec["rows"]:
        if len(row) != len(header):
            raise FigureError(f"{spec_path}: a row has {len(row)} cells for {len(header)} columns: {row[0]!r}")
        rows.append([fill(str(cell), figures) for cell in row])
    measured_on = ", ".join(sorted(figures.gpus)) or "–"
    title = f"**{fill(spec['title'], figures)}** (measured on: {measured_on})" if spec.get("title") else \
        f"Measured on: {measured_on}."
    lines = [title, ""]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.docs.figures", description=__doc__.splitlines()[0])
    parser.add_argument("spec", type=Path)
    args = parser.parse_args(argv)
    try:
        text = render(args.spec)
    except (FigureError, OSError, yaml.YAMLError, KeyError) as error:
        print(f"{args.spec}: {error}", file=sys.stderr)
        return 2
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
