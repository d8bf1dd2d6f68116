"""Generate-then-score tasks: the zero-shot questions answered by a generated letter, and SQuAD by a generated span.

Log-likelihood scoring asks which of the given endings the model finds likeliest; these tasks make the
model write its answer, greedily, and score what it wrote. They are lm-eval tasks of output type
`generate_until`, defined here as configs (no YAML) and added to the harness's TaskManager, so they run
through `lm_eval.simple_evaluate` like the others: `--limit`, batching, the offline data (the same local
copies, through `local_tasks`) and the results format stay as they are.

Multiple choice (`piqa_gen`, `arc_easy_gen`, `arc_challenge_gen`, `hellaswag_gen`, `winogrande_gen`):
the question of the log-likelihood task, zero-shot, its options lettered, then "Answer:":

    Question: How to fix sails?
    A. Sew them.
    B. Burn them.
    Answer:

HellaSwag and WinoGrande have no question of their own: their prompt opens with the text
("Context: ..." / "Sentence: ...") and asks one (`ChoiceTask.question`). At most `CHOICE_TOKENS` new tokens
are generated, stopping at a newline; `parse_choice` reads the answer from them, and `acc` is the
share of answers equal to the gold letter (`answered`: the share where a letter was found at all).

SQuAD (`squad_gen`): the lines "Context: ...", "Question: ..." and "Answer:", at most `SQUAD_TOKENS` new tokens up
to a newline, scored by the official SQuAD v1.1 exact match and token F1 against each gold answer,
the best of them (`squad_scores`).
"""

from __future__ import annotations

import dataclasses
import re
import string
from collections import Counter
from collections.abc import Callable

from linearize.eval import local_tasks

LETTERS = "ABCDEFGH"
CHOICE_TOKENS = 8  # room for " B", "(B)" or "The answer is B"; the first line is all that is read
SQUAD_TOKENS = 32
STOP = ["\n"]
SAMPLES_KEPT = 100  # generations kept per task in the results, the first documents'
VERSION = 1.0


# --- prompts


def choice_prompt(question: str, options: list[str]) -> str:
    """`question` (one or more lines), the options as "A. ...", one a line, then "Answer:"."""
    lines = [question, *(f"{LETTERS[i]}. {option.strip()}" for i, option in enumerate(options))]
    return "\n".join(lines) + "\nAnswer:"


def hellaswag_text(doc: dict) -> str:
    """HellaSwag's context as lm-eval's hellaswag task writes it: the activity, then the context, with
    WikiHow's "[title]" markers made sentence breaks and other bracketed artifacts removed."""
    return hellaswag_clean(f"{doc['activity_label']}: {doc['ctx_a']} {doc['ctx_b'].capitalize()}")


def hellaswag_clean(text: str) -> str:
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def arc_gold(doc: dict) -> int:
    """ARC's answer key among its labels, which are letters or (a few questions) digits: an index."""
    return doc["choices"]["label"].index(doc["answerKey"])


@dataclasses.dataclass(frozen=True)
class ChoiceTask:
    """A multiple-choice task asked for a generated letter: where its data is and how a document reads."""

    name: str
    twin: str  # the log-likelihood task on the same questions
    dataset_path: str  # lm-eval's, so that local_tasks finds the same local copy
    dataset_name: str | None
    question: Callable[[dict], str]  # the lines above the options
    options: Callable[[dict], list[str]]
    gold: Callable[[dict], int]  # the correct option's index

    def prompt(self, doc: dict) -> str:
        return choice_prompt(self.question(doc), self.options(doc))

    def target(self, doc: dict) -> str:
        return LETTERS[self.gold(doc)]

    def score(self, doc: dict, results: list[str]) -> dict:
        """lm-eval's process_results: the generation (results[0]) read and compared with the gold letter."""
        answer = parse_choice(results[0], len(self.options(doc)))
        return {"acc": float(answer == self.target(doc)), "answered": float(answer is not None)}

    def config(self) -> dict:
        return base_config(self.name, self.dataset_path, self.dataset_name, CHOICE_TOKENS) | {
            "doc_to_text": self.prompt,
            "doc_to_target": self.target,
            "process_results": self.score,
            "metric_list": [mean_metric("acc"), mean_metric("answered")],
        }


