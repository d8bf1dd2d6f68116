"""Multiple-choice and LAMBADA tasks through the real lm-eval harness, on local data (see local_tasks),
and our generate-then-score tasks (see generative) through the same harness."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager
from functools import cache
from pathlib import Path

from linearize.eval import generative, local_tasks
from linearize.eval.continuations import score_continuations
from linearize.eval.generation import rows_per_batch

# Our task name -> lm-eval task name.
HARNESS_TASKS = {
    "piqa": "piqa",
    "arc_easy": "arc_easy",
    "arc_challenge": "arc_challenge",
    "hellaswag": "hellaswag",
    "winogrande": "winogrande",
    "mmlu": "mmlu",
    "lambada": "lambada_openai",
}
# The folders of lm-eval's tasks/ that define them.
TASK_DIRS = ("piqa", "arc", "hellaswag", "winogrande", "mmlu/default", "lambada")
NUM_FEWSHOT = {"mmlu": 5}  # the rest are zero-shot
ZEROSHOT = ("piqa", "arc_easy", "arc_challenge", "hellaswag", "winogrande")
# The metric each zero-shot task contributes to the average, as in the LoLCATs and Lizard papers.
AVERAGE_METRIC = {"piqa": "acc", "arc_easy": "acc", "arc_challenge": "acc_norm", "hellaswag": "acc_norm", "winogrande": "acc"}
# lm-eval gives acc a closed-form stderr, but bootstraps perplexity-like metrics in a multiprocessing
# pool, which hangs when the parent process has CUDA initialised (fork). So LAMBADA and pass-through
# tasks run without stderr; the multiple-choice tasks keep theirs, and so do the generative ones (whose
# metrics are all means).
CLOSED_FORM_STDERR = {"piqa", "arc_easy", "arc_challenge", "hellaswag", "winogrande", "mmlu", *generative.TASKS}


@cache
def compiled_template(template: str):
    from lm_eval import utils

    return utils.env.from_string(template)


def render_template(template: str, doc: dict) -> str:
    return compiled_template(template).render(**doc)


def cache_lm_eval_templates() -> None:
    """Make lm-eval compile each Jinja prompt template once instead of once per document.

    lm-eval 0.4.13's `utils.apply_template` compiles the template string on every call (~1.5 ms):
    minutes of CPU for HellaSwag's 10K documents or MMLU's 14K five-shot prompts, longer than the
    model's forward passes on a GPU. The rendered text is the same; only the compile is shared.
    """
    import lm_eval.utils

    lm_eval.utils.apply_template = render_template


def check_data_reachable(tasks: list[str], data_dir: str | None = None) -> None:
    """Refuse, before any task of an evaluation runs, lm-eval tasks that have no local copy of their
    data where the hub cannot be reached (`local_tasks.check_hub_tasks`). The suite's own tasks always
    read the olmo copies, so only other lm-eval names need lm-eval's full index, which takes seconds."""
    others = [task for task in tasks if task not in HARNESS_TASKS and task not in generative.TASKS]
    if others:
        sources = local_tasks.redirect_to_local(task_manager(full_index=True), others,
                                                local_tasks.olmo_datasets_dir(data_dir))
        local_tasks.check_hub_tasks(sources)


def task_manager(full_index: bool):
    """lm-eval's TaskManager, with our generative tasks added; indexing only our tasks' folders takes
    milliseconds instead of seconds."""
    import lm_eval.tasks
    from lm_eval.tasks import TaskManager

    if full_index:
        manager = TaskManager()
    else:
        tasks_dir = Path(lm_eval.tasks.__file__).parent
        manager = TaskManager(include_defaults=False, include_path=[str(tasks_dir / d) for d in TASK_DIRS])
    generative.register(manager)
    return manager


@cache
def lm_eval_names() -> frozenset[str]:
    """Every task, group and tag name lm-eval knows (indexing all its YAMLs takes seconds: cached)."""
    return frozenset(task_manager(full_index=True).task_index)


def is_lm_eval_task(name: str) -> bool:
    """Whether lm-eval itself knows `name`, for pass-through task names."""
    return name in lm_eval_names()


