"""Prompt shapes of passkey and niah_single: pinned renderings, answer parsing, and the shape carried
through a sweep, its results, a resumed evaluation, the config and the command line."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from linearize.eval import longcontext as lc
from linearize.eval.api import resumable_tasks, task_settings
from linearize.eval.config import EvalConfig, EvalSettingError
from linearize.eval.haystack import NOISE
from linearize.eval.prompt_shapes import DEFAULT_SHAPE, SHAPES, PromptShape, contains_score, first_match_score
from linearize.eval.report import markdown

# sha256 (first 16 hex digits) of the prompt for seed 3, depth 50, byte tokenizer; passkey at 700 tokens,
# niah_single (variant 1) at 1100. A shape's prompts never change under its name: a change here is a new
# shape, with a new name, not an edit of these.
PINNED = {
    ("passkey", "v1"): "9b3852728d9d09f3",
    ("passkey", "space"): "e6885f0e3e0b4c5e",
    ("passkey", "landmark"): "f939e72b94c7e642",
    ("passkey", "example"): "36eae094e988a632",
    ("passkey", "space-first"): "e6885f0e3e0b4c5e",
    ("passkey", "landmark-first"): "f939e72b94c7e642",
    ("niah_single", "v1"): "aaa3406133d3990b",
    ("niah_single", "space"): "51461fd29ed7d503",
    ("niah_single", "landmark"): "a054e1d802b7ee88",
    ("niah_single", "example"): "f04787e0910485bf",
    ("niah_single", "space-first"): "51461fd29ed7d503",
    ("niah_single", "landmark-first"): "a054e1d802b7ee88",
}
LENGTH = {"passkey": 700, "niah_single": 1100}
QUESTION = "What is the pass key? The pass key is"


def shaped(task, tokenizer, shape, depth=50, seed=3):
    variant = 1 if task == "niah_single" else None
    return lc.build_sample(task, tokenizer, LENGTH[task], depth, seed, variant=variant, prompt_shape=shape)


def test_every_shape_is_pinned():
    assert {shape for _, shape in PINNED} == set(SHAPES)


@pytest.mark.parametrize("task, shape", sorted(PINNED))
def test_shape_renders_its_pinned_prompt(task, shape, tokenizer):
    prompt = shaped(task, tokenizer, shape).prompt
    assert hashlib.sha256(prompt.encode()).hexdigest()[:16] == PINNED[task, shape]


def test_v1_passkey_is_the_intro_the_haystack_and_the_question_on_a_new_line(tokenizer):
    prompt = shaped("passkey", tokenizer, "v1", depth=0).prompt
    key = shaped("passkey", tokenizer, "v1", depth=0).answers[0]
    assert prompt.startswith(f"{lc.PASSKEY_INTRO} The pass key is {key}. Remember it. {key} is the pass key. "
                             "The grass is green.")
    assert prompt.endswith(f".\n{QUESTION}")
    assert prompt.count("\n") == 1


def test_space_shape_differs_from_v1_only_in_the_break_before_the_question(tokenizer):
    v1, space = shaped("passkey", tokenizer, "v1").prompt, shaped("passkey", tokenizer, "space").prompt
    assert "\n" not in space
    assert space == v1.replace(f"\n{QUESTION}", f" {QUESTION}")
    n1, ns = shaped("niah_single", tokenizer, "v1").prompt, shaped("niah_single", tokenizer, "space").prompt
    assert ns.count("\n") == 1 and n1.count("\n") == 2 and ns.replace(" What are all", "\nWhat are all") == n1


@pytest.mark.parametrize("depth", [0, 50, 100])
def test_landmark_passkey_is_landmarks_five_lines(depth, tokenizer):
    sample = shaped("passkey", tokenizer, "landmark", depth=depth)
    key = sample.answers[0]
    intro, before, needle, after, question = sample.prompt.split("\n")
    assert intro == ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
                     "I will quiz you about the important information there.")
    assert needle == f"The pass key is {key}. Remember it. {key} is the pass key."
    assert question == QUESTION
    assert (before == "") == (depth == 0) and (after == "") == (depth == 100)
    filler = [s for part in (before, after) for s in part.split(". ") if s]
    assert filler and all(s.rstrip(".") + "." in NOISE for s in filler)


@pytest.mark.parametrize("task", ["passkey", "niah_single"])
def test_example_shape_solves_another_key_first(task, tokenizer):
    sample = shaped(task, tokenizer, "example")
    example, _, prompt = sample.prompt.partition("\n\n")
    assert sample.answers[0] not in example
    solved = example.rsplit(" ", 1)[1].rstrip(".")
    assert solved.isdigit() and solved in example.rsplit(" ", 1)[0]  # the example's answer is in its haystack
    assert prompt.endswith(QUESTION if task == "passkey" else "mentioned in the provided text are")
    assert sample.answers[0] in prompt


@pytest.mark.parametrize("task", ["passkey", "niah_single"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_every_shape_keeps_the_needle_and_fills_the_length(task, shape, tokenizer):
    samples = [shaped(task, tokenizer, shape, seed=s) for s in (1, 2)]
    for sample in samples:
        assert sample.answers[0] in sample.prompt
        assert LENGTH[task] - 100 < sample.tokens <= LENGTH[task]
    assert samples[0].answers != samples[1].answers


def test_default_shape_is_v1_a_newline_before_the_question_and_the_answer_anywhere():
    assert DEFAULT_SHAPE == "v1"
    assert SHAPES["v1"] == PromptShape("v1", question_break="\n", landmark=False, example=False, answer="contains")


def test_default_depths_include_the_first_and_last_token():
    assert 0 in lc.DEFAULT_DEPTHS and 100 in lc.DEFAULT_DEPTHS


def test_first_match_reads_only_the_first_number():
    assert first_match_score("71432. Remember it.", ["71432"]) == 1
    assert first_match_score(" 12345, or 71432", ["71432"]) == 0
    assert contains_score(" 12345, or 71432", ["71432"]) == 1
    assert first_match_score(" the key that you need", ["71432"]) == 0
    assert first_match_score(" 714320", ["71432"]) == 0  # a longer number is not the key
    uuid = "0f8fad5b-d9cb-469f-a165-70867728950e"
    assert first_match_score(f" {uuid.upper()} and 7", [uuid]) == 1
    assert first_match_score(" 1234567 and 7654321.", ["7654321", "1234567"]) == 1


def test_a_sweep_records_its_shape_and_scores_by_its_rule(tokenizer):
    def hedging(prompts, max_new):  # a wrong number first, then the key
        return [" 11111 or " + p.split("The pass key is ")[1].split(".")[0] for p in prompts]

    results = {shape: lc.run_longcontext("passkey", hedging, tokenizer, lengths=[1024], depths=[0, 100], samples=2,
                                         prompt_shape=shape) for shape in ("space", "space-first")}
    assert results["space"]["score"] == 1 and results["space-first"]["score"] == 0
    assert results["space-first"]["prompt_shape"] == "space-first"
    assert [b["depth"] for b in results["space"]["by_depth"]] == [0, 100]
    other = lc.run_longcontext("mqar", lambda p, n: ["" for _ in p], tokenizer, lengths=[1024], depths=[0], samples=1,
                               prompt_shape="space")
    assert "prompt_shape" not in other  # tasks outside SHAPED_TASKS keep their own prompts


def test_a_resumed_evaluation_keeps_shaped_tasks_only_under_the_same_shape():
    base = {"model": "m", "method_config": None, "depths": [0], "samples_per_cell": 1, "seed": 0, "limit": None,
            "lengths": [1024], "tasks": ["passkey", "mqar"]}
    done = {"partial": False}
    previous = {"provenance": base | {"prompt_shape": "v1"}, "tasks": {"passkey": done, "mqar": done}}
    kept, _ = resumable_tasks(previous, base | {"prompt_shape": "landmark"})
    assert set(kept) == {"mqar"}
    kept, _ = resumable_tasks(previous, base | {"prompt_shape": "v1"})
    assert set(kept) == {"passkey", "mqar"}
    # Results written before shapes were recorded are of v1's prompts.
    assert task_settings(base, "passkey")["prompt_shape"] == "v1"
    assert "prompt_shape" not in task_settings(base, "mqar")


def test_config_checks_the_shape():
    assert EvalConfig("passkey", prompt_shape="landmark").prompt_shape == "landmark"
    assert EvalConfig("passkey").prompt_shape == DEFAULT_SHAPE
    with pytest.raises(EvalSettingError, match="prompt_shape must be one of v1, space") as error:
        EvalConfig("passkey", prompt_shape="newline")
    assert error.value.setting == "prompt_shape"


def test_command_line_names_the_shape():
    import argparse

    from linearize.eval.command import eval_config_from_args, register

    parser = register(argparse.ArgumentParser().add_subparsers())
    args = parser.parse_args(["--model", "m", "--tasks", "passkey", "--out", "o.json", "--prompt-shape", "space"])
    assert eval_config_from_args(args).prompt_shape == "space"
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(["--model", "m", "--tasks", "passkey", "--out", "o.json", "--prompt-shape", "nope"])
    assert exit_.value.code == 2


def test_report_has_a_depth_table_and_the_shape(tokenizer):
    result = lc.run_longcontext("passkey", lambda p, n: [" 0"] * len(p), tokenizer, lengths=[1024, 2048],
                                depths=[0, 50, 100], samples=1)
    results = {"provenance": {"model": "m", "model_class": "c", "device": "cpu", "dtype": "float32", "batch": 1,
                              "seed": 0, "limit": None, "versions": {}, "lengths": [1024, 2048],
                              "depths": [0, 50, 100], "prompt_shape": "v1"},
               "tasks": {"passkey": result}}
    text = markdown(results, {"passkey": Path("x.passkey.png")})
    assert "### passkey by depth" in text
    assert "| depth | 1K | 2K | mean |" in text
    assert "| 100% | 0.000 | 0.000 | 0.000 |" in text
    assert "- prompt shape of passkey and niah_single: v1" in text
