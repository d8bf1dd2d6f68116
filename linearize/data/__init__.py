"""Training data: documents from a DATA spec, packed into token blocks, served by a resumable sharded loader.

    train, val = build_token_blocks("yahma/alpaca-cleaned", tokenizer, seq_len=1024, max_tokens=20_000_000)
    loader = ResumableLoader(train, batch_size=8, seed=0, rank=rank, world_size=world_size)
    for input_ids in loader:  # LongTensor [8 // world_size, 1024]
        ...
"""

from linearize.data.errors import DataError
from linearize.data.loader import ResumableLoader
from linearize.data.packing import TokenBlocks, build_token_blocks
from linearize.data.sources import load_documents

__all__ = ["DataError", "ResumableLoader", "TokenBlocks", "build_token_blocks", "load_documents"]
