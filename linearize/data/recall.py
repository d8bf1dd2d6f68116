"""Seeded synthetic recall documents, mixed into the training blocks at a share of their tokens.

A constant-memory student keeps a fact that has left its softmax window only if training ever asked it to:
ordinary text rarely makes the next token depend on one exact token string thousands of tokens back. These
documents do, in three families:

- key-value lists: many "key -> value" lines in one phrasing, then several look-ups;
- needles in filler: one (a passkey) to eight facts ("the locker code of Vaneko Dulmar is 4817") at spread
  depths in synthetic filler sentences, then questions about several of them in shuffled order;
- needles in real text: the same, with the filler a window of the run's own training tokens (its data spec's
  text, the long texts of the default mix included).

Every question is followed at once by its answer, so stage 2's next-token loss is a retrieval loss on the answer
tokens, and in stage 1 the teacher's attention from the question to the needle is what the student must copy.

The templates, key and value formats and random streams are this module's own, apart from the evaluation's
(`linearize.eval.longcontext`, `ruler`, `babilong`, `haystack`): the evaluation draws from Python's
`random.Random` seeded with small integers or 32-bit CRCs; these draw from numpy's PCG64 seeded with
`SeedSequence([RECALL_SALT, seed, block])`, a salt outside the 32-bit range, so no stream is shared; and no
phrase of an evaluation prompt is used (tests/data/test_data_recall.py checks both).

Block `i` of a mix is a pure function of (tokenizer, seq_len, seed, i, the training blocks): it is generated
when it is read, so a resumed loader reads the same batches, and nothing is cached on disk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Dataset

from linearize.data.packing import TokenBlocks
from linearize.data.tokenize import text_prefix

RECALL_SALT = 0x5245_4341_4C4C_3636  # "RECALL66": above 2**32, so it is no evaluation seed
MIN_DOCUMENT_TOKENS = 48  # a shorter gap at the end of a block is filled with filler
FAMILIES = ("key_value", "needles_filler", "needles_real_text")
FAMILY_WEIGHTS = (0.3, 0.35, 0.35)
MAX_NEEDLES = 8
MAX_KEY_VALUE_QUERIES = 8


@dataclass(frozen=True)
class Phrasing:
    """How a fact is stated and asked: `question` is followed by " " + the value."""

    statement: str
    question: str


KEY_VALUE_PHRASINGS = (
    Phrasing("The value of key {key} is {value}.", "The value of key {key} is"),
    Phrasing("Key {key} holds {value}.", "Looking up key {key} gives"),
    Phrasing("Entry {key} reads {value}.", "Q: what does entry {key} read?\nA:"),
    Phrasing("{key} -> {value}", "lookup {key} ->"),
)
FACT_PHRASINGS = (
    Phrasing("Note that the {thing} of {owner} is {value}.", "The {thing} of {owner} is"),
    Phrasing("{owner} wrote down {value} as the {thing}.", "Asked for the {thing}, {owner} would answer"),
    Phrasing("Keep in mind: {owner}'s {thing} is {value}.", "Q: what is {owner}'s {thing}?\nA:"),
    Phrasing("A small card reads: {thing} for {owner}, {value}.", "The card gave the {thing} for {owner} as"),
)
SINGLE_PHRASINGS = (  # one needle, no owner: the passkey shape
    Phrasing("Write this down, the {thing} is {value}. Repeat: {value}.", "The {thing} written down earlier is"),
    Phrasing("Somewhere in here: the {thing} is {value}.", "Q: which {thing} appeared above?\nA:"),
    Phrasing("Attention, the {thing} for today is {value}.", "For today, the {thing} is"),
)
THINGS = {  # what a needle names -> the form of its value
    "locker code": "digits4", "door code": "digits", "account number": "digits_long", "ticket number": "digits",
    "badge number": "digits_short", "password": "word", "code word": "word", "call sign": "code",
    "serial number": "code", "room number": "digits_short", "access code": "digits", "secret number": "digits",
}
CONSONANTS = "bdfghklmnprstvz"
VOWELS = "aeiou"
CODE_LETTERS = "ACDEFHJKLMNPRTVWXY"

FILLER_SUBJECTS = (
    "The old ferry", "A tired courier", "The village council", "Our neighbour", "The night train", "A flock of gulls",
    "The baker", "The river pilot", "A young clerk", "The orchestra", "The lighthouse keeper", "A travelling tailor",
    "The postmistress", "Two fishermen", "The schoolteacher", "A quiet student", "The weaver", "The ship's cook",
)
FILLER_VERBS = (
    "crossed", "painted", "repaired", "visited", "counted", "described", "measured", "followed", "opened", "swept",
    "mended", "watched", "sketched", "climbed", "inspected", "carried",
)
FILLER_OBJECTS = (
    "the narrow bridge", "a wooden fence", "the harbour wall", "the empty market", "an old map", "the stone well",
    "the long corridor", "a basket of pears", "the broken clock", "the chapel roof", "a pile of letters",
    "the mill pond", "the eastern road", "a crate of nails", "the tall hedge", "the ferry ramp",
)
FILLER_TAILS = (
    "before noon", "in the rain", "without a word", "for the third time", "at dusk", "as usual", "with great care",
    "after the storm", "on a slow morning", "once the bells rang", "while the kettle boiled", "near the square",
)


@dataclass(frozen=True)
class Query:
    """One question of a document and where its pieces sit in the document's token ids."""

    value: str
    needle: tuple[int, int]  # [start, end) of the statement that holds the value
    question: tuple[int, int]  # [start, end) of the question
    answer: tuple[int, int]  # [start, end) of " " + value, right after the question


