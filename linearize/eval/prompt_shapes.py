"""Named, versioned prompt shapes of the retrieval tasks (passkey, niah_single) and their answer parsing.

A small base model's retrieval shows or hides with the prompt's shape: the SmolLM2 and Gemma-3 teachers
find a passkey they miss once the question follows the haystack after a space instead of a newline,
or in Landmark Attention's own prompt. A retention score means something only on a shape where the
teacher shows its retrieval, so the shape is a setting of its own (`EvalConfig.prompt_shape`,
`linearize eval --prompt-shape`), recorded with the results and part of what a resumed evaluation
must match. A shape's fields never change under its name: a new shape gets a new name.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

SHAPED_TASKS = ("passkey", "niah_single")  # the tasks whose prompts follow the shape; the rest keep theirs

UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", re.IGNORECASE)
NUMBER = re.compile(r"\d+")


@dataclass(frozen=True)
class PromptShape:
    """How a passkey or niah_single prompt is laid out, and how its answer is read.

    `question_break` goes between the haystack and the question. `landmark`: Landmark Attention's
    layout (Mohtashami & Jaggi 2023): the intro, the filler before the needle, the needle, the filler
    after it and the question on lines of their own, in Landmark's wording for passkey. `example`: a
    short solved prompt of the same task (its own key, a few filler sentences) comes first.
    `answer` "contains": the prediction holds the answer anywhere (RULER's string_match_all);
    "first": the first number in the prediction (the first UUID, for a UUID answer) is the answer,
    so a continuation that lists numbers until one fits gets no credit.
    """

    name: str
    question_break: str = "\n"
    landmark: bool = False
    example: bool = False
    answer: str = "contains"

    def score(self, prediction: str, answers: Sequence[str]) -> float:
        if self.answer == "first":
            return first_match_score(prediction, answers)
        return contains_score(prediction, answers)


def contains_score(prediction: str, answers: Sequence[str]) -> float:
    """Fraction of the answers found in the prediction, case-insensitively (RULER string_match_all)."""
    found = prediction.lower()
    return sum(answer.lower() in found for answer in answers) / len(answers)


def first_match_score(prediction: str, answers: Sequence[str]) -> float:
    """Fraction of the answers among the prediction's first len(answers) numbers (UUIDs for UUID answers)."""
    pattern = UUID if all(UUID.fullmatch(a) for a in answers) else NUMBER
    first = [m.lower() for m in pattern.findall(prediction)[: len(answers)]]
    return sum(answer.lower() in first for answer in answers) / len(answers)


SHAPES: dict[str, PromptShape] = {
    shape.name: shape
    for shape in (
        PromptShape("v1"),
        PromptShape("space", question_break=" "),
        PromptShape("landmark", landmark=True),
        PromptShape("example", example=True),
        PromptShape("space-first", question_break=" ", answer="first"),
        PromptShape("landmark-first", landmark=True, answer="first"),
    )
}
DEFAULT_SHAPE = "v1"


def parse_prompt_shape(name) -> str:
    """A known shape's name, or a ValueError listing them."""
    if name not in SHAPES:
        raise ValueError(f"prompt_shape must be one of {', '.join(SHAPES)}, got {name!r}")
    return name