@contextmanager
def quiet_lm_eval():
    """While lm-eval runs, what it prints that is no news to us goes unsaid; its progress bars stay.

    - its loggers' warnings about being handed a model object rather than a name (we mean to) and
      about task metadata: lm-eval's errors still show;
    - datasets' `Map:` bars (our local task data is loaded in memory, so every run maps it afresh);
    - git's "fatal: not a git repository": lm-eval records the working folder's commit with `git
      describe`, which writes that line to our stderr outside a checkout. The same call, its stderr
      to /dev/null.
    """
    import logging
    import os
    import subprocess

    import datasets
    import lm_eval.evaluator
    from lm_eval.loggers.utils import get_commit_from_path

    def git_commit_hash():
        try:
            return subprocess.check_output(["git", "describe", "--always"], stderr=subprocess.DEVNULL).strip().decode()
        except (subprocess.CalledProcessError, FileNotFoundError):
            return get_commit_from_path(os.getcwd())

    logger, bars = logging.getLogger("lm_eval"), datasets.is_progress_bar_enabled()
    level, git_hash = logger.level, lm_eval.evaluator.get_git_commit_hash
    logger.setLevel(logging.ERROR)
    datasets.disable_progress_bars()
    lm_eval.evaluator.get_git_commit_hash = git_commit_hash
    try:
        yield
    finally:
        logger.setLevel(level)
        if bars:
            datasets.enable_progress_bars()
        lm_eval.evaluator.get_git_commit_hash = git_hash


@contextmanager
def building_no_cache(model):
    """lm-eval calls model(ids) for loglikelihoods, which would build a cache it never reads (for a
    linearized model, each layer's state after every batch): off for the duration."""
    use_cache, model.config.use_cache = model.config.use_cache, False
    try:
        yield
    finally:
        model.config.use_cache = use_cache


# Tokens per lm-eval forward: its logits are [tokens, vocabulary] in float32 (13 GB at SmolLM2's 49,152).
HARNESS_BATCH_TOKENS = 65536


def budgeted_lm(model, tokenizer, batch: int, max_batch_tokens: int = HARNESS_BATCH_TOKENS):
    """lm-eval's HF wrapper, its batches sized by count and tokens: at most `batch` requests and
    `max_batch_tokens` tokens. lm-eval's batch_size="auto" would find the largest by trial runs until
    out of memory; here they count. Requests go longest first, so short ones (HellaSwag's ~100
    tokens) go many at once and long ones (MMLU's 5-shot passages, thousands of tokens) fewer; a
    batch's log-likelihoods are scored together (`continuations.score_continuations`)."""
    from lm_eval.models.huggingface import HFLM

    class BudgetedHFLM(HFLM):
        def _detect_batch_size(self, requests=None, pos=0):
            # loglikelihood_rolling sizes its windows' batches once, at the model's full length
            return rows_per_batch(self.max_length, batch, max_batch_tokens)

        def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
            from tqdm import tqdm

            if self.backend != "causal":  # an encoder-decoder's continuations are scored on the decoder side
                return super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm, override_bs=override_bs)

            def rows_for(length: int) -> int:  # inputs come cut to the model's length
                rows = rows_per_batch(length, batch, max_batch_tokens)
                return min(rows, override_bs) if override_bs else rows

            def scored(indices, answers):
                for i, answer in zip(indices, answers, strict=True):
                    if requests[i][0] is not None:  # loglikelihood_rolling's windows are cached by it, whole
                        self.cache_hook.add_partial("loglikelihood", requests[i][0], answer)
                bar.update(len(indices))

            with tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0,
                      desc="Running loglikelihood requests") as bar:
                return score_continuations(requests, self._model_call, max_length=self.max_length,
                                           rows_for=rows_for, device=self.device,
                                           softmax_dtype=self.softmax_dtype, on_batch=scored)

        def generate_until(self, requests, disable_tqdm: bool = False):
            # lm-eval's "auto" sizes all generation batches at once, by trial runs at the model's full
            # length; here by the longest prompt and its new tokens, counted.
            longest = max((len(self.tok_encode(r.args[0])) + r.args[1].get("max_gen_toks", self.max_gen_toks)
                           for r in requests), default=1)
            auto, self.batch_size_per_gpu = self.batch_size_per_gpu, rows_per_batch(
                min(longest, self.max_length), batch, max_batch_tokens)
            try:
                return super().generate_until(requests, disable_tqdm=disable_tqdm)
            finally:
                self.batch_size_per_gpu = auto

    return BudgetedHFLM(pretrained=model, tokenizer=tokenizer, batch_size="auto", max_batch_size=batch)


