"""Recipes: one file per results row, run by one command, gathered into one table.

    linearize recipe list                                   # the shipped rows: name, file, row label
    linearize recipe run lizard-window-256 [more ...] --out runs/ [--model SPEC] [KEY=VALUE ...]
    linearize recipe run recipes/lizard.yaml --out runs/ distill.max_tokens=100000 eval.samples=1
    linearize recipe table runs/ [--into docs/results.md]

A recipe is a YAML (or JSON) mapping that names its row and holds the `distill` settings
(`DistillConfig` fields without `out`; absent or null for the teacher's own row), the `eval` settings
(`linearize.eval.evaluate` arguments) and the teacher `model`. `extends: PARENT` starts from another
recipe: mappings merge key by key (but `eval.task_limits` and `eval.task_lengths`, which name the tasks of
one evaluation, replace the parent's whole), any other value (a list too) replaces the parent's, and `name` and
`row` are never inherited (they default to the file's stem). PARENT is a path relative to the file, or
relative to the shipped `recipes/` folder, or the name of a shipped recipe (`recipes/**/NAME.yaml`).

The shipped recipes: the main rows in `recipes/`, the ablations in `recipes/ablations/`, the rows on the
second teacher in `recipes/gemma3/`, the hybrids' layer-selection rows (`distill.softmax_by`) in
`recipes/hybrids/`, rows scored by generation too in `recipes/generative/`, and the bases they extend in
`recipes/base/` (`eval.yaml`, the evaluation every row runs; `distill.yaml`, the training every student
shares; `gemma3.yaml`, the Gemma rows' teacher and their evaluation to 128K; `hybrids.yaml`, the hybrid
rows' evaluation: RULER at 4K, BABILong and niah_single to 16K; `gemma3-hybrids.yaml`, the same on Gemma
to 32K), which are not rows themselves. `recipe run` takes a file or a shipped recipe's
name, and KEY=VALUE overrides of the resolved recipe (dotted keys, YAML values) for every recipe it runs.

A run keeps everything under OUT/<name>/: the distilled `model/`, `eval.json` (+ .md and plots) and
`run.json` (the resolved recipe, the file it came from and the overrides, the wall times, the training
tokens). Rerunning continues where it stopped: a finished model is not trained again, an interrupted one
resumes from its checkpoint, a finished eval is kept; a rerun with other training settings (`distill`,
the teacher) is refused, naming them, and leaves the run as it was.
"""

from .files import RECIPES_DIR, Recipe, RecipeError, find, shipped
from .running import run
from .table import finished_runs, plot_rows, table, write_into

__all__ = ["RECIPES_DIR", "Recipe", "RecipeError", "find", "finished_runs", "plot_rows", "run", "shipped", "table",
           "write_into"]
