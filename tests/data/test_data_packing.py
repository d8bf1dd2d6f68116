import numpy as np
import pytest
import torch
from data_helpers import make_tokenizer, write_jsonl

from linearize.data import DataError, TokenBlocks, build_token_blocks, packing
from linearize.data.packing import pack, split_indices, tokenize_documents
from linearize.data.token_cache import default_cache_dir


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch):
    """Keep the token cache inside the test's tmp_path, never in the user's cache."""
    monkeypatch.setenv("LINEARIZE_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def tokenizer():
    return make_tokenizer()


def random_docs(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(f"w{i}" for i in rng.integers(0, 200, rng.integers(1, 40))) for _ in range(n)]


def expected_stream(docs: list[str], tokenizer) -> list[int]:
    vocab = tokenizer.get_vocab()
    return [i for doc in docs for i in [vocab[word] for word in doc.split()] + [tokenizer.eos_token_id]]


def write_docs(path, docs):
    return write_jsonl(path, [{"text": doc} for doc in docs])


def all_rows(blocks: TokenBlocks) -> list[list[int]]:
    return [blocks[i].tolist() for i in range(len(blocks))]


def test_stream_is_documents_each_followed_by_eos(tokenizer):
    docs = random_docs(2500)  # more than one tokenizer batch
    stream, num_docs = tokenize_documents(docs, tokenizer)
    assert num_docs == 2500
    assert stream.tolist() == expected_stream(docs, tokenizer)


def test_literal_eos_text_is_not_a_document_boundary(tokenizer):
    stream, _ = tokenize_documents(["w1 </s> w2"], tokenizer)
    assert stream.tolist().count(tokenizer.eos_token_id) == 1


def test_blocks_are_exact_slices_of_the_stream_and_the_remainder_is_dropped():
    stream = np.arange(23, dtype=np.int32)
    blocks = pack(stream, 5)
    assert blocks.tolist() == [list(range(i, i + 5)) for i in range(0, 20, 5)]


def test_train_and_val_blocks_are_slices_of_the_packed_stream(tmp_path, tokenizer):
    docs = random_docs(300)
    path = write_docs(tmp_path / "d.jsonl", docs)
    train, val = build_token_blocks(path, tokenizer, seq_len=16, val_size=0.05, seed=3)
    stream = expected_stream(docs, tokenizer)
    slices = {tuple(stream[i : i + 16]) for i in range(0, len(stream) - 15, 16)}
    assert len(slices) == len(stream) // 16  # random docs: every block is distinct
    rows = [tuple(r) for r in all_rows(train) + all_rows(val)]
    assert set(rows) == slices and len(rows) == len(slices)
    assert train[0].dtype == torch.long and train[0].shape == (16,)
    assert train.seq_len == 16 and train.num_tokens == 16 * len(train)


def test_validation_is_disjoint_from_train(tmp_path, tokenizer):
    path = write_docs(tmp_path / "d.jsonl", random_docs(300))
    train, val = build_token_blocks(path, tokenizer, seq_len=16, val_size=0.1)
    assert len(val) > 0
    assert not set(train.indices.tolist()) & set(val.indices.tolist())
    assert not {tuple(r) for r in all_rows(train)} & {tuple(r) for r in all_rows(val)}


def test_validation_size_rules():
    # A fraction is rounded up and capped; an int is a number of blocks.
    assert len(split_indices(1000, 8, val_size=0.02, max_val_blocks=64, max_tokens=None, seed=0)[1]) == 20
    assert len(split_indices(1000, 8, val_size=0.5, max_val_blocks=64, max_tokens=None, seed=0)[1]) == 64
    assert len(split_indices(10, 8, val_size=0.02, max_val_blocks=64, max_tokens=None, seed=0)[1]) == 1
    assert len(split_indices(10, 8, val_size=3, max_val_blocks=1, max_tokens=None, seed=0)[1]) == 3
    assert len(split_indices(10, 8, val_size=0.0, max_val_blocks=64, max_tokens=None, seed=0)[1]) == 0


def test_max_tokens_caps_train_but_not_validation():
    train, val = split_indices(100, 8, val_size=5, max_val_blocks=64, max_tokens=83, seed=0)
    full_train, same_val = split_indices(100, 8, val_size=5, max_val_blocks=64, max_tokens=None, seed=0)
    assert len(train) == 10 and len(full_train) == 95
    assert val.tolist() == same_val.tolist()
    assert train.tolist() == full_train[:10].tolist()
    with pytest.raises(ValueError, match="less than one block"):
        split_indices(100, 8, val_size=5, max_val_blocks=64, max_tokens=7, seed=0)


def test_shuffle_is_seeded(tmp_path, tokenizer):
    path = write_docs(tmp_path / "d.jsonl", random_docs(300))
    first, _ = build_token_blocks(path, tokenizer, seq_len=16, seed=1)
    again, _ = build_token_blocks(path, tokenizer, seq_len=16, seed=1)
    other, _ = build_token_blocks(path, tokenizer, seq_len=16, seed=2)
    assert first.indices.tolist() == again.indices.tolist()
    assert first.indices.tolist() != other.indices.tolist()
    assert sorted(first.indices.tolist()) != first.indices.tolist()  # actually shuffled


def test_packed_blocks_are_cached_per_seq_len(tmp_path, tokenizer, monkeypatch):
    path = write_docs(tmp_path / "d.jsonl", random_docs(100))
    train, _ = build_token_blocks(path, tokenizer, seq_len=16)
    assert default_cache_dir() == tmp_path / "cache" / "blocks"  # $LINEARIZE_CACHE
    assert len(list(default_cache_dir().glob("*.npy"))) == 1

    def no_reading(spec):
        raise AssertionError("re-read the data despite the cache")

    monkeypatch.setattr(packing, "load_documents", no_reading)
    cached, _ = build_token_blocks(path, tokenizer, seq_len=16)
    assert all_rows(cached) == all_rows(train)
    with pytest.raises(AssertionError, match="despite the cache"):
        build_token_blocks(path, tokenizer, seq_len=8)


def test_cache_key_follows_the_tokenizer(tmp_path, tokenizer):
    path = write_docs(tmp_path / "d.jsonl", random_docs(100))
    build_token_blocks(path, tokenizer, seq_len=16)
    other = make_tokenizer(eos_token="<unk>")
    train, _ = build_token_blocks(path, other, seq_len=16)
    assert len(list(default_cache_dir().glob("*.npy"))) == 2
    assert 0 in {i for row in all_rows(train) for i in row}  # <unk> is this tokenizer's separator


def test_cache_dir_argument(tmp_path, tokenizer):
    path = write_docs(tmp_path / "d.jsonl", random_docs(100))
    build_token_blocks(path, tokenizer, seq_len=16, cache_dir=tmp_path / "mine")
    assert len(list((tmp_path / "mine").glob("*.npy"))) == 1


def test_empty_dataset(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": ""}, {"text": "  \n"}])
    with pytest.raises(DataError, match="holds no documents"):
        build_token_blocks(path, tokenizer, seq_len=16)


def test_fewer_tokens_than_one_block(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "w1 w2 w3"}])
    with pytest.raises(DataError, match="has 4 tokens, fewer than one block of 16"):
        build_token_blocks(path, tokenizer, seq_len=16)


