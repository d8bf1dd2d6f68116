"""The student: the teacher converted for distillation, the dtypes it is held in, and what each stage trains.

Frozen weights stay in the dtype the teacher was loaded in (`weights_dtype`); what a stage trains is
float32 (`upcast_to_float32`): the new modules in stage 1, peft's LoRA adapters in stage 2 (`prepare_stage`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from .config import DistillConfig
from .run_dir import ResumeError
from .runtime import Runtime


def linearized_layers(model) -> list:
    from ..attention import LinearizedAttention

    return [m for m in model.modules() if isinstance(m, LinearizedAttention)]


def upcast_to_float32(params) -> None:
    """Parameters in float32, whatever the model was built in: AdamW steps trained ones there (a bf16
    update of ~lr times a weight rounds to nothing). In place (`.data`), so a module, peft or an optimizer
    holding a parameter keeps holding it."""
    for p in params:
        if p.dtype != torch.float32:
            p.data = p.data.float()


def weights_dtype(rt: Runtime, sharded: bool) -> torch.dtype:
    """The dtype the teacher is loaded and its frozen weights held in: bf16 for a bf16-autocast run, where
    every matmul takes its weights in bf16 anyway, so a frozen weight needs no float32 copy (an 8B teacher:
    16 GB less, on the host while loading and on the device), nor a cast at each call (autocast caches
    casts of trained weights only). Every bf16 run but an FSDP2 one (a CPU run with --precision bf16 too)
    loads so, and so no frozen weight needs a cast after the load. float32 otherwise, and under FSDP2
    (`sharded`), which shards a layer's parameters in one dtype: there the float32 trained ones set the
    dtype of all. What trains is float32 either way (`prepare_stage`), and so are buffers such as RoPE's
    frequencies, which loading and `upcast_to_float32` leave alone (no `model.to(dtype)` anywhere)."""
    return torch.bfloat16 if rt.bf16 and not sharded else torch.float32


def linearized_student(teacher, cfg: DistillConfig, softmax_layers: list[int] | None = None):
    """`convert` the teacher as `cfg` says (softmax in `softmax_layers`, default the config's), its new
    modules float32 whatever the teacher's dtype: stage 1 trains them, and stage 2, which freezes them,
    then runs the very modules stage 1 trained and the export saves, not bf16 roundings of them. `convert`
    builds them in the teacher's dtype, so from a bf16 teacher they start at bf16 roundings of their
    initial values (LoLCATs' window factor 0.1 at 0.1001), no worse an init."""
    from ..convert import convert

    softmax_layers = cfg.softmax_layers if softmax_layers is None else softmax_layers
    model = convert(teacher, cfg.method_config, softmax_layers=softmax_layers, layers=cfg.layers)
    upcast_to_float32(p for layer in linearized_layers(model) for p in layer.new_parameters())
    return model


def new_parameter_names(model) -> set[str]:
    ids = {id(p) for layer in linearized_layers(model) for p in layer.new_parameters()}
    return {name for name, p in model.named_parameters() if id(p) in ids}


def parameter_groups(model, cfg: DistillConfig, stage: int) -> list[dict]:
    """The trained parameters at the stage's lr; in stage 1, the per-head scalars at `head_lr_scale` times it."""
    params = [p for p in model.parameters() if p.requires_grad]
    lr = cfg.lr(stage)
    scalars = {id(p) for layer in linearized_layers(model) for p in layer.head_scalars()}
    if stage != 1 or cfg.head_lr_scale == 1 or not scalars:
        return [{"params": params, "lr": lr}]
    return [{"params": [p for p in params if id(p) not in scalars], "lr": lr},
            {"params": [p for p in params if id(p) in scalars], "lr": lr * cfg.head_lr_scale}]


def prepare_stage(model, cfg: DistillConfig, stage: int):
    """Freeze what this stage does not train and hold what it trains in float32 (`upcast_to_float32`);
    returns (model to call, names of trained parameters)."""
    for layer in linearized_layers(model):
        layer.attention_transfer = stage == 1
        layer.far_weight = cfg.far_weight if stage == 1 else 0.0
    if stage == 1:
        names = new_parameter_names(model)
    else:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                          target_modules=list(cfg.lora_targets), bias="none", task_type="CAUSAL_LM")
        model = get_peft_model(model, lora)
        names = {name for name, p in model.named_parameters() if "lora_" in name}
    for name, p in model.named_parameters():
        p.requires_grad_(name in names)
    upcast_to_float32(p for p in model.parameters() if p.requires_grad)
    if cfg.gradient_checkpointing:
        enable_checkpointing(model)
    if not names:
        raise ValueError(f"stage {stage} of {cfg.method} has nothing to train")
    return model, names


def enable_checkpointing(model) -> None:
    """Activation checkpointing per decoder layer, non-reentrant. HF's `gradient_checkpointing_enable`
    also makes the input embeddings' output require a gradient, which only reentrant checkpointing
    needs. In stage 1, where each layer's loss depends on that layer alone, it would send a gradient
    down the whole residual stream, through every MLP and projection of the teacher."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.disable_input_require_grads()


def build_student(cfg: DistillConfig, stage1_path: Path | None, softmax_layers: list[int] | None = None,
                  dtype: torch.dtype = torch.float32):
    """Teacher, loaded in `dtype` (`weights_dtype`) -> linearized student (`linearized_student`: its new
    modules float32), with stage-1 modules if they exist.

    `softmax_layers` (default: the config's) may hold more layers than stage 1 had; their stage-1
    modules are then left out.
    """
    from ..loading import load_model

    softmax_layers = cfg.softmax_layers if softmax_layers is None else softmax_layers
    model = linearized_student(load_model(cfg.model, dtype=dtype), cfg, softmax_layers)
    if stage1_path is not None and stage1_path.exists():
        reverted = tuple(f".layers.{i}." for i in set(softmax_layers) - set(cfg.softmax_layers))
        tensors = {name: t for name, t in torch.load(stage1_path, map_location="cpu").items()
                   if not any(r in f".{name}" for r in reverted)}
        unexpected = model.load_state_dict(tensors, strict=False).unexpected_keys
        if unexpected:
            raise ResumeError(f"{stage1_path} does not match this model: unexpected {unexpected[:3]}")
    return model
