"""Two-stage distillation: stage 1 attention transfer, stage 2 LoRA, checkpointed and resumable.

A run's parts, each in its own module: `Run` here sets it up (its checks, tokenizer, data and loaders) and
holds what the parts share; `stage_loop.train_stage` trains one stage (stage 1 the new modules on each
layer's softmax output, stage 2 LoRA adapters on next-token cross-entropy); `resume` says whether `out` may
start or continue a run and keeps a stage's resumable state; `layer_selection` writes the stage-1 layer
scores and, with softmax_by kl:N, picks the layers (`KLSelection`); `export.export` writes the final model.

Run directory (`out`): the final loadable model, `distill_config.json`, `train_log.jsonl`,
`stage1_attention.pt` (new modules after stage 1), `stage1_layer_errors.json` (each linearized layer's
stage-1 scores and the layers `softmax_by` picked, `layer_selection.write_layer_scores` and
`KLSelection`; its figure `stage1_layer_errors.png`) and `checkpoint/` (the latest resumable state).
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from .config import DistillConfig
from .export import export
from .layer_selection import KLSelection, even_layers
from .losses import TrainingDiverged
from .resume import check_resume
from .run_dir import (
    CONFIG_NAME,
    LAYER_ERRORS_NAME,
    LOG_NAME,
    STAGE1_NAME,
    check_same_run,
    check_saved_run,
    is_finished,
    nothing_to_resume,
    stage1_source,
)
from .runtime import Runtime
from .stage_loop import train_stage

__all__ = ["Run", "TrainingDiverged", "cpu_budget_note", "distill", "ensure_distilled"]


# Training tokens/s of SmolLM2-135M on 2 CPU cores, by stage (`linearize demo`'s run: a step of 4 x 256
# tokens takes ~3 s in stage 1 and ~6 s in stage 2). Larger teachers and longer sequences are slower.
CPU_TOKENS_PER_S = {1: 340.0, 2: 170.0}
CPU_NOTE_AFTER_S = 20 * 60  # a CPU budget estimated to take longer gets a note before anything starts


def cpu_budget_note(cfg: DistillConfig, threads: int) -> str | None:
    """What a CPU run of `cfg`'s budget will take, and what to pass for a short one; None if it is short."""
    tokens = cfg.steps() * cfg.batch * cfg.seq_len
    seconds = sum(tokens / (CPU_TOKENS_PER_S[stage] * max(1, threads) / 2) for stage in cfg.stages)
    if seconds <= CPU_NOTE_AFTER_S:
        return None
    took = f"{seconds / 3600:,.0f} hours" if seconds >= 2 * 3600 else f"{seconds / 60:,.0f} minutes"
    return (f"distill on a CPU ({threads} threads): {tokens:,} tokens a stage will take about {took} or more "
            f"(SmolLM2-135M trains at ~{CPU_TOKENS_PER_S[1]:.0f} tokens/s in stage 1 and ~{CPU_TOKENS_PER_S[2]:.0f} "
            "in stage 2 on 2 cores; larger teachers are slower). For a first run pass --max-tokens 49152 "
            "--seq-len 256 --batch 4 (about 8 minutes on 2 cores, what `linearize demo` trains).")


