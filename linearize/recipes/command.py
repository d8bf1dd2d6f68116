"""`linearize recipe run | list | table | plot`."""

from __future__ import annotations

import argparse
from pathlib import Path

from .files import Recipe, RecipeError, display_path, find, shipped_rows
from .running import run
from .table import finished_runs, plot_rows, table, table_markers, write_into


def register(subparsers) -> None:
    p = subparsers.add_parser("recipe", help="run results recipes and tabulate them")
    sub = p.add_subparsers(dest="recipe_command", required=True)
    r = sub.add_parser("run", help="distil and evaluate each recipe into OUT/<name>",
                       usage="linearize recipe run RECIPE [RECIPE ...] [KEY=VALUE ...] --out OUT [--model SPEC] "
                             "[--device DEVICE] [--no-eval]",
                       description="KEY=VALUE words override the resolved recipes' settings, e.g. "
                                   "distill.max_tokens=100000 eval.samples=1 (dotted keys, YAML values).")
    r.add_argument("recipes", nargs="*", metavar="RECIPE|KEY=VALUE",
                   help="recipe files (YAML or JSON) or shipped recipes' names, and overrides")
    r.add_argument("--out", required=True, action=_ThenWords, nargs="+", metavar=("OUT", "RECIPE|KEY=VALUE"),
                   help="folder of run directories")
    r.add_argument("--model", action=_ThenWords, nargs="+", metavar=("SPEC", "RECIPE|KEY=VALUE"),
                   help="teacher to use instead of each recipe's own (e.g. a local copy)")
    r.add_argument("--device", action=_ThenWords, nargs="+", metavar=("DEVICE", "RECIPE|KEY=VALUE"),
                   help="cuda or cpu (default: cuda if available)")
    r.add_argument("--no-eval", dest="evaluate", action=_SwitchThenWords, const=False, nargs="*",
                   metavar="RECIPE|KEY=VALUE", help="distil only; a later run without it evaluates the models it finds")
    r.add_argument("--smoke", action=_SwitchThenWords, const=True, nargs="*", metavar="RECIPE|KEY=VALUE",
                   help="CPU-sized: two steps a stage on 256-token sequences, 2 documents or samples a task, one "
                        "1K length (KEY=VALUE overrides still apply over it): a few minutes on 2 cores")
    r.set_defaults(func=_run_command, words_after=[], evaluate=True, smoke=False)
    ls = sub.add_parser("list", help="the shipped recipes: name, file and row label, main rows then ablations")
    # Lists YAML files: the command skips loading transformers (what the verbs that load models need).
    ls.set_defaults(func=_list_command, loads_models=False)
    t = sub.add_parser("table", help="a Markdown table of finished runs")
    t.add_argument("runs", nargs="+", type=Path, help="run directories or folders of them")
    t.add_argument("--into", type=Path, help="replace the recipe table section of this Markdown file")
    t.add_argument("--section", metavar="NAME",
                   help="with --into: the page's table of this name, for a page with several tables")
    t.add_argument("--plot", type=Path, help="also draw the rows' perplexity and retrieval by length into this PNG")
    t.add_argument("--columns", type=_patterns, metavar="PATTERNS",
                   help="only these columns beside the row's name: comma-separated names or shell-style "
                        "patterns, e.g. '0-shot avg,RULER-12 4K,BABILong *'")
    t.set_defaults(func=_table_command)
    g = sub.add_parser("plot", help="draw chosen finished runs' perplexity and retrieval by length (no table)")
    g.add_argument("runs", nargs="+", type=Path, help="run directories or folders of them, in legend order")
    g.add_argument("--out", type=Path, required=True, help="the PNG to write")
    g.set_defaults(func=_plot_command)


class _ThenWords(argparse.Action):
    """An option's value, then the recipes and overrides written after it: argparse takes a command's
    positionals in one run, so `run lizard --out runs/ eval.samples=1` would otherwise refuse the override."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values[0])
        namespace.words_after = [*namespace.words_after, *values[1:]]


class _SwitchThenWords(argparse.Action):
    """A switch (`--no-eval`, `--smoke`: sets `const`), then the recipes and overrides written after it, as
    `_ThenWords` takes them."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, self.const)
        namespace.words_after = [*namespace.words_after, *values]


def _is_override(word: str) -> bool:
    # A KEY=VALUE word; a file whose name holds "=" is still a file.
    return "=" in word and not Path(word).is_file()


def _run_command(args) -> int:
    words = [*args.recipes, *args.words_after]
    overrides = [w for w in words if _is_override(w)]
    specs = [w for w in words if not _is_override(w)]
    if not specs:
        raise RecipeError("recipe run: no recipe named (a file, or a shipped recipe's name from `linearize recipe list`)")
    # Every file checked before any work starts.
    recipes = [Recipe.load(find(spec), overrides, smoke=args.smoke) for spec in specs]
    names = [r.name for r in recipes]
    if len(set(names)) != len(names):
        raise RecipeError(f"two recipes share a name: {names}")
    for recipe in recipes:  # with --no-eval too: a later run evaluates the model, after the training it took
        recipe.check_eval()
    outs = []
    for recipe in recipes:
        outs.append(run(recipe, args.out, model=args.model, device=args.device, evaluate_model=args.evaluate))
        print(f"recipe {recipe.name}: {outs[-1]}")
    if args.evaluate:
        print(table(outs), end="")  # the rows as `recipe table` shows them
    return 0


def _list_command(args) -> int:
    lines = [("name", "file", "row")] + [(name, display_path(path), row) for name, path, row in shipped_rows()]
    widths = [max(len(line[i]) for line in lines) for i in range(2)]
    for name, file, row in lines:
        print(f"{name:<{widths[0]}}  {file:<{widths[1]}}  {row}")
    return 0


def _patterns(text: str) -> list[str]:
    """--columns' value: its comma-separated patterns, none empty."""
    patterns = [p.strip() for p in text.split(",")]
    if not all(patterns):
        raise argparse.ArgumentTypeError(f"an empty name in {text!r}")
    return patterns


def _finished_runs_of(paths: list[Path]) -> list[Path]:
    for path in paths:
        if not path.is_dir():
            raise RecipeError(f"{path} is not a directory")
    return finished_runs(paths)


def _plot_command(args) -> int:
    print(f"wrote {plot_rows(_finished_runs_of(args.runs), args.out)}")
    return 0


def _table_command(args) -> int:
    if args.section is not None:
        if args.into is None:
            raise RecipeError("--section names a table of the page given by --into")
        table_markers(args.section)  # a bad name is refused before the figure is drawn
    runs = _finished_runs_of(args.runs)
    text = table(runs, args.columns)
    if args.plot:
        print(f"wrote {plot_rows(runs, args.plot)}")
    if args.into:
        write_into(args.into, text, args.section)
        print(f"wrote {args.into}")
    else:
        print(text, end="")
    return 0
