"""Where a run executes: one process, or one rank of `torchrun` with FSDP2."""

from __future__ import annotations

import os
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..cli_args import default_device


@dataclass
class Runtime:
    rank: int
    world_size: int
    device: torch.device
    bf16: bool

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    @classmethod
    def start(cls, device: str | None, precision: str) -> Runtime:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        if world_size > 1 and device != "cpu" and torch.cuda.is_available():
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local_rank)
            dist.init_process_group("nccl")
            target = torch.device("cuda", local_rank)
        elif world_size > 1:  # CPU ranks (gloo): slow, but how the multi-rank path is tested without GPUs
            dist.init_process_group("gloo")
            target = torch.device("cpu")
        else:
            target = torch.device(default_device(device))
            if target.type == "cuda" and not torch.cuda.is_available():
                raise ValueError(f"--device {device}: no CUDA device here")
        bf16 = precision == "bf16" or (precision == "auto" and target.type == "cuda")
        return cls(rank=rank, world_size=world_size, device=target, bf16=bf16)

    def autocast(self, cache: bool = True):
        """bf16 autocast where the run is bf16; `cache=False` for a CUDA-graph capture, which must not
        keep autocast's casts of the weights across steps."""
        if not self.bf16:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16, cache_enabled=cache)

    def mean(self, value: float) -> float:
        return self.means([value])[0]

    def means(self, values: list[float]) -> list[float]:
        """Each value's mean over the ranks, in one all-reduce."""
        if not self.distributed:
            return list(values)
        t = torch.tensor(values, device=self.device, dtype=torch.float64)
        dist.all_reduce(t)
        return (t / self.world_size).tolist()

    def average_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """Mean of each gradient over the ranks (for replicated, unsharded models)."""
        if self.distributed:
            average_gradients(params, self.world_size)

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def stop(self) -> None:
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()


def average_gradients(params: list[torch.nn.Parameter], world_size: int) -> None:
    """Mean of each gradient over the default group's `world_size` ranks, in one all-reduce; a CUDA graph
    can hold it (no host reads)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat)
    flat /= world_size
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))


def shard(model: torch.nn.Module, reshard_after_forward: bool = True, replicate: bool = False) -> None:
    """FSDP2: each decoder layer is its own unit, the causal LM the root.

    The root must be the whole causal LM (under peft: its base model) so that tied input/output
    embeddings stay in one unit, and every forward must enter through it. `reshard_after_forward=False`
    keeps each layer gathered from its forward to its backward: one all-gather a step instead of two,
    for a whole model's worth of memory. `replicate` shards over one rank only (HSDP on a
    [world, 1] mesh): every rank keeps whole weights and only gradients cross ranks, in one
    all-reduce per unit, which suits a model that fits on one GPU with few trained parameters (LoRA).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    mesh = None
    if replicate:
        device_type = next(causal_lm.parameters()).device.type
        mesh = init_device_mesh(device_type, (dist.get_world_size(), 1), mesh_dim_names=("replicate", "shard"))
    for layer in causal_lm.get_decoder().layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(causal_lm, mesh=mesh, reshard_after_forward=reshard_after_forward)
