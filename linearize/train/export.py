"""The end of a run: the final model, stage 2's LoRA merged, written into the run folder as a loadable model."""

from __future__ import annotations

import torch

from ..cli_args import normal_permissions
from .run_dir import LORA_NAME, STAGE1_NAME
from .student import build_student, linearized_layers, prepare_stage


def export(run) -> None:
    """Write the final model (LoRA merged) of `run` (a `distillation.Run`) as a loadable directory, on the
    main rank."""
    if not run.rt.main:
        return
    # In float32 whatever the run's precision: the saved model is the teacher's weights in float32
    # with the trained tensors (float32 master weights) merged in.
    model = build_student(run.cfg, run.out / STAGE1_NAME, run.softmax_layers())
    lora_path = run.out / LORA_NAME
    if lora_path.exists() and 2 in run.cfg.stages:
        model, _ = prepare_stage(model, run.cfg, 2)
        model.load_state_dict(torch.load(lora_path, map_location="cpu"), strict=False)
        model = model.merge_and_unload()
    for layer in linearized_layers(model):
        layer.attention_transfer = False
    model.config.linearize = {**model.config.linearize, "distilled": True}  # convert wrote false
    model.save_pretrained(run.out)
    run.tokenizer.save_pretrained(run.out)
    normal_permissions(run.out)  # safetensors writes model.safetensors 0600
