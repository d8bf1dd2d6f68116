"""Helpers for the data pipeline tests: a tiny offline tokenizer and a JSONL writer.

Plain functions rather than conftest fixtures: several conftest.py files in one suite fight over the module name
`conftest` that other tests import from, so this folder adds none.
"""

import json

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

# Word-level vocabulary: each of w0..w199 is one id, anything else is <unk>; so expected ids can be read off it.
# The EOS token is added as a special token only, as in real tokenizers, so the text "</s>" is not it.
VOCAB = {"<unk>": 0} | {f"w{i}": i + 1 for i in range(200)}


def make_tokenizer(eos_token: str | None = "</s>") -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token=eos_token)


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path
