"""Read a GGUF file with transformers: dense weights, and a tokenizer with the file's own special tokens.

`linearize.loading` loads `.gguf` specs through this, and `linearize.assets` builds the dense copy of the default
teacher with it; it imports nothing else of linearize, so both can.
"""

from pathlib import Path

from gguf import GGUFReader
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig


def from_gguf(auto_class, path: Path, **kwargs):
    """`auto_class.from_pretrained` of the GGUF file `path` (a model class or `AutoTokenizer`)."""
    if auto_class is AutoModelForCausalLM:
        # Dense weights, and no GGUF-quantized tag that would make save_pretrained refuse the model.
        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    loaded = auto_class.from_pretrained(path.parent, gguf_file=path.name, **kwargs)
    if auto_class is AutoTokenizer:
        _set_special_tokens(loaded, path)
        no_bpe_cleanup(loaded)
    return loaded


def no_bpe_cleanup(tokenizer):
    """`clean_up_tokenization_spaces` False where transformers ignores True anyway (a BPE vocabulary:
    the clean-up would strip real spaces), so that every decode does not warn about it and the
    tokenizer_config.json we save says what decoding does. SmolLM2's own config says True."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (getattr(tokenizer, "clean_up_tokenization_spaces", False) and backend is not None
            and type(backend.model).__name__ == "BPE"
            and not getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)):
        tokenizer.clean_up_tokenization_spaces = False
    return tokenizer


def _set_special_tokens(tokenizer, path: Path) -> None:
    # transformers' GGUF converter for Llama vocabularies makes the BOS token the EOS token too and
    # drops the pad token; the file's own metadata has the right ids.
    fields = GGUFReader(path).fields
    for attr, key in (("eos_token", "tokenizer.ggml.eos_token_id"), ("pad_token", "tokenizer.ggml.padding_token_id")):
        if key in fields:
            setattr(tokenizer, attr, tokenizer.convert_ids_to_tokens(int(fields[key].contents())))
