"""Recall documents mixed into the training blocks (`linearize.data.recall`): seeded, within their length,
each answer right after its question, at the asked share of the tokens, apart from the evaluation's
templates and random streams, and resumable."""

import ast
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_models import tiny_tokenizer

from linearize.data import ResumableLoader, TokenBlocks
from linearize.data.recall import (
    FACT_PHRASINGS,
    FAMILIES,
    KEY_VALUE_PHRASINGS,
    RECALL_SALT,
    SINGLE_PHRASINGS,
    MixedBlocks,
    RecallGenerator,
    filler_sentence,
    recall_rng,
    with_recall,
)

EVAL = Path(__file__).resolve().parents[2] / "linearize" / "eval"
EVAL_MODULES = ("longcontext.py", "ruler.py", "babilong.py", "haystack.py")
SEQ_LEN = 512


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def train(tokenizer):
    """60 training blocks of real text (with document boundaries), of which 12 are not the training split."""
    rng = np.random.default_rng(1)
    text = tokenizer(" ".join(f"Chapter {i} of the long river story went on." for i in range(400)),
                     add_special_tokens=False).input_ids
    stream = np.asarray(text * 8, dtype=np.int32)
    stream[rng.choice(len(stream), 40, replace=False)] = tokenizer.eos_token_id
    blocks = stream[: 72 * SEQ_LEN].reshape(72, SEQ_LEN).copy()
    blocks[60:] = held_out_token(tokenizer)
    return TokenBlocks(blocks, np.arange(60))


def held_out_token(tokenizer) -> int:
    return tokenizer("#", add_special_tokens=False).input_ids[0]


@pytest.fixture(scope="module")
def generator(tokenizer, train):
    return with_recall(train, tokenizer, 0.2, seed=3).recall.generator


def documents(generator, family, count=12, target=SEQ_LEN - 1):
    return [generator.document(recall_rng(7, i), target, family) for i in range(count)]


def test_blocks_are_a_function_of_the_seed_and_index(tokenizer, train):
    a = with_recall(train, tokenizer, 0.2, seed=3)
    b = with_recall(train, tokenizer, 0.2, seed=3)
    other = with_recall(train, tokenizer, 0.2, seed=4)
    assert len(a.recall) == 12
    for i in range(len(a.recall)):
        assert torch.equal(a.recall[i], b.recall[i])
    assert not torch.equal(a.recall[0], a.recall[1])
    assert not torch.equal(a.recall[0], other.recall[0])
    assert torch.equal(a.recall[5], a.recall[5])  # reading a block again gives it again


@pytest.mark.parametrize("share", [0.05, 0.2, 0.5, 0.9])
def test_the_share_of_tokens_is_the_asked_one(tokenizer, train, share):
    mixed = with_recall(train, tokenizer, share, seed=0)
    assert len(mixed) == len(train) and mixed.num_tokens == train.num_tokens  # the budget is unchanged
    assert abs(len(mixed.recall) * SEQ_LEN / mixed.num_tokens - share) <= 0.5 / len(train)
    assert all(mixed[i].shape == (SEQ_LEN,) for i in range(len(mixed)))
    # The real blocks kept are the first of the seeded training order, unchanged.
    for i in range(len(mixed.real)):
        assert torch.equal(mixed[i], train[i])


def test_share_zero_is_the_data_itself_and_gives_the_same_batches(tokenizer, train):
    assert with_recall(train, tokenizer, 0, seed=0) is train
    batches = lambda data: [b for _, b in zip(range(6), ResumableLoader(data, 4, seed=1))]
    for x, y in zip(batches(with_recall(train, tokenizer, 0.0, seed=0)), batches(train)):
        assert torch.equal(x, y)


