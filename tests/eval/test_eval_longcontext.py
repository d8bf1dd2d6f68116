import json
import random
import re
from functools import partial

import pytest
from conftest import make_byte_tokenizer

from linearize.eval import longcontext as lc
from linearize.eval.haystack import count_tokens, insert
from linearize.eval.texts import essay_sentences

DEPTHS = (0, 25, 50, 75, 100)


def generate_one(task, tokenizer, length, depth, seed, essay, variant=None):
    return lc.build_sample(task, tokenizer, length, depth, seed, variant=variant, essay=essay)


CASES = [("passkey", None), ("niah_single", 1), ("niah_single", 2), ("niah_single", 3), ("niah_multikey", None),
         ("niah_multivalue", None), ("variable_tracking", None), ("mqar", None)]


@pytest.fixture(scope="module")
def essay(essay_file):
    return essay_sentences(essay_file)


@pytest.mark.parametrize("task,variant", CASES)
def test_generator_is_deterministic_by_seed(task, variant, tokenizer, essay):
    a = generate_one(task, tokenizer, 1024, 50, 7, essay, variant)
    b = generate_one(task, tokenizer, 1024, 50, 7, essay, variant)
    c = generate_one(task, tokenizer, 1024, 50, 8, essay, variant)
    assert a == b
    assert c.answers != a.answers and c.prompt != a.prompt


@pytest.mark.parametrize("task,variant", CASES)
@pytest.mark.parametrize("length", [1024, 1500, 3000])
def test_prompt_hits_target_length(task, variant, length, tokenizer, essay):
    sample = generate_one(task, tokenizer, length, 50, 3, essay, variant)
    assert sample.tokens == count_tokens(tokenizer, sample.prompt)
    # Whole haystack units only: short of the target by less than one unit (a sentence or a line).
    assert length - 100 <= sample.tokens <= length


@pytest.mark.parametrize("task,variant", CASES)
def test_answers_appear_in_the_prompt_before_the_question(task, variant, tokenizer, essay):
    sample = generate_one(task, tokenizer, 2048, 50, 11, essay, variant)
    body = sample.prompt.rsplit("\n", 1)[0]  # the question is the last line
    for answer in sample.answers:
        assert answer in body


def needle_position(sample) -> float:
    """Where the first answer sits, as a fraction of the prompt before the question line."""
    body = sample.prompt.rsplit("\n", 1)[0]
    return body.index(sample.answers[0]) / len(body)


@pytest.mark.parametrize("task,variant", [("passkey", None), ("niah_single", 2), ("variable_tracking", None)])
def test_depth_moves_the_needle_from_start_to_end(task, variant, tokenizer, essay):
    positions = [needle_position(generate_one(task, tokenizer, 2048, d, 5, essay, variant)) for d in DEPTHS]
    assert positions == sorted(positions)
    assert positions[0] < 0.15 and positions[-1] > 0.85


def test_mqar_first_query_sits_at_depth(tokenizer):
    for depth, low, high in [(0, 0.0, 0.1), (50, 0.4, 0.6), (100, 0.85, 1.0)]:
        sample = lc.mqar(tokenizer, 2048, depth, 9)
        lines = sample.prompt.split("\n")[1:-1]
        index = next(i for i, line in enumerate(lines) if line.endswith(f": {sample.answers[0]}"))
        assert low <= index / len(lines) <= high


def test_insert_keeps_the_order_of_needles_at_one_place():
    assert insert(["a", "b"], [(0.5, "x"), (0.5, "y"), (0.0, "z")]) == ["z", "a", "x", "y", "b"]


def test_variable_tracking_chain_is_in_order(tokenizer):
    sample = lc.variable_tracking(tokenizer, 2048, 30, 2)
    names = sample.answers
    spots = [sample.prompt.index(f"VAR {name} =") for name in names]
    assert spots == sorted(spots)
    assert f"VAR {names[1]} = VAR {names[0]}." in sample.prompt


def test_niah_multikey_has_distractors_and_one_answer(tokenizer, essay):
    sample = lc.niah_multikey(tokenizer, 2048, 50, 4, essay=essay)
    assert len(sample.answers) == 1
    assert sample.prompt.count("One of the special magic numbers for") == 4


