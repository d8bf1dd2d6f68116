"""What a distillation step keeps for its backward outside the activation checkpoints, and whether its
memory stays flat across steps, on a tiny model of the Llama-3-8B shape's family (any machine).

    TRITON_INTERPRET=1 python -m experiments.scripts.stage1_checkpoint_memory   # the kernels, interpreted
    python -m experiments.scripts.stage1_checkpoint_memory                      # the PyTorch forms (CPU)

For stages 1 and 2 (the recipes' Lizard), with gradient checkpointing off and on: the bytes of the
distinct storages autograd saves during the step's forward outside any checkpoint (a saved-tensor hook
around the loss; tensors saved inside a checkpointed layer go to the checkpoint's own hook instead),
then the bytes of all live tensors after each of a few steps, checkpointing off and on (gradients and
the optimizer's state appear after the first; more after later steps would be a leak, and more with
checkpointing than without it, activations that the checkpoints' recomputation left behind).
"""

from __future__ import annotations

import argparse
import contextlib
import gc

import torch

from linearize.bench.shapes import random_model
from linearize.train.config import DistillConfig
from linearize.train.losses import stage_loss
from linearize.train.runtime import Runtime
from linearize.train.step import TrainStep, make_optimizer
from linearize.train.student import linearized_student, prepare_stage

TINY = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8,
        "num_key_value_heads": 2, "vocab_size": 1000}
MIB = 2**20


def student(stage: int, checkpointing: bool, batch: int, seq_len: int):
    cfg = DistillConfig(model="llama3-8b", method="lizard", out="unused", seq_len=seq_len, batch=batch,
                        gradient_checkpointing=checkpointing, options={"combine": "shared", "rope_in_window": True})
    model = linearized_student(random_model("llama3-8b", **TINY), cfg)
    model, _ = prepare_stage(model, cfg, stage)
    return model.train()


def saved_outside_checkpoints(stage: int, checkpointing: bool, ids: torch.Tensor) -> float:
    model = student(stage, checkpointing, *ids.shape)
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = stage_loss(model, ids, stage)
    loss.backward()
    return sum(storages.values()) / MIB


def live_tensor_bytes() -> float:
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        with contextlib.suppress(Exception):  # objects that fail isinstance checks mid-teardown
            if torch.is_tensor(obj):
                storages[obj.untyped_storage().data_ptr()] = obj.untyped_storage().nbytes()
    return sum(storages.values()) / MIB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    ids = torch.randint(TINY["vocab_size"], (args.batch, args.seq_len))
    for stage in (1, 2):
        for checkpointing in (False, True):
            mib = saved_outside_checkpoints(stage, checkpointing, ids)
            print(f"stage {stage}, checkpointing {'on' if checkpointing else 'off'}: "
                  f"{mib:.2f} MiB saved outside the checkpoints")
    rt = Runtime.start("cpu", "auto")  # float32, no autocast: the models above are built on the CPU
    for stage, checkpointing in ((1, False), (1, True), (2, False), (2, True)):
        model = student(stage, checkpointing, *ids.shape)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = make_optimizer([{"params": params, "lr": 1e-3}], rt.device, cuda_graph=False)
        step = TrainStep(lambda ids, model=model, stage=stage: stage_loss(model, ids, stage), params, optimizer,
                         1.0, rt.autocast, cuda_graph=False)
        sizes = [live_tensor_bytes()]
        for _ in range(args.steps):
            step([ids])
            sizes.append(live_tensor_bytes())
        print(f"stage {stage}, checkpointing {'on' if checkpointing else 'off'}: live tensors before and after each step "
              + ", ".join(f"{s:.2f}" for s in sizes) + " MiB")
        del model, step, optimizer, params


if __name__ == "__main__":
    main()