@pytest.mark.parametrize("family", FAMILIES)
def test_documents_fit_and_every_answer_follows_its_question(tokenizer, generator, family):
    for target in (60, 150, SEQ_LEN - 1):
        for doc in documents(generator, family, count=8, target=target):
            assert len(doc.ids) <= target
            assert tokenizer.eos_token_id not in doc.ids  # a document holds no boundary inside
            if not doc.ids:
                continue
            assert doc.queries
            for query in doc.queries:
                assert query.question[1] == query.answer[0]  # the answer right after its question
                assert doc.ids[query.answer[0] : query.answer[1]] == tokenizer(" " + query.value).input_ids
                assert query.needle[1] <= query.question[0]  # the fact comes before it is asked
                assert query.value in tokenizer.decode(doc.ids[query.needle[0] : query.needle[1]])
    long = documents(generator, family)
    assert all(len(doc.ids) >= (SEQ_LEN - 1) // 2 for doc in long)  # lengths reach the training length
    assert sum(len(doc.queries) for doc in long) >= 2 * len(long)  # several questions a document


def test_needles_sit_at_spread_depths(generator):
    depths = []
    for family in ("needles_filler", "needles_real_text"):
        for doc in documents(generator, family, count=40):
            if not doc.ids:
                continue
            filler_end = min(q.question[0] for q in doc.queries)
            depths += [q.needle[0] / filler_end for q in doc.queries]
    counts = np.histogram(depths, bins=5, range=(0, 1))[0]
    assert (counts > 0.05 * len(depths)).all(), counts


def test_real_text_filler_comes_from_the_training_split(tokenizer, train):
    mixed = with_recall(train, tokenizer, 0.2, seed=0)
    real = mixed.recall.generator.real_text
    assert np.array_equal(real.indices, train.indices)
    rng = np.random.default_rng(0)
    windows = [real.window(rng, SEQ_LEN // 2) for _ in range(40)]
    assert all(tokenizer.eos_token_id not in window for window in windows)  # boundaries became separators
    assert all(held_out_token(tokenizer) not in window for window in windows)
    text = [tokenizer.decode(generator_doc.ids) for generator_doc in
            documents(mixed.recall.generator, "needles_real_text", count=6)]
    assert all(re.search("Chapter|river|story", t) for t in text) and not any("#" in t for t in text)


def test_blocks_are_whole_documents_each_ended_by_eos(tokenizer, generator):
    for i in range(10):
        block = generator.block(i).tolist()
        assert len(block) == SEQ_LEN
        assert block.count(tokenizer.eos_token_id) >= 1  # at least one whole document, then filler


def test_a_resumed_loader_reads_the_same_mixed_batches(tokenizer, train):
    straight = ResumableLoader(with_recall(train, tokenizer, 0.3, seed=5), 4, seed=2)
    expected = [b for _, b in zip(range(10), straight)]
    first = ResumableLoader(with_recall(train, tokenizer, 0.3, seed=5), 4, seed=2)
    got = [b for _, b in zip(range(4), first)]
    state = first.state_dict()
    resumed = ResumableLoader(with_recall(train, tokenizer, 0.3, seed=5), 4, seed=2)
    resumed.load_state_dict(state)
    got += [b for _, b in zip(range(6), resumed)]
    assert all(torch.equal(x, y) for x, y in zip(got, expected))
    # Recall blocks are in the batches, interleaved with the real ones.
    real = {tuple(train[i].tolist()) for i in range(len(train))}
    rows = [tuple(row.tolist()) for batch in expected for row in batch]
    assert 0 < sum(row not in real for row in rows) < len(rows)


def eval_fragments() -> set[str]:
    """Every phrase of four words or more of the evaluation's prompt strings (docstrings left out): the
    string constants and f-string parts of its task modules, cut at format fields and sentence ends."""
    fragments = set()
    for name in EVAL_MODULES:
        tree = ast.parse((EVAL / name).read_text())
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, ast.Module | ast.FunctionDef | ast.ClassDef) and node.body
                      and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                for part in re.split(r"\{[^}]*\}|[.?!:;\n]", node.value):
                    words = part.lower().split()
                    if len(words) >= 4:
                        fragments.add(" ".join(words))
    return fragments


def test_no_document_uses_a_phrase_of_the_evaluation(tokenizer, generator):
    fragments = eval_fragments()
    assert "the pass key is" in fragments and "one of the special magic" in fragments  # the parse finds them
    ours = [text for phrasing in KEY_VALUE_PHRASINGS + FACT_PHRASINGS + SINGLE_PHRASINGS
            for text in (phrasing.statement, phrasing.question)]
    rng = np.random.default_rng(0)
    ours += [filler_sentence(rng) for _ in range(200)]
    ours += [tokenizer.decode(generator.block(i)) for i in range(6)]
    ours += [tokenizer.decode(doc.ids) for family in FAMILIES for doc in documents(generator, family, count=4)]
    for text in ours:
        flat = " ".join(re.sub(r"[.?!:;]", " ", text.lower()).split())
        hits = [fragment for fragment in fragments if fragment in flat]
        assert not hits, (hits, text[:200])


def test_the_random_streams_are_not_the_evaluations():
    """The evaluation seeds Python's random.Random with small integers, strings and 32-bit CRCs
    (`longcontext.sample_seed`); recall blocks draw from numpy's PCG64 under a salt above 2**32, so no stream is
    shared, and a block's stream does not repeat an evaluation sample's seed as a whole."""
    from linearize.eval.longcontext import sample_seed

    assert RECALL_SALT >= 2**32
    sequence = recall_rng(0, 0).bit_generator.seed_seq
    assert sequence.entropy == [RECALL_SALT, 0, 0]
    eval_seeds = {sample_seed(0, task, length, depth, i) for task in ("passkey", "niah_single", "mqar")
                  for length in (1024, 4096) for depth in (0, 50, 100) for i in range(5)}
    assert all(seed < 2**32 for seed in eval_seeds)  # CRCs: never the salt, the first word of ours
    # Nor does a recall stream start as numpy would for an evaluation seed.
    starts = {tuple(np.random.default_rng(seed).integers(0, 2**31, 4)) for seed in eval_seeds | set(range(100))}
    assert all(tuple(recall_rng(seed, i).integers(0, 2**31, 4)) not in starts for seed in range(3) for i in range(50))


def test_a_tokenizer_without_a_separator_still_has_real_text(tokenizer, train):
    mixed = with_recall(train, tokenizer, 0.2, seed=0)
    assert isinstance(mixed, MixedBlocks)
    # The tiny character tokenizer knows no newline: boundaries in real text become a space.
    assert mixed.recall.generator.real_text.separator == tokenizer(" ", add_special_tokens=False).input_ids[0]


def test_a_generator_of_a_short_training_length_fills_its_blocks(tokenizer):
    generator = RecallGenerator(tokenizer, 32, 0)
    for i in range(5):
        assert len(generator.block(i)) == 32
