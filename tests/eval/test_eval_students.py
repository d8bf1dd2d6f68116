"""Linearized students go through the same eval code as their teacher."""

import pytest

from linearize import convert
from linearize.decode import fully_linearized
from linearize.eval import evaluate
from linearize.eval.generation import greedy_generate

# Small windows/chunks so that the short test prompts cross several of them.
METHODS = {
    "lizard": {"window": 8, "num_sinks": 2},
    "still": {"window": 8, "budget": 14, "chunk_size": 4, "max_chunks": 2},
    "lolcats": {"window": 8},
    "liger": {"window": 8},
}


@pytest.fixture(scope="module", params=list(METHODS))
def student(request, new_model):
    return convert(new_model(), request.param, **METHODS[request.param]).eval()


def test_left_padded_batch_generation_matches_one_by_one(student, tokenizer):
    prompts = ["The whale", "Call me Ishmael. Some years ago", "Sea", "The captain walked the deck at night and"]
    batched = greedy_generate(student, tokenizer, prompts, 10, batch=4)
    assert batched == [greedy_generate(student, tokenizer, [p], 10, batch=1)[0] for p in prompts]


def test_fixed_shape_steps_give_what_hf_generate_gives(student, tokenizer):
    """A student generates on its fixed-shape cache (left padding, per-row positions, early stop at
    the end token) exactly as HF's generate does on the same prompts."""
    assert fully_linearized(student)  # so greedy_generate's default is the fixed-shape path
    prompts = ["The whale", "Call me Ishmael. Some years ago", "Sea", "The captain walked the deck at night and"]
    static = greedy_generate(student, tokenizer, prompts, 10, batch=4)
    assert static == greedy_generate(student, tokenizer, prompts, 10, batch=4, static=False)
    assert len(set(static)) >= 3


def test_student_evaluates_and_records_its_method(student, tokenizer, ppl_text):
    results = evaluate(student, tokenizer, "ppl,passkey", lengths="512", depths="0,100", samples=1,
                       text=str(ppl_text), ppl_max_tokens=2048)
    assert results["tasks"]["ppl"]["by_length"][0]["ppl"] > 1.0
    assert len(results["tasks"]["passkey"]["samples"]) == 2
    assert results["provenance"]["method_config"] == student.config.linearize
    assert results["provenance"]["model_class"] == type(student).__name__
