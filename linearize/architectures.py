"""What differs between the teachers `convert` accepts: how each forms q, k and v, and where its
attention layers slide.

One `Architecture` per teacher `model_type`. The rest a linearized attention needs it reads off the
teacher's own attention module and config, the same way for every family: the query scaling
(`scaling`: Gemma's `query_pre_attn_scalar`), logit soft-capping (`attn_logit_softcapping`: Gemma 2)
and the per-layer attention types (`layer_types`: Gemma's five sliding layers to one full, Qwen3's
optional sliding layers). So a new family is a line here, not a copy of its modeling file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PretrainedConfig,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from .config import LAYER_CHOICES

FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass(frozen=True)
class Architecture:
    """A teacher family: its HF classes and how its attention forms q and k from the projections."""

    config_class: type
    model_class: type
    # RMSNorm of q and k before RoPE: "head" on each head's d features (Qwen3, Gemma 3), "projection" on
    # the whole projection before it is split into heads (OLMo-2).
    qk_norm: Literal["none", "head", "projection"] = "none"
    # One [q; k; v] Linear (Phi-3): a linearized layer holds it as q_proj, k_proj and v_proj.
    fused_qkv: bool = False

    def unsupported_reason(self, config: PretrainedConfig) -> str | None:
        """Why this teacher, of a supported family, still cannot be linearized; None if it can."""
        if getattr(config, "use_bidirectional_attention", False):
            return "its attention is bidirectional; linearizing needs a causal decoder"
        factor = partial_rotary_factor(config)
        if factor != 1.0:
            return f"it rotates only part of each head (partial_rotary_factor={factor}); linearize supports RoPE over the whole head"
        return None


def partial_rotary_factor(config: PretrainedConfig) -> float:
    """The share of each head RoPE rotates, from `rope_parameters` (one dict, or one per layer type)."""
    params = getattr(config, "rope_parameters", None) or {}
    dicts = [p for p in params.values() if isinstance(p, dict)] or [params]
    factors = {float(p.get("partial_rotary_factor") or 1.0) for p in dicts}
    return min(factors)


ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture(LlamaConfig, LlamaForCausalLM),
    "mistral": Architecture(MistralConfig, MistralForCausalLM),
    "qwen2": Architecture(Qwen2Config, Qwen2ForCausalLM),
    "qwen3": Architecture(Qwen3Config, Qwen3ForCausalLM, qk_norm="head"),
    "gemma2": Architecture(Gemma2Config, Gemma2ForCausalLM),
    "gemma3_text": Architecture(Gemma3TextConfig, Gemma3ForCausalLM, qk_norm="head"),
    "phi3": Architecture(Phi3Config, Phi3ForCausalLM, fused_qkv=True),
    "olmo2": Architecture(Olmo2Config, Olmo2ForCausalLM, qk_norm="projection"),
}

# Families whose multimodal or other wrapper hides a supported text model: what to convert instead.
TEXT_MODEL_HINTS = {"gemma3": "load its text model (model_type gemma3_text, Gemma3ForCausalLM) and convert that"}


def architecture_of(config: PretrainedConfig) -> Architecture:
    """The teacher's `Architecture`, or ValueError naming what is supported (or why this one is not)."""
    model_type = config.model_type.removeprefix("linearized_")
    arch = ARCHITECTURES.get(model_type)
    if arch is None:
        hint = f" ({TEXT_MODEL_HINTS[model_type]})" if model_type in TEXT_MODEL_HINTS else ""
        raise ValueError(f"cannot linearize model type {model_type!r}{hint}; supported: {', '.join(sorted(ARCHITECTURES))}")
    reason = arch.unsupported_reason(config)
    if reason is not None:
        raise ValueError(f"cannot linearize this {model_type} model: {reason}")
    return arch


def layer_types(config: PretrainedConfig) -> list[str]:
    """Each decoder layer's attention type, FULL or SLIDING, as the teacher runs it: `layer_types` where
    the config has them (Gemma, Qwen3), else every layer sliding where it sets a window (Mistral v0.1,
    Phi-3 with one), else every layer full."""
    n = config.num_hidden_layers
    types = getattr(config, "layer_types", None)
    if types:
        return [SLIDING if t == SLIDING else FULL for t in types]
    return [SLIDING if getattr(config, "sliding_window", None) else FULL] * n


def sliding_window_of(config: PretrainedConfig) -> int | None:
    """The window of the teacher's sliding layers; None where it has none."""
    return config.sliding_window if SLIDING in layer_types(config) else None


def layers_kept_softmax(config: PretrainedConfig, layers: str) -> list[int]:
    """The layers `layers` leaves to the teacher's softmax: none for "all", the sliding-window ones for
    "full" (they already run in constant memory, on a window)."""
    if layers not in LAYER_CHOICES:
        raise ValueError(f"layers must be one of {', '.join(LAYER_CHOICES)}, got {layers!r}")
    if layers == "all":
        return []
    return [i for i, t in enumerate(layer_types(config)) if t == SLIDING]