def test_too_few_blocks_to_hold_out_validation(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": " ".join(["w1"] * 20)}])
    with pytest.raises(DataError, match="Only 1 blocks of 16 tokens"):
        build_token_blocks(path, tokenizer, seq_len=16)
    train, val = build_token_blocks(path, tokenizer, seq_len=16, val_size=0)
    assert len(train) == 1 and len(val) == 0


def test_tokenizer_without_eos():
    with pytest.raises(DataError, match="no EOS token"):
        tokenize_documents(["w1"], make_tokenizer(eos_token=None))


def bos_first(tokenizer):
    """`tokenizer`, made to start every text with its BOS token, as Gemma's does."""
    from tokenizers import processors

    tokenizer.add_special_tokens({"bos_token": "<s>"})
    bos = tokenizer.bos_token_id
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    return tokenizer


def test_a_tokenizer_that_starts_texts_with_bos_starts_every_block_with_it(tmp_path, tokenizer):
    from linearize.data.tokenize import text_prefix

    assert text_prefix(tokenizer) == []
    docs = random_docs(200)
    path = write_docs(tmp_path / "d.jsonl", docs)
    plain, _ = build_token_blocks(path, tokenizer, seq_len=16, val_size=2, seed=0)
    tokenizer = bos_first(tokenizer)
    bos = tokenizer.bos_token_id
    assert text_prefix(tokenizer) == [bos]
    train, val = build_token_blocks(path, tokenizer, seq_len=16, val_size=2, seed=0)
    stream = expected_stream(docs, tokenizer)
    slices = {(bos, *stream[i : i + 15]) for i in range(0, len(stream) - 14, 15)}
    rows = {tuple(r) for r in all_rows(train) + all_rows(val)}
    assert rows == slices and train.seq_len == 16
    assert {tuple(r) for r in all_rows(plain)}.isdisjoint(rows)  # a cache of its own, not the plain blocks
    with pytest.raises(ValueError, match="longer than the 1 special token"):
        build_token_blocks(path, tokenizer, seq_len=1)
