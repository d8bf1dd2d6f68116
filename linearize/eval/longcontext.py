"""Synthetic long-context tasks: seeded generators, RULER-style scoring, and the sweep runner.

Every generator is a pure function of (tokenizer, length, depth, seed) (plus the essay sentences
for essay haystacks) returning a `Sample` whose prompt has at most `length` tokens of that tokenizer,
filled as close to it as whole haystack units allow. `depth` (percent) places the needle, or the
first needle of several; further needles go to seeded random places (after it, for a chain).

- passkey: a 5-digit key in repeated filler (Landmark Attention's test, used by Lizard).
- niah_single (RULER niah_single_1/2/3): one "special magic" value for a word key; variant 1 is a
  7-digit number in the noise haystack, 2 a 7-digit number in an essay, 3 a UUID in an essay.
- niah_multikey (RULER niah_multikey_1): the queried key plus three distractor keys, in an essay.
- niah_multivalue (RULER niah_multivalue): four values for the queried key, in an essay.
- variable_tracking (RULER vt): a 4-hop chain VAR A = 12345, VAR B = VAR A, ...; name them all.
- mqar: multi-query associative recall over a haystack made only of key: value lines; four keys
  are queried at once.
A prediction scores the fraction of expected answers it contains (RULER's string_match_all).
"""

from __future__ import annotations

import random
import string
import uuid
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise

from tqdm.auto import tqdm

from linearize.eval.haystack import essay_units, fit, insert, noise_units

DEFAULT_LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768)
DEFAULT_DEPTHS = (0, 25, 50, 75, 100)
DEFAULT_SAMPLES = 5  # per (length, depth) cell, and per variant

ADJECTIVES = (
    "amber", "ancient", "bitter", "brave", "bright", "calm", "clever", "cold", "crimson", "curious", "dark",
    "eager", "early", "fancy", "fierce", "gentle", "golden", "grand", "happy", "hidden", "hollow", "humble", "icy",
    "jolly", "kind", "lazy", "little", "lively", "loud", "lucky", "mighty", "misty", "noble", "odd", "pale",
    "polite", "proud", "quiet", "rapid", "rare", "rough", "round", "royal", "rusty", "silent", "silver", "sleepy",
    "smooth", "soft", "solid", "sour", "swift", "tall", "tender", "tiny", "velvet", "warm", "wild", "wise",
    "young",
)
NOUNS = (
    "anchor", "apple", "arrow", "badge", "basket", "beacon", "bell", "bridge", "candle", "canyon", "castle",
    "cedar", "cloud", "comet", "compass", "coral", "crown", "desert", "dragon", "eagle", "engine", "falcon",
    "feather", "forest", "fountain", "garden", "glacier", "harbor", "hammer", "island", "jewel", "kettle",
    "lantern", "lemon", "meadow", "mirror", "mountain", "needle", "ocean", "orchard", "otter", "palace", "pebble",
    "pepper", "planet", "pocket", "quarry", "rabbit", "river", "saddle", "shadow", "signal", "spark", "spider",
    "summit", "thunder", "tiger", "tower", "valley", "violin", "wagon", "whistle", "willow", "window",
)

PASSKEY_INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there."
)
NIAH_INTRO = (
    "Some special magic {kind} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {kind} afterwards."
)
NIAH_QUESTION = (
    "What are all the special magic {kind} for {key} mentioned in the provided text? "
    "The special magic {kind} for {key} mentioned in the provided text are"
)
VT_INTRO = "Memorize and track the chain(s) of variable assignment hidden in the following text."
VT_QUESTION = (
    "Question: Find all variables that are assigned the value {value} in the text above. "
    "Answer: According to the chain(s) of variable assignment in the text above, {count} variables "
    "are assigned the value {value}, they are:"
)
MQAR_INTRO = "Memorize the following key-value pairs. I will ask you for the values of some keys afterwards."
MQAR_QUESTION = "What are the values of the keys {keys}? The values of the keys {keys} are:"
MQAR_QUERIES = 4
VT_HOPS = 4


@dataclass(frozen=True)
class Sample:
    prompt: str
    answers: tuple[str, ...]
    tokens: int  # prompt length in tokens, special tokens included
    max_new_tokens: int


def score(prediction: str, answers: Sequence[str]) -> float:
    """Fraction of the answers found in the prediction, case-insensitively (RULER string_match_all)."""
    found = prediction.lower()
    return sum(answer.lower() in found for answer in answers) / len(answers)


def make_sample(
    tokenizer, length: int, render: Callable[[int], str], answers: Callable[[int], Sequence[str]], task: str
) -> Sample:
    """Fit `render` (n haystack units -> prompt) to `length`; `answers(n)` are that prompt's answers."""
    n, prompt, tokens = fit(tokenizer, length, render, task)
    answers = answers(n)
    answer_tokens = len(tokenizer(", ".join(answers), add_special_tokens=False).input_ids)
    return Sample(prompt, tuple(answers), tokens, max_new_tokens=2 * answer_tokens + 8)


