"""Checkpoints that let `--resume` continue bit-for-bit: trained tensors, optimizer, schedule, data, RNG.

A checkpoint is one directory written beside the old one and renamed over it, so an interruption
while saving leaves the previous checkpoint intact. Tensors are gathered to full (unsharded) form,
so a run can resume under a different world size.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)


def _options(distributed: bool, loading: bool = False) -> StateDictOptions:
    if loading:
        return StateDictOptions(full_state_dict=True, broadcast_from_rank0=distributed, strict=False)
    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def trained_tensors(model: torch.nn.Module, names: set[str], distributed: bool) -> dict[str, torch.Tensor]:
    """Full copies of the named parameters (all ranks must call this under FSDP)."""
    full = get_model_state_dict(model, options=_options(distributed))
    return {name: tensor for name, tensor in full.items() if name in names}


def save(path: Path, *, model, optimizer, names: set[str], meta: dict, distributed: bool, main: bool) -> None:
    tensors = trained_tensors(model, names, distributed)
    optim = get_optimizer_state_dict(model, optimizer, options=_options(distributed))
    if not main:
        return
    scratch = path.with_name(path.name + ".partial")
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    torch.save({"tensors": tensors, "optimizer": optim, **meta}, scratch / "state.pt")
    old = path.with_name(path.name + ".old")
    if path.exists():
        path.rename(old)
    scratch.rename(path)
    shutil.rmtree(old, ignore_errors=True)


def load(path: Path) -> dict:
    return torch.load(path / "state.pt", map_location="cpu", weights_only=False)


def restore(state: dict, *, model, optimizer, distributed: bool) -> None:
    set_model_state_dict(model, state["tensors"], options=_options(distributed, loading=True))
    set_optimizer_state_dict(model, optimizer, state["optimizer"], options=_options(distributed, loading=True))
    set_rng_state(state["rng"])
