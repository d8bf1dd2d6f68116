"""Turn documents into one token stream: each document's ids followed by the tokenizer's EOS id."""

from collections.abc import Iterable
from itertools import chain, islice

import numpy as np
from tqdm import tqdm

from linearize.data.errors import DataError

TOKENIZE_BATCH = 1000  # documents per tokenizer call: large enough for the Rust tokenizer to use every core


def tokenize_documents(documents: Iterable[str], tokenizer) -> tuple[np.ndarray, int]:
    """The token stream of `documents` (each one's ids, then EOS) as int32, and the number of documents."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DataError("The tokenizer has no EOS token, which the packer needs to separate documents.")
    pieces, num_docs = [], 0
    for batch in tqdm(_batches(documents, TOKENIZE_BATCH), desc="tokenizing", unit="batch", disable=None):
        # split_special_tokens: a literal "</s>" in the text stays text and can't fake a document boundary.
        ids = tokenizer(batch, add_special_tokens=False, split_special_tokens=True,
                        return_attention_mask=False, verbose=False)["input_ids"]
        count = sum(len(doc) + 1 for doc in ids)
        pieces.append(np.fromiter(chain.from_iterable(doc + [eos] for doc in ids), dtype=np.int32, count=count))
        num_docs += len(ids)
    stream = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)
    return stream, num_docs


def text_prefix(tokenizer) -> list[int]:
    """The special ids the tokenizer puts before every text (Gemma's <bos>; none for SmolLM2): a model
    trained with them expects them at position 0 (Gemma 3 without its <bos> first: docs/setup.md)."""
    ids = tokenizer("a").input_ids
    bare = tokenizer("a", add_special_tokens=False).input_ids
    for start in range(len(ids) - len(bare) + 1):
        if ids[start : start + len(bare)] == bare:
            return list(ids[:start])
    return []


def _batches(items: Iterable[str], size: int):
    iterator = iter(items)
    while batch := list(islice(iterator, size)):
        yield batch