def word_keys(rng: random.Random, count: int) -> list[str]:
    pairs = rng.sample(range(len(ADJECTIVES) * len(NOUNS)), count)
    return [f"{ADJECTIVES[p // len(NOUNS)]}-{NOUNS[p % len(NOUNS)]}" for p in pairs]


def later_depths(rng: random.Random, first: float, count: int) -> list[float]:
    """`count` sorted seeded depths at or after `first` (fractions)."""
    return sorted(rng.uniform(first, 1.0) for _ in range(count))


def passkey(tokenizer, length: int, depth: float, seed: int) -> Sample:
    rng = random.Random(seed)
    key = str(rng.randint(10000, 99999))
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."

    def render(n: int) -> str:
        body = " ".join(insert(noise_units(n), [(depth / 100, needle)]))
        return f"{PASSKEY_INTRO} {body}\nWhat is the pass key? The pass key is"

    return make_sample(tokenizer, length, render, lambda n: [key], "passkey")


def niah(
    tokenizer,
    length: int,
    depth: float,
    seed: int,
    *,
    task: str,
    essay: Sequence[str] | None,
    uuids: bool = False,
    distractor_keys: int = 0,
    values: int = 1,
) -> Sample:
    """RULER needle-in-a-haystack; `essay=None` uses the noise haystack."""
    rng = random.Random(seed)
    units = noise_units if essay is None else essay_units(essay, rng)
    kind = "uuids" if uuids else "numbers"
    key, *others = word_keys(rng, 1 + distractor_keys)

    def value() -> str:
        return str(uuid.UUID(int=rng.getrandbits(128), version=4)) if uuids else str(rng.randint(1_000_000, 9_999_999))

    answers = [value() for _ in range(values)]
    needles = [(k, value()) for k in others] + [(key, v) for v in answers]
    places = [rng.random() for _ in range(len(needles) - 1)] + [depth / 100]
    texts = [f"One of the special magic {kind} for {k} is: {v}." for k, v in needles]
    intro, question = NIAH_INTRO.format(kind=kind), NIAH_QUESTION.format(kind=kind, key=key)

    def render(n: int) -> str:
        return f"{intro}\n{' '.join(insert(units(n), list(zip(places, texts))))}\n{question}"

    return make_sample(tokenizer, length, render, lambda n: answers, task)


def niah_single(tokenizer, length: int, depth: float, seed: int, *, variant: int = 1, essay=None) -> Sample:
    if variant not in (1, 2, 3):
        raise ValueError(f"niah_single variant must be 1, 2 or 3, got {variant}.")
    if variant > 1 and not essay:
        raise ValueError(f"niah_single variant {variant} needs essay sentences for its haystack.")
    haystack = None if variant == 1 else essay
    return niah(tokenizer, length, depth, seed, task=f"niah_single_{variant}", essay=haystack, uuids=variant == 3)


def niah_multikey(tokenizer, length: int, depth: float, seed: int, *, essay) -> Sample:
    return niah(tokenizer, length, depth, seed, task="niah_multikey", essay=essay, distractor_keys=3)


def niah_multivalue(tokenizer, length: int, depth: float, seed: int, *, essay) -> Sample:
    return niah(tokenizer, length, depth, seed, task="niah_multivalue", essay=essay, values=4)


def variable_tracking(tokenizer, length: int, depth: float, seed: int) -> Sample:
    rng = random.Random(seed)
    names = []
    while len(names) < VT_HOPS + 1:
        name = "".join(rng.choices(string.ascii_uppercase, k=5))
        if name not in names:
            names.append(name)
    value = str(rng.randint(10000, 99999))
    chain = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in pairwise(names)]
    places = [depth / 100] + later_depths(rng, depth / 100, VT_HOPS)
    question = VT_QUESTION.format(value=value, count=len(names))

    def render(n: int) -> str:
        return f"{VT_INTRO}\n\n{' '.join(insert(noise_units(n), list(zip(places, chain))))}\n{question}"

    return make_sample(tokenizer, length, render, lambda n: names, "variable_tracking")


def mqar(tokenizer, length: int, depth: float, seed: int) -> Sample:
    """Key: value lines only; the queried pairs sit at `depth` (first) and seeded random places."""
    rng = random.Random(seed)
    pairs: list[tuple[str, str]] = []
    seen: set[str] = set()

    def grow(n: int) -> None:  # one seeded stream, so every prompt length shares its prefix of pairs
        while len(pairs) < n:
            key = "".join(rng.choices(string.ascii_lowercase, k=6))
            if key not in seen:
                seen.add(key)
                pairs.append((key, str(rng.randint(10000, 99999))))

    def queries(n: int) -> list[int]:
        first = round(depth / 100 * (n - 1))
        others = random.Random(seed + n).sample(range(n - 1), MQAR_QUERIES - 1)
        return [first] + [i + (i >= first) for i in others]  # skip over `first`

    def size(n: int) -> int:
        return max(n, MQAR_QUERIES)

    def render(n: int) -> str:
        grow(size(n))
        keys = [pairs[i][0] for i in queries(size(n))]
        listed = ", ".join(keys[:-1]) + f" and {keys[-1]}"
        lines = "\n".join(f"{k}: {v}" for k, v in pairs[: size(n)])
        return f"{MQAR_INTRO}\n{lines}\n{MQAR_QUESTION.format(keys=listed)}"

    return make_sample(tokenizer, length, render, lambda n: [pairs[i][1] for i in queries(size(n))], "mqar")