def test_too_short_length_is_a_clear_error(tokenizer):
    with pytest.raises(ValueError, match="too short for a passkey prompt"):
        lc.passkey(tokenizer, 50, 0, 0)


def test_essay_variant_needs_essay(tokenizer):
    with pytest.raises(ValueError, match="needs essay sentences"):
        lc.niah_single(tokenizer, 1024, 0, 0, variant=2)


# --- scorers: an oracle that reads the needle out of the prompt scores 1, noise scores about 0.

def oracle(prompt: str) -> str:
    """Answer from the prompt text alone, the way a perfect retriever would."""
    question = prompt.rsplit("\n", 1)[-1]
    if question.startswith("What is the pass key?"):
        return re.search(r"The pass key is (\d+)\. Remember it", prompt)[1]
    if match := re.search(r"special magic (\w+) for ([\w-]+) mentioned", question):
        return ", ".join(re.findall(rf"special magic {match[1]} for {match[2]} is: ([\w-]+)\.", prompt))
    if match := re.search(r"assigned the value (\d+) in the text", question):
        names = [re.search(rf"VAR (\w+) = {match[1]}\.", prompt)[1]]
        while link := re.search(rf"VAR (\w+) = VAR {names[-1]}\.", prompt):
            names.append(link[1])
        return ", ".join(names)
    keys = re.search(r"What are the values of the keys (.*)\?", question)[1].replace(" and ", ", ").split(", ")
    return ", ".join(re.search(rf"^{key}: (\d+)$", prompt, re.MULTILINE)[1] for key in keys)


NOISE_RNG = random.Random(0)


def noise(prompt: str) -> str:
    return "".join(NOISE_RNG.choices("0123456789abcdefABCDEF- ", k=40))


@pytest.mark.parametrize("task", list(dict(CASES)))  # the six; RULER's and BABILong's: their own files
def test_oracle_scores_one_and_noise_scores_zero(task, tokenizer, essay):
    def run(answer_fn):
        result = lc.run_longcontext(
            task, lambda prompts, max_new: [answer_fn(p) for p in prompts], tokenizer,
            lengths=[1024, 2048], depths=[0, 50, 100], samples=2, seed=1, essay=essay,
        )
        return result

    perfect = run(oracle)
    assert perfect["score"] == 1.0
    assert all(cell["score"] == 1.0 for cell in perfect["grid"])
    assert run(noise)["score"] < 0.05


def test_score_is_recall_of_all_answers():
    assert lc.score("they are 123 and 456", ["123", "456"]) == 1.0
    assert lc.score("they are 123", ["123", "456"]) == 0.5
    assert lc.score("ABC", ["abc"]) == 1.0
    assert lc.score("", ["1"]) == 0.0


def test_run_records_every_cell_and_variant(tokenizer, essay):
    calls = []

    def fake_generate(prompts, max_new_tokens):
        calls.append((len(prompts), max_new_tokens))
        return ["" for _ in prompts]

    result = lc.run_longcontext("niah_single", fake_generate, tokenizer, lengths=[1024, 2048],
                                depths=[0, 100], samples=2, seed=0, essay=essay)
    assert [n for n, _ in calls] == [12, 12]  # one call per length: 3 variants x 2 depths x 2 samples
    assert all(m >= 8 for _, m in calls)
    assert len(result["samples"]) == 24
    assert {r["variant"] for r in result["samples"]} == {1, 2, 3}
    assert [(c["length"], c["depth"], c["n"]) for c in result["grid"]] == [
        (1024, 0, 6), (1024, 100, 6), (2048, 0, 6), (2048, 100, 6)]
    assert [v["variant"] for v in result["by_variant"]] == [1, 2, 3]
    seeds = [r["seed"] for r in result["samples"]]
    assert len(set(seeds)) == len(seeds)


def test_sample_seed_is_stable_and_distinct():
    assert lc.sample_seed(0, "passkey", 1024, 50, 0) == lc.sample_seed(0, "passkey", 1024, 50, 0)
    assert lc.sample_seed(0, "passkey", 1024, 50, 0) != lc.sample_seed(1, "passkey", 1024, 50, 0)