@dataclass(frozen=True)
class RecallDocument:
    family: str
    ids: list[int]  # without the EOS that follows it in a block
    queries: list[Query]


def recall_rng(seed: int, index: int) -> np.random.Generator:
    """The random stream of recall block `index` of a run seeded `seed`."""
    return np.random.default_rng(np.random.SeedSequence([RECALL_SALT, int(seed), int(index)]))


class RealText:
    """Windows of a run's own training tokens, document boundaries (EOS) turned into a separator token."""

    def __init__(self, blocks: np.ndarray, indices: np.ndarray, skip: int, eos: int, separator: int):
        self.blocks, self.indices, self.skip, self.eos, self.separator = blocks, indices, skip, eos, separator

    @property
    def longest(self) -> int:
        return self.blocks.shape[1] - self.skip

    def window(self, rng: np.random.Generator, length: int) -> list[int]:
        row = self.blocks[int(self.indices[rng.integers(len(self.indices))]), self.skip:]
        start = int(rng.integers(0, len(row) - length + 1))
        window = np.asarray(row[start : start + length], dtype=np.int64)
        return np.where(window == self.eos, self.separator, window).tolist()


class RecallGenerator:
    """Recall documents and blocks of `seq_len` tokens for one tokenizer and seed."""

    def __init__(self, tokenizer, seq_len: int, seed: int, real_text: RealText | None = None):
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.seed = seed
        self.real_text = real_text
        self.prefix = text_prefix(tokenizer)
        self.eos = tokenizer.eos_token_id
        if self.eos is None:
            raise ValueError("The tokenizer has no EOS token, which recall documents end with.")
        self.body = seq_len - len(self.prefix)

    # Tokenizing ------------------------------------------------------------------------------------------------

    def encode(self, texts: list[str]) -> list[list[int]]:
        if not texts:
            return []
        return self.tokenizer(texts, add_special_tokens=False, split_special_tokens=True,
                              return_attention_mask=False, verbose=False)["input_ids"]

    # Blocks ----------------------------------------------------------------------------------------------------

    def block(self, index: int) -> np.ndarray:
        """Recall block `index`: the tokenizer's prefix, then whole documents each followed by EOS, the gap at the
        end (shorter than a document) filled with filler sentences."""
        rng = recall_rng(self.seed, index)
        ids = list(self.prefix)
        misses = 0  # documents that did not fit a short length drawn: the gap is filler after a few
        while (room := self.seq_len - len(ids)) > MIN_DOCUMENT_TOKENS and misses < 4:
            # Half the documents span the rest of the block, so documents reach the training length.
            target = room - 1 if rng.random() < 0.5 else int(math.exp(rng.uniform(math.log(MIN_DOCUMENT_TOKENS),
                                                                                math.log(room - 1))))
            document = self.document(rng, target)
            if document.ids:
                ids += document.ids + [self.eos]
            else:
                misses += 1
        ids += self.filler_tokens(rng, self.seq_len - len(ids))
        return np.asarray(ids, dtype=np.int64)

    def document(self, rng: np.random.Generator, target: int, family: str | None = None) -> RecallDocument:
        """A document of at most `target` tokens; empty if none fits."""
        family = family or FAMILIES[int(rng.choice(len(FAMILIES), p=FAMILY_WEIGHTS))]
        if family == "key_value":
            return self.key_value_document(rng, target)
        real = family == "needles_real_text" and self.real_text is not None
        return self.needle_document(rng, target, real_text=real)

    # Families --------------------------------------------------------------------------------------------------

    def key_value_document(self, rng: np.random.Generator, target: int) -> RecallDocument:
        phrasing = KEY_VALUE_PHRASINGS[int(rng.integers(len(KEY_VALUE_PHRASINGS)))]
        value_kind = ("digits", "word", "code")[int(rng.integers(3))]
        num_queries = int(rng.integers(3, MAX_KEY_VALUE_QUERIES + 1))
        # Tokens a line takes, measured on a few, bound how many candidate lines to draw.
        probe = self.encode([phrasing.statement.format(key=key_name(rng), value=make_value(rng, value_kind))
                             for _ in range(8)])
        per_line = max(1, min(len(p) for p in probe))
        keys = distinct(rng, lambda: key_name(rng), target // per_line + num_queries + 1)
        values = [make_value(rng, value_kind) for _ in keys]
        lines = self.encode([("" if i == 0 else "\n") + phrasing.statement.format(key=k, value=v)
                             for i, (k, v) in enumerate(zip(keys, values))])
        questions = self.encode(["\n" + phrasing.question.format(key=k) for k in keys])
        answers = self.encode([" " + v for v in values])
        worst = max(len(q) + len(a) for q, a in zip(questions, answers))
        # Questions take at most about a quarter of a short document, so that it still holds a list.
        num_queries = max(1, min(num_queries, target // (4 * worst)))
        reserve = num_queries * worst
        count = 0
        used = 0
        while count < len(lines) and used + len(lines[count]) + reserve <= target:
            used += len(lines[count])
            count += 1
        if count == 0:
            return RecallDocument("key_value", [], [])
        asked = rng.choice(count, size=min(num_queries, count), replace=False).tolist()
        ids, starts = [], []
        for line in lines[:count]:
            starts.append(len(ids))
            ids += line
        queries = [self._ask(ids, values[i], (starts[i], starts[i] + len(lines[i])), questions[i], answers[i])
                   for i in asked]
        return RecallDocument("key_value", ids, queries)

    def needle_document(self, rng: np.random.Generator, target: int, *, real_text: bool) -> RecallDocument:
        family = "needles_real_text" if real_text else "needles_filler"
        single = rng.random() < 0.35
        count = 1 if single else int(rng.integers(2, MAX_NEEDLES + 1))
        facts = self._facts(rng, count, single)
        statements = self.encode([" " + text for text, _, _ in facts])
        questions = self.encode(["\n" + question for _, question, _ in facts])
        answers = self.encode([" " + value for _, _, value in facts])
        # Which needles are asked, in which order: a lone needle twice (the second time across the first
        # answer), else two or more of them, shuffled.
        asked = [0, 0] if single else rng.permutation(count)[: int(rng.integers(2, count + 1))].tolist()
        # Drop needles (and their questions) from the end until they take at most half the document: the rest is
        # filler, the distance to retrieve across.
        while facts:
            cost = sum(map(len, statements)) + sum(len(questions[i]) + len(answers[i]) for i in asked)
            if cost <= target // 2:
                break
            if len(facts) == 1 and len(asked) > 1:
                asked = [0]
                continue
            facts, statements = facts[:-1], statements[:-1]
            kept = [i for i in asked if i < len(facts)]
            asked = [0, 0] if len(facts) == 1 else kept if len(kept) >= 2 else [0, 1]
        if not facts:
            return RecallDocument(family, [], [])
        filler = self.filler(rng, target - cost, real_text=real_text)
        filler_ids = [t for piece in filler for t in piece]
        # Needles at spread depths: the i-th in the i-th of `count` equal slices of the filler, between its
        # pieces (synthetic sentences, or single tokens of real text).
        cuts = piece_boundaries(filler)
        order = rng.permutation(len(facts)).tolist()  # which fact sits in which slice
        places = []
        for slot in range(len(facts)):
            low, high = slot / len(facts), (slot + 1) / len(facts)
            places.append(cuts[min(len(cuts) - 1, int(rng.uniform(low, high) * len(cuts)))])
        ids, spans, taken = [], {}, 0
        for slot, place in enumerate(places):
            ids += filler_ids[taken:place]
            taken = place
            fact = order[slot]
            spans[fact] = (len(ids), len(ids) + len(statements[fact]))
            ids += statements[fact]
        ids += filler_ids[taken:]
        queries = [self._ask(ids, facts[i][2], spans[i], questions[i], answers[i]) for i in asked]
        return RecallDocument(family, ids, queries)

    @staticmethod
    def _ask(ids: list[int], value: str, needle: tuple[int, int], question: list[int], answer: list[int]) -> Query:
        """Append a question and its answer to `ids`; where they went."""
        start = len(ids)
        ids += question
        ids += answer
        return Query(value, needle, (start, start + len(question)), (start + len(question), len(ids)))

    def _facts(self, rng: np.random.Generator, count: int, single: bool) -> list[tuple[str, str, str]]:
        """(statement, question, value) of `count` facts with distinct (thing, owner) keys and distinct values."""
        things = list(THINGS)
        owners = [person_name(rng) for _ in range(max(1, (count + 1) // 2))]
        facts, seen_keys, seen_values = [], set(), set()
        while len(facts) < count:
            thing = things[int(rng.integers(len(things)))]
            owner = owners[int(rng.integers(len(owners)))]
            value = make_value(rng, THINGS[thing])
            if (thing, owner) in seen_keys or value in seen_values:
                continue
            seen_keys.add((thing, owner))
            seen_values.add(value)
            pool = SINGLE_PHRASINGS if single else FACT_PHRASINGS
            phrasing = pool[int(rng.integers(len(pool)))]
            fields = {"thing": thing, "owner": owner, "value": value}
            facts.append((phrasing.statement.format(**fields), phrasing.question.format(**fields), value))
        return facts

    # Filler ----------------------------------------------------------------------------------------------------

    def filler(self, rng: np.random.Generator, length: int, *, real_text: bool = False) -> list[list[int]]:
        """At most `length` tokens of filler as pieces a needle may go between: single tokens of a window of
        real text (`length` of them), or whole synthetic sentences."""
        if length <= 0:
            return []
        if real_text and self.real_text is not None and length <= self.real_text.longest:
            return [[token] for token in self.real_text.window(rng, length)]
        sentences, total = [], 0
        while True:
            for sentence in self.encode([" " + filler_sentence(rng) for _ in range(max(8, (length - total) // 8))]):
                if total + len(sentence) > length:
                    return sentences or [sentence[:length]]  # not one whole sentence fits: the first, cut
                sentences.append(sentence)
                total += len(sentence)

    def filler_tokens(self, rng: np.random.Generator, length: int) -> list[int]:
        """Exactly `length` tokens of synthetic filler sentences, the last one cut."""
        ids = []
        while len(ids) < length:
            ids += [t for sentence in self.encode([" " + filler_sentence(rng) for _ in range(8)]) for t in sentence]
        return ids[:length]


def piece_boundaries(pieces: list[list[int]]) -> list[int]:
    """Token offsets between pieces, 0 and the end included."""
    cuts = [0]
    for piece in pieces:
        cuts.append(cuts[-1] + len(piece))
    return cuts


def syllables(rng: np.random.Generator, count: int) -> str:
    return "".join(CONSONANTS[int(rng.integers(len(CONSONANTS)))] + VOWELS[int(rng.integers(len(VOWELS)))]
                   for _ in range(count))


def key_name(rng: np.random.Generator) -> str:
    """A key such as "dovari-27": a made-up word and a number (the evaluation's keys are word pairs, UUIDs
    and bare letter strings)."""
    return f"{syllables(rng, int(rng.integers(2, 4)))}-{int(rng.integers(10, 100))}"


def person_name(rng: np.random.Generator) -> str:
    return f"{syllables(rng, int(rng.integers(2, 4))).capitalize()} {syllables(rng, 2).capitalize()}r"


def make_value(rng: np.random.Generator, kind: str) -> str:
    if kind == "word":
        return syllables(rng, int(rng.integers(2, 4)))
    if kind == "code":
        letters = "".join(CODE_LETTERS[int(rng.integers(len(CODE_LETTERS)))] for _ in range(2))
        return f"{letters}{int(rng.integers(1, 10))}-{int(rng.integers(100, 1000))}"
    digits = {"digits4": (4, 4), "digits_short": (3, 4), "digits_long": (6, 8)}.get(kind, (3, 7))
    width = int(rng.integers(digits[0], digits[1] + 1))
    return str(int(rng.integers(10 ** (width - 1), 10**width)))


def filler_sentence(rng: np.random.Generator) -> str:
    pick = lambda words: words[int(rng.integers(len(words)))]
    return f"{pick(FILLER_SUBJECTS)} {pick(FILLER_VERBS)} {pick(FILLER_OBJECTS)} {pick(FILLER_TAILS)}."


def distinct(rng: np.random.Generator, make, count: int) -> list[str]:
    out, seen = [], set()
    while len(out) < count:
        item = make()
        if item not in seen:
            seen.add(item)
            out.append(item)
    return out


class RecallBlocks(Dataset):
    """`count` recall blocks, each generated when read (`RecallGenerator.block`)."""

    def __init__(self, generator: RecallGenerator, count: int):
        self.generator = generator
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> torch.Tensor:
        if not 0 <= i < self.count:
            raise IndexError(i)
        return torch.from_numpy(self.generator.block(i))


class MixedBlocks(Dataset):
    """Real training blocks then recall blocks, as one dataset; the loader's permutation interleaves them."""

    def __init__(self, real: TokenBlocks, recall: RecallBlocks):
        self.real, self.recall = real, recall

    def __len__(self) -> int:
        return len(self.real) + len(self.recall)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.real[i] if i < len(self.real) else self.recall[i - len(self.real)]

    @property
    def seq_len(self) -> int:
        return self.real.seq_len

    @property
    def num_tokens(self) -> int:
        return len(self) * self.seq_len


def recall_count(total: int, share: float) -> int:
    """How many of `total` blocks are recall blocks at `share` of the tokens: at least one, at most total - 1."""
    return min(max(1, round(share * total)), total - 1) if share > 0 else 0


def with_recall(train: TokenBlocks, tokenizer, share: float, *, seed: int) -> TokenBlocks | MixedBlocks:
    """`train` with `share` of its blocks (so of its tokens: every block has seq_len) replaced by recall blocks;
    `train` itself at share 0. The real blocks kept are the first of its seeded order, and the real-text filler
    is drawn from all of them, so nothing outside the training split is read."""
    if share == 0:
        return train
    if len(train) < 2:
        raise ValueError(f"recall_share {share}: {len(train)} training sequence(s), too few to mix recall into")
    count = recall_count(len(train), share)
    prefix = text_prefix(tokenizer)
    real_text = RealText(train.blocks, train.indices, len(prefix), tokenizer.eos_token_id, separator_id(tokenizer))
    generator = RecallGenerator(tokenizer, train.seq_len, seed, real_text)
    kept = TokenBlocks(train.blocks, train.indices[: len(train) - count])
    return MixedBlocks(kept, RecallBlocks(generator, count))


def separator_id(tokenizer) -> int:
    """The token that stands for a document boundary inside real-text filler: a newline, else a space."""
    unknown = getattr(tokenizer, "unk_token_id", None)
    for text in ("\n", " "):
        ids = tokenizer(text, add_special_tokens=False).input_ids
        if len(ids) == 1 and ids[0] != unknown:
            return ids[0]
    return tokenizer.eos_token_id
