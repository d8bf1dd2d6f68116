"""Haystacks for the synthetic long-context tasks, and fitting a prompt to a length in tokens.

A prompt is rendered from a number n of haystack units (sentences or key-value lines) with the
needles inserted among them; `fit` finds the largest n whose prompt has at most `length` tokens.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

# RULER's "noise" haystack, also the filler of the passkey task (Landmark Attention, Lizard).
NOISE = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")


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


def fit(tokenizer, length: int, render: Callable[[int], str], task: str) -> tuple[int, str, int]:
    """The most units n whose prompt has at most `length` tokens: (n, prompt, token count).

    Token counts grow almost linearly in n, so each step jumps to the n that the tokens per unit
    measured so far predict (a 32K-token prompt takes a handful of tokenizer calls, not a
    bisection's fifteen), falling back to halving the bracket when a jump would leave it.
    """
    empty = count_tokens(tokenizer, render(0))
    if empty > length:
        raise ValueError(f"Length {length} is too short for a {task} prompt, which needs {empty} tokens.")
    lo, lo_tokens, hi = 0, empty, None  # render(lo) fits; render(hi) is too long
    n = 64
    while hi is None or hi - lo > 1:
        tokens = count_tokens(tokenizer, render(n))
        if tokens <= length:
            lo, lo_tokens = n, tokens
        else:
            hi = n
        step = (length - tokens) / max((tokens - empty) / n, 1e-3)
        guess = n + (math.floor(step) if tokens > length else max(1, math.floor(step)))
        upper = hi if hi is not None else max(2 * n, guess + 1)
        n = guess if lo < guess < upper else max((lo + upper) // 2, lo + 1)
    prompt = render(lo)
    return lo, prompt, lo_tokens
