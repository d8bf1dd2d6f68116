"""Tokenize documents, pack them into fixed-length blocks, and split the blocks into train and validation.

Every document becomes its token ids followed by the tokenizer's EOS id; the documents are concatenated in order and
cut into blocks of `seq_len` tokens, dropping the remainder. So a block is an exact slice of that stream and may span
document boundaries, as in GPT-style pre-training. A tokenizer that starts every text with special ids
(`tokenize.text_prefix`: Gemma's <bos>) has them start every block too, before a slice of `seq_len` minus their
number. The blocks are cached on disk; the
seeded shuffle, validation hold-out and `max_tokens` cap are applied on load, so they cost nothing to change.
"""

import hashlib
import json
import logging
import math
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from linearize.data.errors import DataError
from linearize.data.shuffle import permutation
from linearize.data.sources import data_fingerprint, load_documents
from linearize.data.token_cache import cached_array, default_cache_dir
from linearize.data.tokenize import text_prefix, tokenize_documents

log = logging.getLogger(__name__)

PACKING_VERSION = 1  # bump when the layout of the token stream changes, so old caches are not reused


class TokenBlocks(Dataset):
    """Some of the packed blocks; item i is a LongTensor [seq_len] of input ids."""

    def __init__(self, blocks: np.ndarray, indices: np.ndarray):
        self.blocks = blocks  # [num_blocks, seq_len], shared by the train and validation views
        self.indices = indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.from_numpy(self.blocks[self.indices[i]].astype(np.int64))

    @property
    def seq_len(self) -> int:
        return self.blocks.shape[1]

    @property
    def num_tokens(self) -> int:
        return len(self) * self.seq_len


def build_token_blocks(
    spec: str | Path,
    tokenizer,
    seq_len: int,
    *,
    max_tokens: int | None = None,
    val_size: float = 0.02,
    max_val_blocks: int = 64,
    seed: int = 0,
    cache_dir: str | Path | None = None,
) -> tuple[TokenBlocks, TokenBlocks]:
    """Train and validation blocks of the documents of `spec` (see sources.load_documents).

    The blocks are shuffled with `seed`; the first ones go to validation: `val_size` blocks if it is an int, else
    that fraction of all blocks rounded up and capped at `max_val_blocks`. The rest, capped at `max_tokens` tokens,
    are for training. The validation set therefore does not change with `max_tokens`.
    Packed blocks are cached under `cache_dir` (default: `blocks/` in $LINEARIZE_CACHE or ~/.cache/linearize),
    keyed by the data, the tokenizer and `seq_len`.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be positive, got {seq_len}.")
    prefix = text_prefix(tokenizer)
    if len(prefix) >= seq_len:
        raise ValueError(f"seq_len must be longer than the {len(prefix)} special token(s) starting every block, got {seq_len}.")
    marked = f"|prefix{prefix}" if prefix else ""  # none: the key of the layout before prefixes existed
    key = hashlib.sha256(
        f"v{PACKING_VERSION}|{data_fingerprint(spec)}|{tokenizer_fingerprint(tokenizer)}|{seq_len}{marked}".encode()
    ).hexdigest()[:24]

    def build() -> tuple[np.ndarray, dict]:
        stream, num_docs = tokenize_documents(load_documents(spec), tokenizer)
        if num_docs == 0:
            raise DataError(f"The data '{spec}' holds no documents.")
        blocks = pack(stream, seq_len, prefix)
        if len(blocks) == 0:
            raise DataError(f"The data '{spec}' has {len(stream)} tokens, fewer than one block of {seq_len}.")
        info = {"spec": str(spec), "tokenizer": tokenizer.name_or_path, "seq_len": seq_len,
                "documents": num_docs, "tokens": len(stream), "blocks": len(blocks)}
        return blocks, info

    blocks = cached_array(Path(cache_dir) if cache_dir else default_cache_dir(), key, build)
    try:
        train, val = split_indices(len(blocks), seq_len, val_size=val_size, max_val_blocks=max_val_blocks,
                                   max_tokens=max_tokens, seed=seed)
    except DataError as e:
        raise DataError(f"The data '{spec}': {e}") from None
    log.info("Data %s: %d blocks of %d tokens, %d for training, %d for validation.",
             spec, len(blocks), seq_len, len(train), len(val))
    return TokenBlocks(blocks, train), TokenBlocks(blocks, val)


def pack(stream: np.ndarray, seq_len: int, prefix: list[int] | tuple[int, ...] = ()) -> np.ndarray:
    """Blocks [num_blocks, seq_len]: `prefix`, then the next seq_len - len(prefix) tokens of `stream`; the
    tokens left over after the last block are dropped."""
    body = seq_len - len(prefix)
    num_blocks = len(stream) // body
    blocks = stream[: num_blocks * body].reshape(num_blocks, body)
    if not prefix:
        return blocks
    return np.concatenate([np.broadcast_to(np.asarray(prefix, dtype=stream.dtype), (num_blocks, len(prefix))), blocks], 1)


def split_indices(
    num_blocks: int,
    seq_len: int,
    *,
    val_size: float,
    max_val_blocks: int,
    max_tokens: int | None,
    seed: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Shuffled (train, validation) block indices: disjoint, validation first in the seeded order."""
    if isinstance(val_size, float):
        if not 0 <= val_size < 1:
            raise ValueError(f"val_size as a fraction must be in [0, 1), got {val_size}.")
        num_val = min(max_val_blocks, math.ceil(val_size * num_blocks))
    elif val_size >= 0:
        num_val = val_size
    else:
        raise ValueError(f"val_size must be a fraction or a number of blocks, got {val_size}.")
    if num_val >= num_blocks:
        raise DataError(f"Only {num_blocks} blocks of {seq_len} tokens: too few to hold out {num_val} for "
                        "validation and train on the rest. Use more data, a shorter seq_len or a smaller val_size.")
    order = permutation(num_blocks, seed)
    train, val = order[num_val:], order[:num_val]
    if max_tokens is not None:
        if max_tokens < seq_len:
            raise ValueError(f"max_tokens={max_tokens} is less than one block of seq_len={seq_len}.")
        train = train[: max_tokens // seq_len]
    return train, val


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of everything that decides the token ids: the tokenizer's full definition and its EOS id."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    definition = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    text = f"{type(tokenizer).__name__}|{tokenizer.eos_token_id}|{definition}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]
