"""Find, regenerate and check the generated sections of README.md and docs/*.md.

A generated section is the output of the command its opening marker names, over the files under docs/results/:

    <!-- generated: linearize recipe table docs/results/h200/runs/teacher --columns '0-shot avg' -->
    | row | 0-shot avg |
    ...
    <!-- end of generated -->

The command is `linearize ...` (run through `linearize.cli.main`) or `python -m MODULE ...` (the module's
`main(argv)`), run from the checkout's root; its standard output is the section. A bench section
(`<!-- bench section: TITLE -->`, written by `python -m linearize.bench.report`) is regenerated from the
bench JSON under docs/results/ with its title and start time.

`python -m experiments.docs.generated` checks every page and names each stale section with the command that
rebuilds it (status 1); `--write` rewrites the stale sections in place.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Markers stand on lines of their own, so that a page can mention them in its prose; indented markers (a
# table inside a list item) indent their section as much.
GENERATED = re.compile(r"^(?P<indent> *)<!-- generated: (?P<command>[^\n]+?) -->\n(?P<body>.*?)"
                       r"^(?P=indent)<!-- end of generated -->$", re.DOTALL | re.MULTILINE)
BENCH = re.compile(r"^<!-- bench section: (?P<title>[^\n]+?) -->\n.*?^<!-- end of bench section -->$",
                   re.DOTALL | re.MULTILINE)
BENCH_NAMES = ("kernels", "model", "train", "serve")


class GenerationError(Exception):
    """A marker whose command cannot run, or a bench section with no result behind it."""


@dataclass(frozen=True)
class Section:
    """One generated section of a page: its text as committed and as its command makes it now."""

    page: Path
    name: str  # the command, or the bench section's title
    command: str  # what rebuilds it
    start: int  # the committed text's span in the page
    end: int
    committed: str
    regenerated: str

    @property
    def stale(self) -> bool:
        return self.committed != self.regenerated


def pages(root: Path = ROOT) -> list[Path]:
    """The pages whose sections are checked: README.md and docs/*.md (docs/history/ records the past as it was)."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def run_command(command: str, root: Path = ROOT) -> str:
    """The standard output of a marker's command, run from `root`."""
    argv = shlex.split(command)
    out = io.StringIO()
    with contextlib.chdir(root), contextlib.redirect_stdout(out):
        if argv[:1] == ["linearize"]:
            from linearize.cli import main

            status = main(argv[1:])
        elif argv[:2] == ["python", "-m"] and len(argv) > 2:
            status = importlib.import_module(argv[2]).main(argv[3:])
        else:
            raise GenerationError(f"{command!r}: a generated section's command is `linearize ...` or `python -m MODULE ...`")
    if status:
        raise GenerationError(f"{command!r} exited with status {status}")
    return out.getvalue()


def bench_results(root: Path = ROOT) -> dict[tuple[str, str], Path]:
    """(section title, start time) -> the bench JSON under docs/results/ that gives that section."""
    from linearize.bench.report import title

    found = {}
    for name in BENCH_NAMES:
        for path in sorted((root / "docs" / "results").rglob(f"{name}.json")):
            results = json.loads(path.read_text(encoding="utf-8"))
            if results.get("bench") == name:
                found[(title(results), results["started_at"])] = path
    return found


def _indented(text: str, indent: str) -> str:
    return "".join(indent + line if line.strip() else line for line in text.splitlines(keepends=True))


def _bench_section(page: Path, match: re.Match, results: dict[tuple[str, str], Path], root: Path) -> Section:
    from linearize.bench.report import section

    title = match["title"]
    started = re.search(r"^- started (\S+),", match.group(0), re.MULTILINE)
    source = results.get((title, started and started[1]))
    if source is None:
        raise GenerationError(f"{page.relative_to(root)}: bench section {title!r} started "
                              f"{started and started[1]}: no bench JSON under docs/results/ has that title and start")
    regenerated = section(json.loads(source.read_text(encoding="utf-8")))
    command = f"python -m linearize.bench.report {source.parent.relative_to(root)} --doc {page.relative_to(root)}"
    return Section(page, title, command, match.start(), match.end(), match.group(0), regenerated)


def sections(page: Path, root: Path = ROOT, bench: dict | None = None) -> list[Section]:
    """Every generated section of `page`, each with its committed and regenerated text."""
    text = page.read_text(encoding="utf-8")
    found = [Section(page, m["command"], m["command"], m.start("body"), m.end("body"), m["body"],
                     _indented(run_command(m["command"], root), m["indent"])) for m in GENERATED.finditer(text)]
    bench_matches = list(BENCH.finditer(text))
    if bench_matches:
        bench = bench_results(root) if bench is None else bench
        found += [_bench_section(page, m, bench, root) for m in bench_matches]
    return sorted(found, key=lambda s: s.start)


def stale_message(section: Section, root: Path = ROOT) -> str:
    return (f"{section.page.relative_to(root)}: the generated section {section.name!r} differs from what its "
            f"command gives; rerun `{section.command}` (or `python -m experiments.docs.generated --write`)")


def write(page: Path, found: list[Section]) -> None:
    """Replace each stale section of `page` with its regenerated text."""
    text = page.read_text(encoding="utf-8")
    for s in sorted(found, key=lambda s: s.start, reverse=True):
        text = text[: s.start] + s.regenerated + text[s.end :]
    page.write_text(text, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.docs.generated", description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite the stale sections instead of naming them")
    args = parser.parse_args(argv)
    bench = bench_results()
    stale = 0
    for page in pages():
        found = [s for s in sections(page, bench=bench) if s.stale]
        stale += len(found)
        if found and args.write:
            write(page, found)
        for s in found:
            print(f"rewrote {page.relative_to(ROOT)}: {s.name}" if args.write else stale_message(s))
    return 1 if stale and not args.write else 0


if __name__ == "__main__":
    sys.exit(main())
