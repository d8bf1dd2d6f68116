"""Random-weight models of known shapes: what `bench model`, `bench serve` and `bench train` build with
`--shape NAME`, since speed and memory need no trained weights (nothing is downloaded).

Each shape is a teacher family (`linearize.architectures`) and the config of a published model, to the sizes
that set speed and memory: layers, widths, heads, vocabulary, q/k norms. max_position_embeddings only has to
cover the sweeps: RoPE is computed on the fly, and speed does not depend on its trained range.

This module imports neither torch nor transformers until a model is built: the command's parser reads
`SHAPES` for its choices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

MAX_POSITIONS = 1 << 20


@dataclass(frozen=True)
class Shape:
    architecture: str  # a key of linearize.architectures.ARCHITECTURES
    config: dict
    # A full fine-tune of it fits one GPU with AdamW (float32 weights, gradients and two moments: 16 bytes a
    # parameter, 128 GB at 8B before any activation): `bench train` times one by default where it does.
    full_fine_tune_fits: bool = False
    # Too large to build on a CPU (tens of GB of float32 weights): the bench commands refuse it there.
    needs_gpu: bool = True


SHAPES: dict[str, Shape] = {
    # SmolLM2-135M
    "smollm2": Shape("llama", {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                               "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
                               "tie_word_embeddings": True},
                     full_fine_tune_fits=True, needs_gpu=False),
    # Llama-3-8B's widths and vocabulary (RoPE left at the config's default: it does not change the speed)
    "llama3-8b": Shape("llama", {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                                 "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256}),
    # Mistral-7B-v0.1, without its 4K sliding window: every layer full attention, as the benchmarks time it
    "mistral-7b": Shape("mistral", {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                                    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000,
                                    "sliding_window": None, "rope_theta": 1e4}),
    # Qwen3-8B: q/k RMSNorm per head (the qwen3 family), head_dim 128, untied head over a 152K vocabulary
    "qwen3-8b": Shape("qwen3", {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                                "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                                "vocab_size": 151936, "rope_theta": 1e6, "tie_word_embeddings": False}),
}


def random_model(shape: str, *, device="cpu", dtype: torch.dtype | None = None, **overrides) -> PreTrainedModel:
    """A model of a known shape (`SHAPES[shape]`, config entries replaced by `overrides`, e.g. a layer count)
    with random weights (seed 0) and SDPA attention, in `dtype` (default float32). Built and initialised
    in place on `device`: an 8B model never passes through host memory, nor through float32 when `dtype`
    is bf16."""
    import torch

    from ..architectures import ARCHITECTURES

    spec = SHAPES[shape]
    family = ARCHITECTURES[spec.architecture]
    config = family.config_class(**dict(spec.config, **overrides), max_position_embeddings=MAX_POSITIONS)
    torch.manual_seed(0)
    with torch.device(device):
        return family.model_class._from_config(config, dtype=dtype or torch.float32, attn_implementation="sdpa")