def run_harness(model, tokenizer, tasks: list[str], *, limit=None, task_limits=None, batch=8, seed=0,
                data_dir=None, on_task: Callable[[str, dict], None] | None = None, chat_template: bool = False) -> dict:
    """Run each task through `lm_eval.simple_evaluate`; returns {task: metrics and provenance}.

    `tasks` are our names (see HARNESS_TASKS and generative.TASKS) or any lm-eval task name. `limit`
    caps the documents per task (per subtask for groups), as lm-eval's --limit does; `task_limits`
    {task: cap} overrides it.
    `batch` requests a forward at most (fewer for long ones: `budgeted_lm`). `on_task(task, result)`,
    if given, gets each task's result as soon as it is done. `chat_template` wraps each prompt of the
    generative tasks in the tokenizer's chat template (lm-eval's `apply_chat_template`), as one user
    turn: an instruct model answers there, where on the bare prompt it may end its turn at once. The
    log-likelihood tasks keep the bare text, which is what the results rows compare.
    """
    from lm_eval import simple_evaluate

    lm_names = {task: HARNESS_TASKS.get(task, task) for task in tasks}
    manager = task_manager(full_index=any(task not in HARNESS_TASKS and task not in generative.TASKS for task in tasks))
    root = local_tasks.olmo_datasets_dir(data_dir)
    sources = local_tasks.redirect_to_local(manager, list(lm_names.values()), root)
    local_tasks.check_hub_tasks(sources)
    cache_lm_eval_templates()

    results = {}
    with quiet_lm_eval(), building_no_cache(model):
        lm = budgeted_lm(model, tokenizer, batch)
        for task, lm_name in lm_names.items():
            start = time.perf_counter()
            out = simple_evaluate(
                model=lm,
                tasks=[lm_name],
                num_fewshot=NUM_FEWSHOT.get(task),
                limit=(task_limits or {}).get(task, limit),
                task_manager=manager,
                bootstrap_iters=100_000 if task in CLOSED_FORM_STDERR else 0,
                log_samples=task in generative.TASKS,  # their generations are kept (some of them)
                apply_chat_template=chat_template and task in generative.TASKS,
                random_seed=seed,
                numpy_random_seed=seed,
                torch_random_seed=seed,
                fewshot_random_seed=seed,
            )
            results[task] = summarize(out, lm_name, manager, sources) | {"data_root": str(root)}
            if task in generative.TASKS:
                results[task] |= generative.sample_summary(task, out["samples"][lm_name])
            results[task]["wall_time_s"] = time.perf_counter() - start
            if on_task is not None:
                on_task(task, results[task])
    return results


def summarize(out: dict, lm_name: str, manager, sources: dict) -> dict:
    """Metrics of one lm-eval run ('acc,none' -> 'acc'), with what was evaluated on which data."""
    metrics = {
        key.split(",")[0]: value
        for key, value in out["results"][lm_name].items()
        if key.endswith(",none") and value != "N/A"
    }
    leaves = local_tasks.leaf_tasks(manager, lm_name)
    samples = out["n-samples"]
    return {
        **metrics,
        "lm_eval_task": lm_name,
        "version": out["versions"].get(lm_name),
        "num_fewshot": max(out["n-shot"].get(leaf, 0) for leaf in leaves),
        "num_samples": sum(samples[leaf]["effective"] for leaf in leaves if leaf in samples),
        "data": sorted({sources[leaf]["source"] for leaf in leaves}),
        "split": sorted({sources[leaf]["split"] for leaf in leaves if "split" in sources[leaf]}),
    }


def zeroshot_average(results: dict) -> dict | None:
    """Mean of the five zero-shot tasks (acc_norm for ARC-c and HellaSwag, acc otherwise)."""
    if not all(task in results for task in ZEROSHOT):
        return None
    values = [results[task][AVERAGE_METRIC[task]] for task in ZEROSHOT]
    return {"value": sum(values) / len(values), "metrics": AVERAGE_METRIC}
