"""Resuming a run: whether `--out` may start or continue one, and a stage's resumable state in `checkpoint/`
(its step, tokens, scheduler, data position and random state, with the model's trained tensors and the
optimizer's), saved by the main rank and restored on every rank."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from . import checkpoint
from .config import DistillConfig
from .run_dir import CHECKPOINT_NAME, CONFIG_NAME, ResumeError, check_same_run
from .step import rates_on_device


def check_resume(cfg: DistillConfig, out: Path, resume: bool) -> None:
    """Refuse a start over a run (or over other files) without `resume`, and a resume with other settings."""
    ckpt, saved = out / CHECKPOINT_NAME, out / CONFIG_NAME
    if resume:
        check_same_run(cfg)
    elif ckpt.exists() or saved.exists():
        raise ResumeError(f"{out} already holds a run; pass --resume to continue it or pick a new --out")
    elif out.exists() and not out.is_dir():
        raise ResumeError(f"output {out} already exists and is a file: pick a new --out")
    elif out.is_dir() and any(out.iterdir()):
        # As convert refuses it: the run's files would land beside (and over) whatever is there.
        raise ResumeError(f"output {out} already exists and is a folder that is not empty (and holds "
                          "no run): pick a new --out")


def saved_stage(ckpt_path: Path, stage: int) -> tuple[bool, dict | None]:
    """(whether an earlier invocation finished `stage`, the state to resume it from or None)."""
    state = checkpoint.load(ckpt_path) if ckpt_path.exists() else None
    if state is not None and (state["stage"] > stage or (state["stage"] == stage and state["stage_done"])):
        return True, None
    return False, state if state is not None and state["stage"] == stage else None


@dataclass
class StageCheckpoint:
    """One stage's resumable state: what it trains with, and how far it got. `mark` takes the data position
    and random state after a step, which a later `save` writes (validation between them draws neither)."""

    path: Path
    stage: int
    model: object
    optimizer: object
    scheduler: object
    loader: object
    names: set[str]
    sharded: bool
    main: bool
    step: int = 0
    tokens: int = 0
    snapshot: dict = field(default_factory=dict)

    def restore(self, state: dict, device) -> None:
        """Continue from `state` (`saved_stage`'s): every rank's model, optimizer, scheduler and data position."""
        checkpoint.restore(state, model=self.model, optimizer=self.optimizer, distributed=self.sharded)
        if self.optimizer.defaults["capturable"]:
            rates_on_device(self.optimizer, device)
        self.scheduler.load_state_dict(state["scheduler"])
        self.loader.load_state_dict(state["loader"])
        self.step, self.tokens = state["step"], state["tokens"]

    def mark(self) -> None:
        self.snapshot = {"loader": self.loader.state_dict(), "rng": checkpoint.rng_state()}

    def save(self, done: bool = False) -> None:
        meta = {"stage": self.stage, "step": self.step, "tokens": self.tokens,
                "scheduler": self.scheduler.state_dict(), "loader": self.snapshot["loader"],
                "rng": self.snapshot["rng"], "stage_done": done}
        checkpoint.save(self.path, model=self.model, optimizer=self.optimizer, names=self.names, meta=meta,
                        distributed=self.sharded, main=self.main)