# task -> (generator, needs essay sentences, variants)
TASKS: dict[str, tuple[Callable[..., Sample], bool, tuple[int, ...]]] = {
    "passkey": (passkey, False, ()),
    "niah_single": (niah_single, True, (1, 2, 3)),
    "niah_multikey": (niah_multikey, True, ()),
    "niah_multivalue": (niah_multivalue, True, ()),
    "variable_tracking": (variable_tracking, False, ()),
    "mqar": (mqar, False, ()),
}


def sample_seed(seed: int, task: str, length: int, depth: float, index: int, variant: int | None = None) -> int:
    """A stable per-sample seed, so one cell's samples don't change when the sweep changes."""
    return zlib.crc32(f"{seed}:{task}:{variant}:{length}:{depth}:{index}".encode())


def build_sample(
    task: str, tokenizer, length: int, depth: float, seed: int, *, variant: int | None = None, essay: Sequence[str] = ()
) -> Sample:
    """One prompt of `task`; `variant` only for niah_single, `essay` only for essay haystacks."""
    generator, needs_essay, _ = TASKS[task]
    options = ({"essay": essay} if needs_essay else {}) | ({"variant": variant} if variant is not None else {})
    return generator(tokenizer, length, depth, seed, **options)


def check_length(task: str, tokenizer, length: int, essay: Sequence[str] = ()) -> None:
    """Raise ValueError now if `length` cannot hold the task's prompt (every variant)."""
    for variant in TASKS[task][2] or (None,):
        build_sample(task, tokenizer, length, 0, 0, variant=variant, essay=essay)


def run_longcontext(
    task: str,
    generate: Callable[[list[str], int], list[str]],
    tokenizer,
    *,
    lengths: Sequence[int] = DEFAULT_LENGTHS,
    depths: Sequence[float] = DEFAULT_DEPTHS,
    samples: int = DEFAULT_SAMPLES,
    seed: int = 0,
    essay: Sequence[str] = (),
    finished: Sequence[dict] = (),
    on_length: Callable[[dict], None] | None = None,
) -> dict:
    """Build the task's prompts for every (variant, length, depth, sample), generate, and score.

    `generate(prompts, max_new_tokens)` returns one continuation per prompt; it is called once per
    length, so a real model batches prompts of similar size. `on_length`, if given, gets the result
    so far after every length but the last: `summarize` over the lengths done, marked `"partial": True`.
    Pass such a result's "samples" back as `finished` (same settings) and the lengths they hold are
    kept, not generated again; the result is the one an uninterrupted sweep returns.
    """
    variants = TASKS[task][2]
    records = []
    for index, length in enumerate(lengths):
        if kept := [r for r in finished if r["length"] == length]:
            records += kept
            continue
        cells = [
            {"length": length, "depth": d, "seed": sample_seed(seed, task, length, d, i, v)}
            | ({"variant": v} if v is not None else {})
            for v in variants or (None,)
            for d in depths
            for i in range(samples)
        ]
        built = [
            build_sample(task, tokenizer, length, c["depth"], c["seed"], variant=c.get("variant"), essay=essay)
            for c in tqdm(cells, desc=f"{task}@{length} prompts", leave=False)
        ]
        predictions = generate([s.prompt for s in built], max(s.max_new_tokens for s in built))
        for cell, sample, prediction in zip(cells, built, predictions):
            answers = list(sample.answers)
            records.append(cell | {"tokens": sample.tokens, "answers": answers, "prediction": prediction,
                                   "score": score(prediction, answers)})
        if on_length is not None and index < len(lengths) - 1:
            # A copy: `records` grows on, and the caller may hold on to the partial result.
            on_length(summarize(list(records), lengths[: index + 1], depths, variants) | {"partial": True})
    return summarize(records, lengths, depths, variants)


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def summarize(records: list[dict], lengths, depths, variants) -> dict:
    """Mean score overall, per length, per (length, depth) cell and per variant, plus every sample."""
    grid = [
        {"length": length, "depth": depth, "score": mean(r["score"] for r in cell), "n": len(cell)}
        for length in lengths
        for depth in depths
        if (cell := [r for r in records if r["length"] == length and r["depth"] == depth])
    ]
    summary = {
        "score": mean(r["score"] for r in records),
        "lengths": list(lengths),
        "depths": list(depths),
        "by_length": [
            {"length": length, "score": mean(r["score"] for r in records if r["length"] == length)}
            for length in lengths
        ],
        "grid": grid,
    }
    if variants:
        summary["by_variant"] = [
            {"variant": v, "score": mean(r["score"] for r in records if r["variant"] == v)} for v in variants
        ]
    return summary | {"samples": records}
