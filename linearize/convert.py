"""`convert(model, method, **options)`: swap a teacher's attention in place; `set_inference_options`:
change a linearized model's forward-only options (STILL's budget, say) after training."""

from __future__ import annotations

from transformers import PreTrainedModel

from .architectures import architecture_of, layers_kept_softmax
from .attention import LinearizedAttention
from .config import (
    ConfigError,
    MethodConfig,
    check_fits_positions,
    checked_method_config,
    make_method_config,
    method_name,
    method_options,
    with_inference_options,
)
from .modeling import LINEARIZED_CLASSES, method_config_of, swap_attention


class UnsupportedModelError(ValueError):
    """The model's architecture has no linearized counterpart."""


def convert(model: PreTrainedModel, method: str | MethodConfig, softmax_layers=None, layers: str = "all",
            **options) -> PreTrainedModel:
    """Linearize `model` in place and return it.

    Every decoder layer not listed in `softmax_layers` gets `method`'s attention, built around the
    teacher's q/k/v/o projections. `method` is a method's name, with `options` overriding its defaults
    (parsed here, as `make_method_config` does: strings allowed), or a typed config (`LizardConfig(...)`,
    what the CLI, recipes and distill pass down), with no `options` beside it; a window, chunk or budget longer than the model's positions is refused (`check_fits_positions`).
    `layers="full"` keeps the teacher's sliding-window layers (Gemma's five in six) as they are, also
    in constant memory, and linearizes its full-attention layers only. The model becomes the matching
    `Linearized*ForCausalLM`, so it saves and loads as one.
    """
    model_type = model.config.model_type
    if getattr(model.config, "linearize", None):
        raise UnsupportedModelError(f"the model is already linearized ({model.config.linearize['method']}); "
                                    "convert its teacher instead")
    try:
        architecture_of(model.config)
        kept = layers_kept_softmax(model.config, layers)
    except ValueError as e:
        raise UnsupportedModelError(str(e)) from None
    cfg = method_config(method, options)
    check_fits_positions(cfg, model.config)
    num_layers = model.config.num_hidden_layers
    softmax_layers = sorted({int(i) for i in (softmax_layers or [])})
    bad = [i for i in softmax_layers if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"softmax layer indices {bad} out of range: the model has {num_layers} layers")
    softmax_layers = sorted(set(softmax_layers) | set(kept))

    # distilled: false until distill exports the trained model (`modeling.undistilled_note`)
    spec = {"method": method_name(cfg), "options": method_options(cfg), "softmax_layers": softmax_layers, "layers": layers,
            "distilled": False}
    config_class, model_class = LINEARIZED_CLASSES[model_type]
    teacher_config = model.config
    fields = {k: v for k, v in teacher_config.to_dict().items() if k != "model_type"}
    config = config_class(**fields, linearize=spec)
    config._attn_implementation = teacher_config._attn_implementation
    for module in model.modules():
        if getattr(module, "config", None) is teacher_config:
            module.config = config
    model.__class__ = model_class
    swap_attention(model, cfg, softmax_layers)
    return model


def method_config(method: str | MethodConfig, options: dict) -> MethodConfig:
    """`convert`'s method as a typed config: parsed from a name and its options, or a typed one checked."""
    if isinstance(method, str):
        return make_method_config(method, **options)
    if options:
        raise ConfigError(f"options {', '.join(sorted(options))} given beside a {type(method).__name__}: "
                          "set them in the config instead")
    return checked_method_config(method)


def check_layer_choice(num_layers: int, method: str, softmax_layers=(), kept=(),
                       softmax_by: str | None = None) -> None:
    """Refuse a command's choice of softmax layers that leaves no layer for `method` (ConfigError):
    `softmax_layers` naming every layer, `kept` (the sliding layers `--layers full` keeps) all of them,
    or `softmax_by` ("RULE:N", as `DistillConfig` checked it) choosing N more layers back to softmax
    than stay linear: they choose among the linearized layers only. Indices out of range are refused
    too. (`convert` itself accepts an all-softmax model.)"""
    chosen = sorted({int(i) for i in softmax_layers or ()})
    bad = [i for i in chosen if not 0 <= i < num_layers]
    if bad:
        raise ConfigError(f"--softmax-layers {','.join(map(str, bad))}: out of range, the model has {num_layers} "
                          f"layers (0 to {num_layers - 1})")
    if kept and len(kept) == num_layers:
        raise ConfigError(f"--layers full: every one of the model's {num_layers} layers is a sliding-window layer, "
                          "so none is left to linearize; use --layers all")
    linear = num_layers - len(set(chosen) | set(kept))
    if linear == 0:
        raise ConfigError(f"--softmax-layers names all {num_layers} of the model's layers: no layer left to "
                          f"linearize with {method}")
    if not softmax_by:
        return
    count = int(softmax_by.rpartition(":")[2])
    if count >= linear:
        raise ConfigError(f"--softmax-by {softmax_by}: the model has {linear} linearized layer(s), so it would "
                          f"leave no layer to {method}; pick fewer than {linear}")


def kept_sliding_layers(config, layers: str) -> list[int]:
    """The sliding layers `layers` ("all" or "full") keeps softmax, for `check_layer_choice`; none for a
    model type `convert` does not take (it names the type itself)."""
    try:
        architecture_of(config)
    except ValueError:
        return []
    return layers_kept_softmax(config, layers)


def set_inference_options(model: PreTrainedModel, **options) -> PreTrainedModel:
    """Change, in place, options of a linearized model that shape its forward pass but none of its
    weights (`config.INFERENCE_OPTIONS`: STILL's budget, max_chunks and routing; Lizard's window and
    gate_temperature), in every linearized layer and in `model.config.linearize`, so generation,
    evaluation (its provenance) and a later `save_pretrained` all use them. Values may be strings, as
    from the command line."""
    spec = getattr(model.config, "linearize", None)
    if not spec:
        raise ConfigError("inference options change a linearized model; this one has softmax attention only")
    cfg = with_inference_options(method_config_of(model), options)
    check_fits_positions(cfg, model.config)
    for layer in model.model.layers:
        if isinstance(layer.self_attn, LinearizedAttention):
            layer.self_attn.cfg = cfg
    model.config.linearize = {**spec, "options": method_options(cfg)}
    return model
