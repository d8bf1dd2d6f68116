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

RULER's 13 task names (`ruler.RULER_TASKS`, less qa_2) run the generators above where one is
RULER's task (niah_single_1 is niah_single's variant 1, vt is variable_tracking with RULER's solved
example first, ...) and those below and in ruler.py for the rest (niah_multikey_2/3: a haystack of
distractor needles, word keys or UUID keys; niah_multiquery: four keys asked at once; cwe, fwe,
qa_1), each with RULER's generation length. babilong.py has the BABILong tasks babilong_qa1..5.
A prediction scores the fraction of expected answers it contains (RULER's string_match_all), but
for qa_1 (any of the reference answers: RULER's string_match_part) and BABILong (its own rule).
passkey's and niah_single's layout and answer parsing are a named `prompt_shapes.PromptShape`
(default "v1", the layout above); RULER's niah_single_1..3 keep RULER's.
"""

from __future__ import annotations

import dataclasses
import os
import random
import string
import uuid
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from itertools import pairwise
from typing import NamedTuple

from tqdm.auto import tqdm

from linearize.eval import babilong, ruler
from linearize.eval.haystack import Sample, count_tokens, essay_units, fit, insert, noise_units
from linearize.eval.prompt_shapes import DEFAULT_SHAPE, SHAPED_TASKS, SHAPES, PromptShape, contains_score

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
# Landmark Attention's own wording (its passkey test's task description), for the "landmark" shapes.
LANDMARK_INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
    "I will quiz you about the important information there."
)
PASSKEY_QUESTION = "What is the pass key? The pass key is"
EXAMPLE_UNITS = 5  # filler sentences of a shape's solved example
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
VT_EXAMPLE_TOKENS = 470  # RULER's solved vt example: 500 tokens, less the 30 it may generate


def score(prediction: str, answers: Sequence[str]) -> float:
    """Fraction of the answers found in the prediction, case-insensitively (RULER string_match_all)."""
    return contains_score(prediction, answers)


def score_all(prediction: str, sample: Sample) -> float:
    """`score` of a sample's answers: the scorer of every task but qa_1 and BABILong's."""
    return score(prediction, sample.answers)


def make_sample(
    tokenizer, length: int, render: Callable[[int], str], answers: Callable[[int], Sequence[str]], task: str
) -> Sample:
    """Fit `render` (n haystack units -> prompt) to `length`; `answers(n)` are that prompt's answers.
    Room to generate: twice the answers' tokens, plus 8."""
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


def passkey(tokenizer, length: int, depth: float, seed: int, *, shape: PromptShape = SHAPES[DEFAULT_SHAPE]) -> Sample:
    rng = random.Random(seed)
    key = str(rng.randint(10000, 99999))
    example = passkey_example(shape, random.Random(f"{seed}:example"), key) if shape.example else ""

    def render(n: int) -> str:
        return example + passkey_prompt(shape, noise_units(n), depth, key)

    return make_sample(tokenizer, length, render, lambda n: [key], "passkey")


def passkey_prompt(shape: PromptShape, units: list[str], depth: float, key: str) -> str:
    """A passkey prompt of `units` filler with the needle for `key` at `depth` percent, in `shape`."""
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."
    if shape.landmark:
        before, after = split_at(units, depth / 100)
        return "\n".join([LANDMARK_INTRO, " ".join(before), needle, " ".join(after), PASSKEY_QUESTION])
    body = " ".join(insert(units, [(depth / 100, needle)]))
    return f"{PASSKEY_INTRO} {body}{shape.question_break}{PASSKEY_QUESTION}"


def passkey_example(shape: PromptShape, rng: random.Random, key: str) -> str:
    """A short solved passkey prompt in `shape`, whose key is not `key`, and a blank line."""
    solved = key
    while solved == key:
        solved = str(rng.randint(10000, 99999))
    return f"{passkey_prompt(shape, noise_units(EXAMPLE_UNITS), 50, solved)} {solved}.\n\n"


def split_at(units: list[str], depth: float) -> tuple[list[str], list[str]]:
    """The units before and after the place `insert` puts a needle at `depth` (a fraction)."""
    cut = round(depth * len(units))
    return units[:cut], units[cut:]


def seeded_uuid4(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def needle_units(rng: random.Random, kind: str, key: Callable[[], str], value: Callable[[], str],
                 queried: Sequence[str]) -> Callable[[int], list[str]]:
    """RULER's "needle" haystack: distractor needles for random keys (never a queried one), drawn
    from one seeded stream so that every prompt length shares its prefix of them."""
    lines: list[str] = []

    def units(n: int) -> list[str]:
        while len(lines) < n:
            if (k := key()) not in queried:
                lines.append(f"One of the special magic {kind} for {k} is: {value()}.")
        return lines[:n]

    return units


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
    queries: int = 1,
    needle_haystack: bool = False,
    uuid_keys: bool = False,
    shape: PromptShape | None = None,
) -> Sample:
    """RULER needle-in-a-haystack; `essay=None` uses the noise haystack, `needle_haystack` one of
    distractor needles (one a line). `queries` keys are asked at once (RULER's multiquery); the last
    needle sits at `depth`, the others at seeded random places. `shape` (one needle only: niah_single)
    lays the prompt out in a `PromptShape`; None is RULER's layout."""
    rng = random.Random(seed)
    units = noise_units if essay is None else essay_units(essay, rng)
    kind = "uuids" if uuids else "numbers"
    count = queries + distractor_keys
    keys = [seeded_uuid4(rng) for _ in range(count)] if uuid_keys else word_keys(rng, count)
    queried, others = keys[:queries], keys[queries:]

    def value() -> str:
        return seeded_uuid4(rng) if uuids else str(rng.randint(1_000_000, 9_999_999))

    found = [[value() for _ in range(values)] for _ in queried]  # each queried key's values
    answers = [v for vs in found for v in vs]
    needles = [(k, value()) for k in others] + [(k, v) for k, vs in zip(queried, found) for v in vs]
    places = [rng.random() for _ in range(len(needles) - 1)] + [depth / 100]
    texts = [f"One of the special magic {kind} for {k} is: {v}." for k, v in needles]
    key = ", ".join(queried[:-1]) + f", and {queried[-1]}" if queries > 1 else queried[0]
    intro, question = NIAH_INTRO.format(kind=kind), NIAH_QUESTION.format(kind=kind, key=key)
    separator = " "
    if needle_haystack:
        stream = random.Random(f"{seed}:haystack")
        units = needle_units(stream, kind, (lambda: seeded_uuid4(stream)) if uuid_keys else (lambda: word_keys(stream, 1)[0]),
                             (lambda: seeded_uuid4(stream)) if uuids else (lambda: str(stream.randint(1_000_000, 9_999_999))),
                             queried)
        separator = "\n"

    if shape is None:
        def render(n: int) -> str:
            return f"{intro}\n{separator.join(insert(units(n), list(zip(places, texts))))}\n{question}"
    else:
        if len(texts) != 1:
            raise ValueError(f"a prompt shape lays out one needle, and {task} has {len(texts)}.")
        example = niah_example(shape, random.Random(f"{seed}:example"), kind, uuids, keys[0]) if shape.example else ""

        def render(n: int) -> str:
            return example + niah_prompt(shape, intro, units(n), depth, texts[0], question)

    return make_sample(tokenizer, length, render, lambda n: answers, task)


def niah_prompt(shape: PromptShape, intro: str, units: list[str], depth: float, needle: str, question: str) -> str:
    """A one-needle niah prompt in `shape`: `needle` at `depth` percent among `units`."""
    if shape.landmark:
        before, after = split_at(units, depth / 100)
        return "\n".join([intro, " ".join(before), needle, " ".join(after), question])
    return f"{intro}\n{' '.join(insert(units, [(depth / 100, needle)]))}{shape.question_break}{question}"


def niah_example(shape: PromptShape, rng: random.Random, kind: str, uuids: bool, key: str) -> str:
    """A short solved niah_single prompt in `shape` (noise haystack, a word key other than `key`) and a blank line."""
    solved = key
    while solved == key:
        solved = word_keys(rng, 1)[0]
    value = seeded_uuid4(rng) if uuids else str(rng.randint(1_000_000, 9_999_999))
    needle = f"One of the special magic {kind} for {solved} is: {value}."
    intro, question = NIAH_INTRO.format(kind=kind), NIAH_QUESTION.format(kind=kind, key=solved)
    return f"{niah_prompt(shape, intro, noise_units(EXAMPLE_UNITS), 50, needle, question)} {value}.\n\n"


def niah_single(tokenizer, length: int, depth: float, seed: int, *, variant: int = 1, essay=None,
                shape: PromptShape = SHAPES[DEFAULT_SHAPE]) -> Sample:
    if variant not in (1, 2, 3):
        raise ValueError(f"niah_single variant must be 1, 2 or 3, got {variant}.")
    if variant > 1 and not essay:
        raise ValueError(f"niah_single variant {variant} needs essay sentences for its haystack.")
    haystack = None if variant == 1 else essay
    return niah(tokenizer, length, depth, seed, task=f"niah_single_{variant}", essay=haystack, uuids=variant == 3,
                shape=shape)


def niah_multikey(tokenizer, length: int, depth: float, seed: int, *, essay) -> Sample:
    return niah(tokenizer, length, depth, seed, task="niah_multikey", essay=essay, distractor_keys=3)


def niah_multivalue(tokenizer, length: int, depth: float, seed: int, *, essay) -> Sample:
    return niah(tokenizer, length, depth, seed, task="niah_multivalue", essay=essay, values=4)


def niah_multikey_2(tokenizer, length: int, depth: float, seed: int) -> Sample:
    """RULER niah_multikey_2: the needle for a word key in a haystack of distractor needles for other keys."""
    return niah(tokenizer, length, depth, seed, task="niah_multikey_2", essay=None, needle_haystack=True)


def niah_multikey_3(tokenizer, length: int, depth: float, seed: int) -> Sample:
    """RULER niah_multikey_3: a UUID for a UUID key in a haystack of distractor needles (UUIDs both)."""
    return niah(tokenizer, length, depth, seed, task="niah_multikey_3", essay=None, needle_haystack=True,
                uuids=True, uuid_keys=True)


def niah_multiquery(tokenizer, length: int, depth: float, seed: int, *, essay) -> Sample:
    """RULER niah_multiquery: four keys, one number each, all asked at once, in an essay."""
    return niah(tokenizer, length, depth, seed, task="niah_multiquery", essay=essay, queries=4)


def variable_tracking(tokenizer, length: int, depth: float, seed: int, *, example: bool = False) -> Sample:
    """`example`: RULER's vt, whose prompt starts with one solved example (its own chain, in about
    VT_EXAMPLE_TOKENS of noise)."""
    rng = random.Random(seed)
    names, value, chain = vt_chain(rng)
    places = [depth / 100] + later_depths(rng, depth / 100, VT_HOPS)
    question = VT_QUESTION.format(value=value, count=len(names))
    solved = f"{vt_example(tokenizer, random.Random(f'{seed}:example'))}\n\n" if example else ""

    def render(n: int) -> str:
        return f"{solved}{VT_INTRO}\n\n{' '.join(insert(noise_units(n), list(zip(places, chain))))}\n{question}"

    return make_sample(tokenizer, length, render, lambda n: names, "vt" if example else "variable_tracking")


def vt_chain(rng: random.Random) -> tuple[list[str], str, list[str]]:
    """The variable names of a VT_HOPS-hop chain, its value, and its assignments in order."""
    names = []
    while len(names) < VT_HOPS + 1:
        name = "".join(rng.choices(string.ascii_uppercase, k=5))
        if name not in names:
            names.append(name)
    value = str(rng.randint(10000, 99999))
    chain = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in pairwise(names)]
    return names, value, chain


def vt_example(tokenizer, rng: random.Random) -> str:
    """A variable-tracking prompt of at most VT_EXAMPLE_TOKENS tokens, followed by its answer."""
    names, value, chain = vt_chain(rng)
    places = sorted(rng.random() for _ in chain)
    question = VT_QUESTION.format(value=value, count=len(names))

    def render(n: int) -> str:
        return f"{VT_INTRO}\n\n{' '.join(insert(noise_units(n), list(zip(places, chain))))}\n{question}"

    return f"{fit(tokenizer, VT_EXAMPLE_TOKENS, render, 'vt example')[1]} {' '.join(names)}"


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


class Task(NamedTuple):
    """A long-context task: `generate(tokenizer, length, depth, seed, **options)` makes its samples."""

    generate: Callable[..., Sample]
    needs_essay: bool  # its generator takes the essay sentences (`essay=`)
    variants: tuple[int, ...] = ()  # run each, `variant=` (niah_single)
    options: tuple[tuple[str, object], ...] = ()  # more keyword arguments of `generate`
    max_new_tokens: int | None = None  # the generation length, instead of the generator's own
    score: Callable[[str, Sample], float] = score_all  # (prediction, sample) -> score in [0, 1]
    depth: bool = True  # whether `depth` places something; if not, it only seeds (one more group of samples)


NIAH_NEW, VT_NEW = ruler.MAX_NEW_TOKENS["niah"], ruler.MAX_NEW_TOKENS["vt"]
TASKS: dict[str, Task] = {
    "passkey": Task(passkey, False),
    "niah_single": Task(niah_single, True, (1, 2, 3)),
    "niah_multikey": Task(niah_multikey, True),
    "niah_multivalue": Task(niah_multivalue, True),
    "variable_tracking": Task(variable_tracking, False),
    "mqar": Task(mqar, False),
    # RULER's names (ruler.RULER_TASKS): a task above where it is RULER's, with RULER's generation length
    # (niah_multivalue is RULER's name too, and is the task above with the suite's generation length,
    # so its results compare with the suite's other rows).
    "niah_single_1": Task(niah_single, False, options=(("variant", 1),), max_new_tokens=NIAH_NEW),
    "niah_single_2": Task(niah_single, True, options=(("variant", 2),), max_new_tokens=NIAH_NEW),
    "niah_single_3": Task(niah_single, True, options=(("variant", 3),), max_new_tokens=NIAH_NEW),
    "niah_multikey_1": Task(niah_multikey, True, max_new_tokens=NIAH_NEW),
    "niah_multikey_2": Task(niah_multikey_2, False, max_new_tokens=NIAH_NEW),
    "niah_multikey_3": Task(niah_multikey_3, False, max_new_tokens=NIAH_NEW),
    "niah_multiquery": Task(niah_multiquery, True, max_new_tokens=NIAH_NEW),
    "vt": Task(variable_tracking, False, options=(("example", True),), max_new_tokens=VT_NEW),
    "cwe": Task(ruler.cwe, True, depth=False),
    "fwe": Task(ruler.fwe, False, depth=False),
    "qa_1": Task(ruler.qa_1, False, score=ruler.score_any),
    # BABILong: bAbI QA1-QA5 facts scattered through the essays.
    **{name: Task(partial(babilong.generate, number), True, score=partial(babilong.score, number), depth=False)
       for number, name in enumerate(babilong.BABILONG_TASKS, start=1)},
}


def sample_seed(seed: int, task: str, length: int, depth: float, index: int, variant: int | None = None) -> int:
    """A stable per-sample seed, so one cell's samples don't change when the sweep changes."""
    return zlib.crc32(f"{seed}:{task}:{variant}:{length}:{depth}:{index}".encode())


def build_sample(
    task: str, tokenizer, length: int, depth: float, seed: int, *, variant: int | None = None, essay: Sequence[str] = (),
    prompt_shape: str = DEFAULT_SHAPE,
) -> Sample:
    """One prompt of `task`; `variant` only for niah_single, `essay` only for essay haystacks, `prompt_shape`
    (a `prompt_shapes.SHAPES` name) only for the SHAPED_TASKS."""
    spec = TASKS[task]
    options = dict(spec.options) | ({"essay": essay} if spec.needs_essay else {})
    if task in SHAPED_TASKS:
        options["shape"] = SHAPES[prompt_shape]
    if variant is not None:
        options["variant"] = variant
    sample = spec.generate(tokenizer, length, depth, seed, **options)
    if spec.max_new_tokens is not None:
        sample = dataclasses.replace(sample, max_new_tokens=spec.max_new_tokens)
    return sample


def build_samples(task: str, tokenizer, length: int, cells: Sequence[dict], *, essay: Sequence[str] = (),
                  workers: int = 1, prompt_shape: str = DEFAULT_SHAPE) -> list[Sample]:
    """`build_sample` for each cell ({"depth", "seed"[, "variant"]}), in order, on `workers` threads.

    Fitting a long prompt takes a handful of tokenizer calls over the whole prompt (~0.4 s each at
    128K tokens), which a fast tokenizer runs outside the GIL, so threads build a length's prompts
    side by side. They share the tokenizer: one call first lets it settle its truncation and padding
    state (an HF fast tokenizer resets them on its first call), after which the threads only read it.
    """
    bar = tqdm(total=len(cells), desc=f"{task}@{length} prompts", leave=False)

    def build(cell: dict) -> Sample:
        sample = build_sample(task, tokenizer, length, cell["depth"], cell["seed"], variant=cell.get("variant"),
                              essay=essay, prompt_shape=prompt_shape)
        bar.update()
        return sample

    try:
        if workers <= 1 or len(cells) <= 1:
            return [build(cell) for cell in cells]
        count_tokens(tokenizer, "")
        with ThreadPoolExecutor(min(workers, len(cells))) as pool:
            return list(pool.map(build, cells))
    finally:
        bar.close()


def check_length(task: str, tokenizer, length: int, essay: Sequence[str] = (), prompt_shape: str = DEFAULT_SHAPE) -> None:
    """Raise ValueError now if `length` cannot hold the task's prompt (every variant)."""
    for variant in TASKS[task][2] or (None,):
        build_sample(task, tokenizer, length, 0, 0, variant=variant, essay=essay, prompt_shape=prompt_shape)


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
    on_progress: Callable[[dict], None] | None = None,
    prompts_per_call: Callable[[int], int] | None = None,
    prompt_shape: str = DEFAULT_SHAPE,
) -> dict:
    """Build the task's prompts for every (variant, length, depth, sample), generate, and score.

    `generate(prompts, max_new_tokens)` returns one continuation per prompt. It gets a length's
    prompts in calls of `prompts_per_call(length + max_new_tokens)` (default: all of them in one call,
    which a real model batches by size), in a fixed order, each call with the longest answer any of
    the length's prompts needs. `on_progress`, if given, gets the result so far after every call but
    the last (`result_so_far`): `summarize` over the lengths done, with "samples" holding every prompt
    answered so far (those of an unfinished length too), marked `"partial": True`. Pass such a
    result's "samples" back as `finished` (same settings) and the prompts they hold are kept, not
    generated again: the calls after them are the ones an uninterrupted sweep makes, and so is the
    result. A task whose `depth` places nothing (cwe, fwe, BABILong) is marked `"depth_free": True`.
    `prompt_shape` lays out and scores the prompts of the SHAPED_TASKS (recorded as the result's
    "prompt_shape"); the other tasks keep their own.
    """
    spec = TASKS[task]
    variants = spec.variants
    flags = {} if spec.depth else {"depth_free": True}  # the report labels its heatmap's rows accordingly
    scorer = spec.score
    if task in SHAPED_TASKS:
        flags["prompt_shape"] = prompt_shape
        scorer = partial(score_shaped, SHAPES[prompt_shape])
    kept = {cell_key(r): r for r in finished}
    records = []
    for index, length in enumerate(lengths):
        cells = [
            {"length": length, "depth": d, "seed": sample_seed(seed, task, length, d, i, v)}
            | ({"variant": v} if v is not None else {})
            for v in variants or (None,)
            for d in depths
            for i in range(samples)
        ]
        answered = {cell_key(c): kept[cell_key(c)] for c in cells if cell_key(c) in kept}
        if len(answered) < len(cells):
            built = build_samples(task, tokenizer, length, cells, essay=essay, workers=os.cpu_count() or 1,
                                  prompt_shape=prompt_shape)
            # The length's longest answer, whichever prompts a call gets: why a resumed length builds
            # its answered prompts again.
            max_new_tokens = max(s.max_new_tokens for s in built)
            todo = [(c, s) for c, s in zip(cells, built) if cell_key(c) not in answered]
            step = max(1, prompts_per_call(length + max_new_tokens)) if prompts_per_call else len(todo)
            for start in range(0, len(todo), step):
                part = todo[start : start + step]
                predictions = generate([s.prompt for _, s in part], max_new_tokens)
                for (cell, sample), prediction in zip(part, predictions):
                    answered[cell_key(cell)] = cell | {
                        "tokens": sample.tokens, "answers": list(sample.answers), "prediction": prediction,
                        "score": scorer(prediction, sample)}
                length_done = start + step >= len(todo)
                if on_progress is not None and not (length_done and index == len(lengths) - 1):
                    ongoing = [] if length_done else [r for c in cells if (r := answered.get(cell_key(c)))]
                    done = records + ([answered[cell_key(c)] for c in cells] if length_done else [])
                    on_progress(result_so_far(done, ongoing, lengths[: index + length_done], depths, variants) | flags)
        records += [answered[cell_key(c)] for c in cells]
    return summarize(records, lengths, depths, variants) | flags