CHOICE_TASKS = {
    task.name: task
    for task in (
        ChoiceTask("piqa_gen", "piqa", "baber/piqa", None, lambda d: f"Question: {d['goal'].strip()}",
                   lambda d: [d["sol1"], d["sol2"]], lambda d: int(d["label"])),
        ChoiceTask("arc_easy_gen", "arc_easy", "allenai/ai2_arc", "ARC-Easy",
                   lambda d: f"Question: {d['question'].strip()}", lambda d: d["choices"]["text"], arc_gold),
        ChoiceTask("arc_challenge_gen", "arc_challenge", "allenai/ai2_arc", "ARC-Challenge",
                   lambda d: f"Question: {d['question'].strip()}", lambda d: d["choices"]["text"], arc_gold),
        ChoiceTask("hellaswag_gen", "hellaswag", "Rowan/hellaswag", None,
                   lambda d: f"Context: {hellaswag_text(d)}\nQuestion: Which ending is the most likely continuation?",
                   lambda d: [hellaswag_clean(e) for e in d["endings"]], lambda d: int(d["label"])),
        ChoiceTask("winogrande_gen", "winogrande", "allenai/winogrande", "winogrande_xl",
                   lambda d: f"Sentence: {d['sentence'].strip()}\nQuestion: Which option fills the blank (_)?",
                   lambda d: [d["option1"], d["option2"]], lambda d: int(d["answer"]) - 1),
    )
}
ZEROSHOT_GEN = tuple(CHOICE_TASKS)


def squad_prompt(doc: dict) -> str:
    return f"Context: {doc['context'].strip()}\nQuestion: {doc['question'].strip()}\nAnswer:"


def squad_target(doc: dict) -> str:
    return doc["answers"]["text"][0]


def squad_score(doc: dict, results: list[str]) -> dict:
    exact, f1 = squad_scores(results[0], doc["answers"]["text"])
    return {"exact_match": exact, "f1": f1}


def squad_config() -> dict:
    return base_config("squad_gen", local_tasks.SQUAD_PATH, None, SQUAD_TOKENS) | {
        "doc_to_text": squad_prompt,
        "doc_to_target": squad_target,
        "process_results": squad_score,
        "metric_list": [mean_metric("exact_match"), mean_metric("f1")],
    }


def base_config(name: str, dataset_path: str, dataset_name: str | None, max_tokens: int) -> dict:
    """What every generative task's lm-eval config shares: zero-shot on validation, greedy, up to a newline."""
    return {
        "task": name,
        "dataset_path": dataset_path,
        "dataset_name": dataset_name,
        "output_type": "generate_until",
        "training_split": None,
        "validation_split": "validation",
        "test_split": None,
        "fewshot_split": None,
        "num_fewshot": 0,
        "generation_kwargs": {"until": list(STOP), "max_gen_toks": max_tokens, "do_sample": False},
        "metadata": {"version": VERSION},
    }


def mean_metric(name: str) -> dict:
    return {"metric": name, "aggregation": "mean", "higher_is_better": True}


TASKS = (*ZEROSHOT_GEN, "squad_gen")  # our names, and the lm-eval task names they register


def configs() -> dict[str, dict]:
    """{task name: its lm-eval config}."""
    return {**{name: task.config() for name, task in CHOICE_TASKS.items()}, "squad_gen": squad_config()}


def register(manager) -> None:
    """Add the generative tasks to lm-eval's TaskManager `manager` (its index), as inline configs."""
    from lm_eval.tasks._index import Entry, Kind

    for name, cfg in configs().items():
        manager.task_index[name] = Entry(name=name, kind=Kind.TASK, yaml_path=None, cfg=cfg)