class Run:
    """One distillation run's setup and what its parts share: the config, the run folder, the runtime (ranks,
    device, precision), the tokenizer, the packed data and its loaders, the config file and the log."""

    def __init__(self, cfg: DistillConfig, resume: bool, progress: bool):
        from ..data import DataError, ResumableLoader, build_token_blocks
        from ..loading import load_tokenizer

        self.cfg = cfg
        self.out = Path(cfg.out).expanduser()
        self.rt = Runtime.start(cfg.device, cfg.precision)
        self.progress = progress and self.rt.main
        check_resume(cfg, self.out, resume)
        # A run that took its stage 1 already (then was interrupted) no longer needs the source.
        self.stage1_source = stage1_source(cfg) if cfg.stage1_from and not self.took_stage1() else None
        micro = cfg.batch // cfg.grad_accum
        if micro % self.rt.world_size:
            raise ValueError(f"batch / grad_accum ({micro}) must be divisible by the {self.rt.world_size} ranks")
        self._check_teacher()
        note = cpu_budget_note(cfg, torch.get_num_threads()) if self.rt.device.type == "cpu" else None
        if note and self.rt.main:
            print(note, file=sys.stderr, flush=True)  # before the data and model loads: minutes on a CPU
        torch.manual_seed(cfg.seed)
        self.tokenizer = load_tokenizer(cfg.model)
        if self.tokenizer.eos_token_id is None:
            raise ValueError(f"{cfg.model}: its tokenizer has no EOS token, which packing needs between documents")
        self.train_blocks, self.val_blocks = build_token_blocks(cfg.data, self.tokenizer, cfg.seq_len,
                                                                max_tokens=cfg.max_tokens, seed=cfg.seed)
        if cfg.recall_share:
            from ..data.recall import with_recall

            # Validation stays the data alone, so its loss compares with runs without recall documents.
            self.train_blocks = with_recall(self.train_blocks, self.tokenizer, cfg.recall_share, seed=cfg.seed)
        checks = [("training", self.train_blocks, cfg.seq_len, "--seq-len"),
                  ("validation", self.val_blocks, cfg.seq_len, "--seq-len")]
        # KL-guided selection's own validation sequences at kl_seq_len: packed (and checked) before any work.
        self.kl_blocks = self.val_blocks
        if cfg.kl_seq_len and cfg.kl_seq_len != cfg.seq_len:
            try:
                _, self.kl_blocks = build_token_blocks(cfg.data, self.tokenizer, cfg.kl_seq_len, seed=cfg.seed)
            except DataError as e:
                raise DataError(f"--kl-seq-len {cfg.kl_seq_len}: {e}") from None
            checks.append(("KL validation", self.kl_blocks, cfg.kl_seq_len, "--kl-seq-len"))
        for split, blocks, length, flag in checks:
            if len(blocks) < micro:
                raise ValueError(f"--data {cfg.data}: {len(blocks)} {split} sequence(s) of {length} tokens, "
                                 f"fewer than one batch of {micro}: give more data, or a smaller --batch or {flag}")
        # The run's config is written once the first stage has built its student (`save_config`): a start refused
        # for bad input (the tokenizer, the data, what `convert` refuses) leaves no run behind that a
        # corrected command would have to --resume.
        self.config_saved = False
        self.make_loader = lambda blocks, seed: ResumableLoader(blocks, micro, seed=seed, rank=self.rt.rank,
                                                                world_size=self.rt.world_size)

    def _check_teacher(self) -> None:
        """What `convert` would refuse once stage 1 builds the student (a model already linearized, an
        architecture it does not take, bad method options), and softmax layers that leave no layer linear:
        checked on the teacher's config, before anything is written."""
        from ..architectures import architecture_of
        from ..config import check_fits_positions
        from ..convert import UnsupportedModelError, check_layer_choice, kept_sliding_layers
        from ..loading import load_config

        config = load_config(self.cfg.model)
        spec = getattr(config, "linearize", None)
        if spec:  # as `convert` words it
            raise UnsupportedModelError(f"the model is already linearized ({spec['method']}); "
                                        "convert its teacher instead")
        try:
            architecture_of(config)
        except ValueError as e:
            raise UnsupportedModelError(str(e)) from None
        check_fits_positions(self.cfg.method_config, config)
        layers = getattr(config, "num_hidden_layers", None)
        # The layers softmax from the start: the config's, and with softmax_by even:N those it picks.
        self.preset_softmax = sorted(self.cfg.softmax_layers)
        if layers is not None:
            kept = kept_sliding_layers(config, self.cfg.layers)
            check_layer_choice(layers, self.cfg.method, self.cfg.softmax_layers, kept=kept,
                               softmax_by=self.cfg.softmax_by)
            selection = self.cfg.selection
            if selection is not None and selection[0] == "even":
                linearized = sorted(set(range(layers)) - set(self.cfg.softmax_layers) - set(kept))
                self.preset_softmax = sorted(set(self.preset_softmax) | set(even_layers(linearized, selection[1])))

    def save_config(self) -> None:
        """`CONFIG_NAME`, once per invocation: when the first stage has its student, or takes its stage 1."""
        if self.config_saved:
            return
        self.config_saved = True
        # Every rank has checked before rank 0 writes: otherwise a late rank finds rank 0's config and refuses.
        self.rt.barrier()
        if self.rt.main:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / CONFIG_NAME).write_text(self.cfg.to_json())
        self.rt.barrier()

    def log(self, record: dict) -> None:
        if self.rt.main:
            with open(self.out / LOG_NAME, "a") as f:
                f.write(json.dumps(record) + "\n")

    def took_stage1(self) -> bool:
        # The record is written last: a run cut while taking takes again.
        return (self.out / STAGE1_NAME).exists() and (self.out / LAYER_ERRORS_NAME).exists()

    def validation_batches(self, blocks=None) -> Iterator[torch.Tensor]:
        """This rank's first `val_batches` batches of `blocks` (default: the validation blocks), on its device."""
        loader = self.make_loader(self.val_blocks if blocks is None else blocks, seed=0)
        return (ids.to(self.rt.device) for _, ids in zip(range(self.cfg.val_batches), loader))

    def softmax_layers(self) -> list[int]:
        """The layers softmax in stage 2 and the final model: those softmax from the start plus, with
        softmax_by error:N or kl:N, those picked after stage 1."""
        if self.cfg.selection_rule in (None, "even"):
            return list(self.preset_softmax)
        record = json.loads((self.out / LAYER_ERRORS_NAME).read_text())
        return sorted(set(self.preset_softmax) | set(record["picked"]))


def distill(cfg: DistillConfig, *, resume: bool = False, progress: bool = True) -> Path:
    """Run the configured stages and write the final model into `cfg.out`; returns that directory.
    Resuming a finished run (same settings) does nothing."""
    if resume and is_finished(cfg.out):
        check_same_run(cfg)
        return Path(cfg.out).expanduser()
    out = Path(cfg.out).expanduser()
    made_out = not out.exists()
    run = Run(cfg, resume, progress)
    try:
        for stage in cfg.stages:
            train_stage(run, stage)
            if stage == 1:
                KLSelection(run).select()
        export(run)
        run.rt.barrier()
    except (TrainingDiverged, KeyboardInterrupt):
        # A run stopped (diverged, interrupted) before its first checkpoint holds nothing a command could
        # resume (a changed --lr is a new run; a rerun would only be told to pass --resume): its folder goes
        # back to how it was, as a refused start leaves it.
        if run.rt.main and nothing_to_resume(out):
            if made_out:
                shutil.rmtree(out, ignore_errors=True)
            else:
                for name in (CONFIG_NAME, LOG_NAME):
                    (out / name).unlink(missing_ok=True)
        raise
    finally:
        run.rt.stop()
    return run.out


def ensure_distilled(cfg: DistillConfig, *, progress: bool = True) -> None:
    """Distil into `cfg.out` unless it already holds the finished model, resuming an interrupted run there;
    a run there with other settings is refused (ResumeError), finished or not."""
    out = Path(cfg.out).expanduser()
    check_saved_run(cfg)
    if not (out / "config.json").exists():  # written by the export, last
        distill(cfg, resume=(out / CONFIG_NAME).exists(), progress=progress)