def score_shaped(shape: PromptShape, prediction: str, sample: Sample) -> float:
    """A shaped task's score: its answers read by the shape's rule."""
    return shape.score(prediction, sample.answers)


def cell_key(cell: dict) -> tuple:
    """What names one prompt of a sweep: its length, depth, seed and variant."""
    return cell["length"], cell["depth"], cell["seed"], cell.get("variant")


def result_so_far(done: list[dict], ongoing: list[dict], lengths, depths, variants) -> dict:
    """A sweep's result so far: `summarize` over its finished lengths (none yet: no scores), with the
    answers of the length under way added to "samples", marked `"partial": True`. Copies: the
    caller's lists grow on while the result may be held."""
    # With no length finished: no score and no grid yet, but the per-length list a reader looks up.
    summary = (summarize(list(done), lengths, depths, variants) if lengths
               else {"lengths": [], "depths": list(depths), "by_length": []})
    return summary | {"samples": done + ongoing, "partial": True}


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def summarize(records: list[dict], lengths, depths, variants) -> dict:
    """Mean score overall, per length, per depth, per (length, depth) cell and per variant, plus every sample."""
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
        "by_depth": [
            {"depth": depth, "score": mean(r["score"] for r in at)}
            for depth in depths
            if (at := [r for r in records if r["depth"] == depth])
        ],
        "grid": grid,
    }
    if variants:
        summary["by_variant"] = [
            {"variant": v, "score": mean(r["score"] for r in records if r["variant"] == v)} for v in variants
        ]
    return summary | {"samples": records}