# --- reading and scoring answers


def parse_choice(text: str, n_options: int) -> str | None:
    """The option letter a generation gives, or None (scored wrong).

    The first of the question's letters (A to the n-th) that stands alone in `text`, uppercase, not
    part of a longer word or number: " B", "B.", "(B)", "B) Sew them", "The answer is C" give B, B, B,
    B, C; "Because" and a letter past the options (" E" of four) give nothing. A lowercase letter
    counts only as the whole answer, up to spaces and punctuation (" b", "b.", "(c)"), so the article
    in "a rope" is not read as A; an uppercase article is ("A man ..." reads as A).
    """
    letters = LETTERS[:n_options]
    match = re.search(rf"(?<![A-Za-z0-9])([{letters}])(?![A-Za-z0-9])", text)
    if match:
        return match[1]
    bare = "".join(ch for ch in text if not ch.isspace() and ch not in string.punctuation)
    if len(bare) == 1 and bare.islower() and bare.upper() in letters:
        return bare.upper()
    return None


def normalize_answer(text: str) -> str:
    """SQuAD's normalisation: lowercase, punctuation removed, the articles a/an/the removed, whitespace collapsed."""
    text = "".join(ch for ch in text.lower() if ch not in string.punctuation)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def squad_f1(prediction: str, gold: str) -> float:
    """Token F1 of the normalised prediction against one normalised gold answer (SQuAD v1.1)."""
    predicted, expected = normalize_answer(prediction).split(), normalize_answer(gold).split()
    common = sum((Counter(predicted) & Counter(expected)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(predicted), common / len(expected)
    return 2 * precision * recall / (precision + recall)


def squad_scores(prediction: str, answers: list[str]) -> tuple[float, float]:
    """(exact match, F1) of `prediction`: each the best over the gold `answers`."""
    exact = max(float(normalize_answer(prediction) == normalize_answer(gold)) for gold in answers)
    return exact, max(squad_f1(prediction, gold) for gold in answers)


# --- results


def sample_summary(name: str, samples: list[dict]) -> dict:
    """What a generative task's results keep of lm-eval's logged samples: the first SAMPLES_KEPT
    documents' generations with their scores, and for multiple choice how often each letter was
    answered over all documents ("none": no letter found)."""
    samples = sorted(samples, key=lambda s: s["doc_id"])
    kept = []
    if name in CHOICE_TASKS:
        task = CHOICE_TASKS[name]
        answers = Counter()
        for s in samples:
            answer = parse_choice(generation(s), len(task.options(s["doc"])))
            answers[answer or "none"] += 1
            if len(kept) < SAMPLES_KEPT:
                kept.append({"doc_id": s["doc_id"], "target": s["target"], "generation": generation(s),
                             "answer": answer, "acc": s["acc"]})
        letters = sorted(a for a in answers if a != "none")
        return {"answers": {a: answers[a] for a in [*letters, "none"] if a in answers}, "samples": kept}
    for s in samples[:SAMPLES_KEPT]:
        kept.append({"doc_id": s["doc_id"], "answers": list(s["doc"]["answers"]["text"]), "generation": generation(s),
                     "exact_match": s["exact_match"], "f1": s["f1"]})
    return {"samples": kept}


def generation(sample: dict) -> str:
    """The generated text of one lm-eval logged sample, cut at the stop sequence."""
    response = sample["filtered_resps"][0]
    return response[0] if isinstance(response, list) else response


def zeroshot_gen_average(results: dict) -> dict | None:
    """Mean `acc` of the five generative zero-shot tasks, beside the log-likelihood zero-shot average."""
    if not all(task in results for task in ZEROSHOT_GEN):
        return None
    values = [results[task]["acc"] for task in ZEROSHOT_GEN]
    return {"value": sum(values) / len(values), "metrics": dict.fromkeys(ZEROSHOT_GEN, "acc")}
