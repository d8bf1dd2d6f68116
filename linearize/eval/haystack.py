"""Haystacks for the synthetic long-context tasks, fitting a prompt to a length in tokens, and the
`Sample` a generator returns.

A prompt is rendered from a number n of haystack units (sentences, key-value lines, words or
documents) with the needles inserted among them; `fit` finds the largest n whose prompt has at most
`length` tokens.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# RULER's "noise" haystack, also the filler of the passkey task (Landmark Attention, Lizard).
NOISE = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")


@dataclass(frozen=True)
class Sample:
    prompt: str
    answers: tuple[str, ...]
    tokens: int  # prompt length in tokens, special tokens included
    max_new_tokens: int


def fit_sample(tokenizer, length: int, render: Callable[[int], str], answers: Callable[[int], Sequence[str]],
               task: str, max_new_tokens: int, most: int | None = None) -> Sample:
    """The `Sample` of `render` fitted to `length` (see `fit`); `answers(n)` are that prompt's answers."""
    n, prompt, tokens = fit(tokenizer, length, render, task, most=most)
    return Sample(prompt, tuple(answers(n)), tokens, max_new_tokens)


def count_tokens(tokenizer, text: str) -> int:
    """Prompt length as the model sees it (special tokens such as BOS included)."""
    return len(tokenizer(text, add_special_tokens=True, verbose=False).input_ids)


def noise_units(n: int) -> list[str]:
    return [NOISE[i % len(NOISE)] for i in range(n)]


def essay_units(sentences: Sequence[str], rng: random.Random) -> Callable[[int], list[str]]:
    """Consecutive essay sentences from a seeded starting point, wrapping around the corpus."""
    start = rng.randrange(len(sentences))
    return lambda n: [sentences[(start + i) % len(sentences)] for i in range(n)]


def insert(units: list[str], needles: Sequence[tuple[float, str]]) -> list[str]:
    """Insert (depth in [0, 1], text) needles between units; depth 0 = first, 1 = last.

    Needles at the same place keep their given order (a variable-tracking chain relies on it).
    """
    out = list(units)
    # Insert from the back so earlier positions stay valid.
    for _, (depth, text) in sorted(enumerate(needles), key=lambda item: (item[1][0], item[0]), reverse=True):
        out.insert(round(depth * len(units)), text)
    return out


def fit(tokenizer, length: int, render: Callable[[int], str], task: str,
        most: int | None = None) -> tuple[int, str, int]:
    """The most units n whose prompt has at most `length` tokens: (n, prompt, token count).

    `most`, where the haystack runs out (a finite pool of documents or words), caps n: a prompt of
    all of them that still falls short of `length` is the answer.

    Token counts grow almost linearly in n, so each step jumps to the n that the tokens per unit
    measured so far predict (a 32K-token prompt takes a handful of tokenizer calls, not a
    bisection's fifteen), falling back to halving the bracket when a jump would leave it.
    """
    empty = count_tokens(tokenizer, render(0))
    if empty > length:
        raise ValueError(f"Length {length} is too short for a {task} prompt, which needs {empty} tokens.")
    top = math.inf if most is None else most
    lo, lo_tokens, hi = 0, empty, None  # render(lo) fits; render(hi) is too long
    n = min(64, top)
    while lo < top and (hi is None or hi - lo > 1):
        tokens = count_tokens(tokenizer, render(n))
        if tokens <= length:
            lo, lo_tokens = n, tokens
        else:
            hi = n
        step = (length - tokens) / max((tokens - empty) / n, 1e-3)
        guess = n + (math.floor(step) if tokens > length else max(1, math.floor(step)))
        upper = min(hi if hi is not None else max(2 * n, guess + 1), top + 1)
        n = guess if lo < guess < upper else max((lo + upper) // 2, lo + 1)
    prompt = render(lo)
    return lo, prompt, lo_tokens
