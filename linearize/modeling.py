"""HF-native linearized models: `save_pretrained` / `from_pretrained` / `generate` just work.

Each supported architecture gets a config subclass with its own `model_type` (so AutoConfig can
tell a linearized checkpoint from its teacher) carrying one extra field, `linearize`:
{"method": ..., "options": {...}, "softmax_layers": [...], "distilled": bool} (`distilled`: false from
`convert`, true from distill's export; a saved checkpoint may lack it, and then nothing is known of its
training, so no "not distilled" note is printed). The model subclass builds the teacher
architecture, then swaps the attention of every non-softmax layer, so the checkpoint's keys (teacher
projections + the new modules) load with no missing or unexpected entries. Importing this module
registers them with AutoConfig and AutoModelForCausalLM.
"""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from .architectures import ARCHITECTURES
from .attention import ATTENTION_CLASSES, LinearizedAttention
from .config import MethodConfig, make_method_config, method_name
from .norms import fuse_norms


def swap_attention(model: nn.Module, cfg: MethodConfig, softmax_layers=()) -> None:
    """Give each decoder layer not in `softmax_layers` the attention of `cfg`'s method, keeping the
    teacher's projections, and replace the teacher's RMSNorms by the fused op (`norms.fuse_norms`)."""
    fuse_norms(model)
    softmax_layers = set(softmax_layers)
    attention_class = ATTENTION_CLASSES[method_name(cfg)]
    for idx, layer in enumerate(model.model.layers):
        if idx not in softmax_layers and not isinstance(layer.self_attn, LinearizedAttention):
            layer.self_attn = attention_class(layer.self_attn, cfg, model.config)


def spec_method_config(spec: dict) -> MethodConfig:
    """The typed method config of a checkpoint's `linearize` settings (its config.json: an edge, parsed here)."""
    return make_method_config(spec["method"], **spec.get("options", {}))


def method_config_of(model: nn.Module) -> MethodConfig:
    """The method config a linearized model runs: the one its linearized layers share, or for a model
    with none (every layer softmax), its checkpoint settings' own."""
    for layer in model.model.layers:
        if isinstance(layer.self_attn, LinearizedAttention):
            return layer.self_attn.cfg
    return spec_method_config(model.config.linearize)


def _linearized_classes(model_type: str, config_class: type, model_class: type) -> tuple[type, type]:
    """`Linearized<Teacher>Config` (model_type `linearized_<teacher's>`, one more field, `linearize`) and
    `Linearized<Teacher>ForCausalLM` (the teacher's model with its attention swapped on construction)."""
    config_name, model_name = f"Linearized{config_class.__name__}", f"Linearized{model_class.__name__}"
    linearized_config = strict(type(config_name, (config_class,), {
        "__module__": __name__, "__qualname__": config_name, "__annotations__": {"linearize": dict | None},
        "model_type": f"linearized_{model_type}", "linearize": None,
    }))

    def __init__(self, config):
        model_class.__init__(self, config)
        spec = config.linearize
        swap_attention(self, spec_method_config(spec), spec.get("softmax_layers", []))

    linearized_model = type(model_name, (model_class,), {
        "__module__": __name__, "__qualname__": model_name, "config_class": linearized_config, "__init__": __init__,
    })
    return linearized_config, linearized_model


def undistilled_note(config) -> str | None:
    """A one-line note for a linearized model that no distillation has trained (its new attention
    starts from scratch: it writes garbage); None otherwise, and for checkpoints without the field."""
    spec = getattr(config, "linearize", None)
    if isinstance(spec, dict) and spec.get("distilled") is False:
        return (f"linearize: note: this {spec.get('method', 'linearized')} model was converted but not distilled, so "
                "its new attention is untrained and its text will be garbage; `linearize distill` trains it")
    return None


# teacher model_type -> (linearized config class, linearized model class)
LINEARIZED_CLASSES = {model_type: _linearized_classes(model_type, arch.config_class, arch.model_class)
                      for model_type, arch in ARCHITECTURES.items()}
# Module-level names, so that pickling and `transformers`' dynamic lookups find each class.
globals().update({cls.__name__: cls for pair in LINEARIZED_CLASSES.values() for cls in pair})

for _config_class, _model_class in LINEARIZED_CLASSES.values():
    AutoConfig.register(_config_class.model_type, _config_class, exist_ok=True)
    AutoModelForCausalLM.register(_config_class, _model_class, exist_ok=True)