def test_a_sweep_reports_each_length_and_resumes_from_the_finished_ones(tokenizer, essay):
    generated = []

    def fake_generate(prompts, max_new_tokens):
        generated.append(len(prompts))
        return [str(len(p) % 7) for p in prompts]

    run = partial(lc.run_longcontext, "niah_single", fake_generate, tokenizer, lengths=[1024, 2048, 3072],
                  depths=[0, 100], samples=2, seed=0, essay=essay)
    partials = []
    whole = run(on_progress=partials.append)
    assert [p["lengths"] for p in partials] == [[1024], [1024, 2048]]  # none after the last: that is the result
    assert all(p["partial"] is True for p in partials)
    assert partials[0]["samples"] == whole["samples"][:12] and partials[1]["samples"] == whole["samples"][:24]
    assert partials[0] == (lc.summarize(whole["samples"][:12], [1024], [0, 100], (1, 2, 3))
                           | {"partial": True, "prompt_shape": "v1"})
    generated.clear()
    assert run(finished=partials[0]["samples"]) == whole
    assert generated == [12, 12]  # 2048 and 3072 only


def test_a_sweep_cut_inside_a_length_resumes_from_its_last_call(tokenizer, essay):
    calls = []

    def fake_generate(prompts, max_new_tokens):
        calls.append((tuple(prompts), max_new_tokens))
        return [str(len(p) % 7) for p in prompts]

    # 1024-token prompts (with their answers, under 2048 tokens) in calls of 5, longer ones in calls
    # of 4: 12 prompts a length.
    run = partial(lc.run_longcontext, "niah_single", fake_generate, tokenizer, lengths=[1024, 2048],
                  depths=[0, 100], samples=2, seed=0, essay=essay,
                  prompts_per_call=lambda tokens: asked.append(tokens) or (5 if tokens < 2048 else 4))
    asked, partials = [], []
    whole = run(on_progress=partials.append)
    assert [len(c[0]) for c in calls] == [5, 5, 2, 4, 4, 4]
    assert asked == [1024 + calls[0][1], 2048 + calls[3][1]]  # a row holds the prompt and its answer
    assert len({m for _, m in calls[:3]}) == 1  # every call of a length asks for the length's longest answer
    # After each call but the last: scores for the finished lengths, and every answer so far.
    assert [p["lengths"] for p in partials] == [[], [], [1024], [1024], [1024]]
    assert [len(p["samples"]) for p in partials] == [5, 10, 12, 16, 20]
    assert all(p["partial"] is True for p in partials)
    assert partials[1]["samples"] == whole["samples"][:10] and partials[4]["samples"] == whole["samples"][:20]
    assert "grid" not in partials[0] and partials[0]["by_length"] == []
    assert partials[3]["by_length"] == [whole["by_length"][0]]
    first_run = calls[:]
    for cut in partials:  # cut after any call: the rest are the uninterrupted run's calls, and so is the result
        calls.clear()
        saved = json.loads(json.dumps(cut))  # as read back from the results file
        assert run(finished=saved["samples"]) == whole
        assert calls == first_run[partials.index(cut) + 1 :]


@pytest.mark.parametrize("task", ["niah_single", "passkey", "variable_tracking"])
def test_prompts_built_on_threads_are_the_ones_built_in_turn(task, essay):
    tokenizer = make_byte_tokenizer()
    # A tokenizer that comes with truncation on resets it at its first call: threads must not race it.
    tokenizer._tokenizer.enable_truncation(max_length=100_000)
    variants = lc.TASKS[task].variants or (None,)
    cells = [{"depth": d, "seed": lc.sample_seed(0, task, 2048, d, i, v)} | ({"variant": v} if v else {})
             for v in variants for d in (0, 50, 100) for i in range(3)]
    threaded = lc.build_samples(task, tokenizer, 2048, cells, essay=essay, workers=4)
    assert threaded == lc.build_samples(task, make_byte_tokenizer(), 2048, cells, essay=essay)
    assert all(s.tokens <= 2048 for s in threaded) and len({s.prompt for s in threaded}) == len(cells)
