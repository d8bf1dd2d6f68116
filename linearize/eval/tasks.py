"""The settings of an evaluation's tasks, parsed: task names and shorthands, lengths, depths, per-task lengths
and limits, and the checks that need the tokenizer (prompts that fit, a chat template)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from linearize.eval import babilong, generative, harness, longcontext, ruler
from linearize.eval.prompt_shapes import DEFAULT_SHAPE
from linearize.eval.texts import essay_sentences

LONGCONTEXT = tuple(longcontext.TASKS)  # every long-context task: the synthetic six, RULER's and BABILong's
SYNTHETIC = ("passkey", "niah_single", "niah_multikey", "niah_multivalue", "variable_tracking", "mqar")
# The RULER-style tasks whose mean is the results tables' "RULER" column (recipes; 4K there). The
# `ruler` shorthand is RULER's own task set (ruler.RULER_TASKS), averaged in the eval report.
RULER = ("niah_single", "niah_multikey", "niah_multivalue", "variable_tracking")
SHORTHANDS = {"zeroshot": harness.ZEROSHOT, "longcontext": SYNTHETIC, "ruler": ruler.RULER_TASKS,
              "babilong": babilong.BABILONG_TASKS}
SHORTHANDS["zeroshot_gen"] = generative.ZEROSHOT_GEN  # the zero-shot questions answered by a generated letter
KNOWN_TASKS = ("ppl", *harness.HARNESS_TASKS, *LONGCONTEXT)
KNOWN_TASKS += generative.TASKS  # lm-eval tasks of ours (generate, then score)


def parse_tasks(tasks: str | Sequence[str]) -> list[str]:
    """Expand shorthands and check names: 'ppl,zeroshot' -> ['ppl', 'piqa', ...] (order kept, no repeats).

    Names that are not ours are accepted if lm-eval knows them (they run through the harness).
    """
    items = tasks.split(",") if isinstance(tasks, str) else list(tasks)
    names = []
    for item in (i.strip() for i in items):
        if not item:
            continue
        for name in SHORTHANDS.get(item, (item,)):
            if name not in KNOWN_TASKS and not harness.is_lm_eval_task(name):
                choices = ", ".join((*KNOWN_TASKS, *SHORTHANDS))
                raise ValueError(f"Unknown task {name!r}; choose from {choices}, or an lm-eval task name.")
            if name not in names:
                names.append(name)
    if not names:
        raise ValueError("No tasks given; pass a comma-separated list such as ppl,zeroshot,passkey.")
    return names


class TaskNotInRun(ValueError):
    """Per-task settings (task lengths or limits) name a task this run does not evaluate."""


def _items(value) -> list:
    """A comma-separated string's items, a list's, or a lone value (a recipe's `lengths: 512`) as one item."""
    if isinstance(value, str):
        return value.split(",")
    return list(value) if isinstance(value, Iterable) else [value]


def parse_lengths(lengths: str | int | Sequence[int | str]) -> list[int]:
    """'1k,2k,512,32K' -> [512, 1024, 2048, 32768] (k = 1024), sorted, no repeats; 512 alone -> [512]. 0
    is BABILong's length of the facts alone (other tasks refuse it in `check_prompt_lengths`)."""
    items = _items(lengths)
    parsed = set()
    for item in (str(i).strip() for i in items):
        match = re.fullmatch(r"(\d+)([kK]?)", item)
        if not match:
            raise ValueError(f"Bad length {item!r}; use token counts such as 512, 4k or 32K (0: BABILong's facts alone).")
        parsed.add(int(match[1]) * (1024 if match[2] else 1))
    if not parsed:
        raise ValueError("No lengths given; pass a comma-separated list such as 1k,2k,4k.")
    return sorted(parsed)


def parse_depths(depths: str | float | Sequence[float | str]) -> list[float]:
    """'0,25,50,75,100' -> [0, 25, 50, 75, 100]: needle depths in percent of the haystack; 50 alone -> [50]."""
    items = _items(depths)
    parsed = set()
    for item in (str(i).strip() for i in items):
        try:
            depth = float(item)
        except ValueError:
            depth = -1.0
        if not 0 <= depth <= 100:
            raise ValueError(f"Bad depth {item!r}; depths are percentages from 0 to 100.")
        parsed.add(int(depth) if depth.is_integer() else depth)
    return sorted(parsed)


def haystack_essay(task: str, essay: str | None) -> Sequence[str]:
    """The essay sentences a long-context task needs (none for noise or key-value haystacks)."""
    return essay_sentences(essay) if longcontext.TASKS[task][1] else ()


def check_prompt_lengths(names: Sequence[str], tokenizer, lengths: Sequence[int], essay: str | None = None,
                         task_lengths: dict[str, list[int]] | None = None, prompt_shape: str = DEFAULT_SHAPE) -> None:
    """Raise ValueError if the shortest length cannot hold a long-context task's prompt (or is 0 for ppl)."""
    if "ppl" in names and 0 in (task_lengths or {}).get("ppl", lengths):
        raise ValueError("lengths: ppl cannot score windows of length 0 (0 is BABILong's length of the facts "
                         "alone): drop 0 from the lengths, or give ppl its own with --task-lengths")
    for name in (n for n in names if n in LONGCONTEXT):
        shortest = min((task_lengths or {}).get(name, lengths))
        longcontext.check_length(name, tokenizer, shortest, haystack_essay(name, essay), prompt_shape)


def parse_task_lengths(names: Sequence[str], task_lengths: dict[str, str | int | Sequence[int | str]]
                       ) -> dict[str, list[int]]:
    """{task: lengths} for ppl or long-context tasks of this run, e.g. {"variable_tracking": "4k"}; a
    shorthand (e.g. {"ruler": "4k"}) gives its tasks those lengths."""
    if not isinstance(task_lengths, dict):
        raise TypeError(f"task lengths must be a mapping of task to lengths, e.g. {{ruler: 4k}}, got {task_lengths!r}")
    parsed = {}
    for key, lengths in task_lengths.items():
        for task in SHORTHANDS.get(key, (key,)):
            if task not in names or (task != "ppl" and task not in LONGCONTEXT):
                named = repr(task) if task == key else f"{key!r} (its task {task!r})"
                raise TaskNotInRun(f"task lengths name {named}, which is not ppl or a long-context task of this "
                                   f"run ({', '.join(names)})")
            parsed[task] = parse_lengths(lengths)
    return parsed


def check_task_limits(names: Sequence[str], task_limits: dict[str, int]) -> None:
    """Per-task caps may only name lm-eval tasks of this run, with positive integers."""
    if not isinstance(task_limits, dict):
        raise TypeError(f"task limits must be a mapping of task to a number of examples, e.g. {{mmlu: 20}}, "
                        f"got {task_limits!r}")
    for task, cap in task_limits.items():
        if task not in names or task == "ppl" or task in LONGCONTEXT:
            raise TaskNotInRun(f"a task limit names {task!r}, which is not an lm-eval task of this run "
                               f"({', '.join(names)})")
        if not isinstance(cap, int) or isinstance(cap, bool) or cap < 1:
            raise ValueError(f"the limit of {task} must be a positive integer, got {cap!r}")


def check_chat_template(chat_template, tokenizer=None) -> None:
    """A bool, and with a tokenizer given, one that has a chat template when asked for."""
    if not isinstance(chat_template, bool):
        raise TypeError(f"chat_template must be true or false, got {chat_template!r}")
    if chat_template and tokenizer is not None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template")
