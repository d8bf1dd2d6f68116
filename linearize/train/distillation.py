"""Two-stage distillation: stage 1 attention transfer, stage 2 LoRA, checkpointed and resumable.

Stage 1 trains only the new modules of every linearized layer to match that layer's softmax output
(MSE), all layers at once in one forward pass: each layer returns the teacher's output, so the next
layer sees teacher hidden states, and records its own error. No second model is held in memory.
Stage 2 trains peft LoRA adapters on q/k/v with next-token cross-entropy, then merges them.

Run directory (`out`): the final loadable model, `distill_config.json`, `train_log.jsonl`,
`stage1_attention.pt` (new modules after stage 1), `stage1_layer_errors.json` (each linearized layer's
stage-1 scores and the layers `softmax_by` picked, `Run.write_layer_scores` and `Run.select_by_kl`; its
figure `stage1_layer_errors.png`) and `checkpoint/` (the latest resumable state).
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..cli_args import normal_permissions, write_text_atomic
from . import checkpoint
from .config import DistillConfig
from .layer_report import write_layer_figure
from .layer_selection import (
    even_layers,
    kl_distillation_loss,
    kl_teacher_states,
    mean_kl,
    restored_layer_kl,
    teacher_final_states,
    top_layers,
)
from .losses import stage_loss
from .run_dir import (
    CHECKPOINT_NAME,
    CONFIG_NAME,
    KL_RECORD_KEYS,
    LAYER_ERRORS_NAME,
    LOG_NAME,
    STAGE1_NAME,
    ResumeError,
    check_same_run,
    check_saved_run,
    is_finished,
    nothing_to_resume,
    same_kl_scoring,
    stage1_source,
)
from .runtime import Runtime, shard
from .step import TrainStep, make_optimizer, rates_on_device
from .student import (
    linearized_layers,
    linearized_student,
    parameter_groups,
    prepare_stage,
    weights_dtype,
)


class TrainingDiverged(ValueError):
    """A stage's loss or gradient norm stopped being finite. Nothing is saved once it is seen: a checkpoint
    or model of non-finite weights would only fail later, in whatever loads it."""


@dataclass
class KLTeacher:
    """What KL-guided selection's trained candidates share (`Run.candidate_kl`): the teacher does not change
    between them, so its forwards run once. `training`: the K x grad_accum micro-batches each candidate
    trains on, each with `kl_teacher_states` on it; `validation`: the batches each is scored on, and
    `scored` the teacher's `teacher_final_states` on them. They stay on the device: a value per token and
    hidden unit (SmolLM2, 10 steps of 4 x 1,024 tokens: 94M values, 377 MB in float32)."""

    training: list[tuple[torch.Tensor, torch.Tensor]]
    validation: list[torch.Tensor]
    scored: list[torch.Tensor]


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


def lr_factor(step: int, total: int, warmup_ratio: float) -> float:
    """Linear warmup over the first warmup_ratio of steps, then cosine decay to zero."""
    warmup = max(1, int(total * warmup_ratio))
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


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


def forever(loader):
    while True:
        yield from loader


class Run:
    """One distillation run: data, logging and the stage loops."""

    def __init__(self, cfg: DistillConfig, resume: bool, progress: bool):
        from ..data import DataError, ResumableLoader, build_token_blocks
        from ..loading import load_tokenizer

        self.cfg = cfg
        self.out = Path(cfg.out).expanduser()
        self.rt = Runtime.start(cfg.device, cfg.precision)
        self.progress = progress and self.rt.main
        self._check_resume(resume)
        # A run that took its stage 1 already (then was interrupted) no longer needs the source.
        self.stage1_source = stage1_source(cfg) if cfg.stage1_from and not self.took_stage1() else None
        self.kl_teacher: KLTeacher | None = None  # `candidate_kl`'s, made by its first candidate
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

    def _check_resume(self, resume: bool) -> None:
        ckpt, saved = self.out / CHECKPOINT_NAME, self.out / CONFIG_NAME
        if resume:
            check_same_run(self.cfg)
        elif ckpt.exists() or saved.exists():
            raise ResumeError(f"{self.out} already holds a run; pass --resume to continue it or pick a new --out")
        elif self.out.exists() and not self.out.is_dir():
            raise ResumeError(f"output {self.out} already exists and is a file: pick a new --out")
        elif self.out.is_dir() and any(self.out.iterdir()):
            # As convert refuses it: the run's files would land beside (and over) whatever is there.
            raise ResumeError(f"output {self.out} already exists and is a folder that is not empty (and holds "
                              "no run): pick a new --out")

    def _check_teacher(self) -> None:
        """What `convert` would refuse once stage 1 builds the student (a model already linearized, an
        architecture it does not take, bad method options), and softmax layers that leave no layer linear:
        checked on the teacher's config, before anything is written."""
        from ..architectures import architecture_of
        from ..config import check_fits_positions, make_method_config
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
        check_fits_positions(make_method_config(self.cfg.method, **self.cfg.options), config)
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

    def validation_losses(self, model, stage: int) -> tuple[float, dict[int, float]]:
        """Mean validation loss and, in stage 1, each linearized layer's mean MSE {layer index: MSE}."""
        layers = linearized_layers(model) if stage == 1 else []
        totals, count = torch.zeros(1 + len(layers), dtype=torch.float64), 0
        model.eval()
        with torch.no_grad(), self.rt.autocast():
            for ids in self.validation_batches():
                loss = stage_loss(model, ids, stage)
                totals += torch.stack([loss, *(layer.transfer_loss for layer in layers)]).detach().double().cpu()
                count += 1
        model.train()
        means = self.rt.means((totals / max(1, count)).tolist())
        return means[0], {layer.layer_idx: mean for layer, mean in zip(layers, means[1:])}

    def stage(self, stage: int) -> None:
        cfg, rt = self.cfg, self.rt
        if stage == 1 and cfg.stage1_from:
            self.take_stage1()
            return
        ckpt_path = self.out / CHECKPOINT_NAME
        # The main rank alone writes checkpoints (the previous stage's last one just now): no rank reads
        # before it is done, or it finds the checkpoint between the old one's rename and the new one's.
        rt.barrier()
        state = checkpoint.load(ckpt_path) if ckpt_path.exists() else None
        if state is not None and (state["stage"] > stage or (state["stage"] == stage and state["stage_done"])):
            return  # finished in an earlier invocation
        state = state if state is not None and state["stage"] == stage else None

        # Stage 1's losses are taken inside each layer while the layer returns the teacher's output, so
        # FSDP2's unshard-for-backward hooks (set on layer outputs) never fire: there, every rank keeps a
        # whole replica and the few trained parameters' gradients are averaged by hand (one all-reduce,
        # which a CUDA graph can hold; FSDP2's hooks cannot be captured). Stage 2 does so too with fsdp=False.
        sharded = rt.distributed and stage == 2 and cfg.fsdp
        dtype = weights_dtype(rt, sharded)
        if stage == 2:
            model = build_student(cfg, self.out / STAGE1_NAME, self.softmax_layers(), dtype)
        else:
            model = build_student(cfg, None, self.preset_softmax, dtype)
        model, names = prepare_stage(model, cfg, stage)
        self.save_config()
        model.to(rt.device)
        if sharded:
            shard(model, reshard_after_forward=cfg.fsdp_reshard, replicate=cfg.fsdp_replicate)
        groups = parameter_groups(model, cfg, stage)
        params = [p for group in groups for p in group["params"]]
        uncapturable = None
        if sharded:
            uncapturable = "FSDP2's hooks cannot be captured (--no-fsdp trains replicas, which can)"
        graphed = cfg.cuda_graph and not sharded
        optimizer = make_optimizer(groups, rt.device, cuda_graph=graphed, betas=cfg.betas, weight_decay=cfg.weight_decay)
        total = cfg.steps()
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, total, cfg.warmup_ratio))
        loader = self.make_loader(self.train_blocks, seed=cfg.seed + stage)
        step, tokens = 0, 0
        if state is not None:
            checkpoint.restore(state, model=model, optimizer=optimizer, distributed=sharded)
            if optimizer.defaults["capturable"]:
                rates_on_device(optimizer, rt.device)
            scheduler.load_state_dict(state["scheduler"])
            loader.load_state_dict(state["loader"])
            step, tokens = state["step"], state["tokens"]

        def save(done: bool = False) -> None:
            meta = {"stage": stage, "step": step, "tokens": tokens, "scheduler": scheduler.state_dict(),
                    "loader": snapshot["loader"], "rng": snapshot["rng"], "stage_done": done}
            checkpoint.save(ckpt_path, model=model, optimizer=optimizer, names=names, meta=meta,
                            distributed=sharded, main=rt.main)

        snapshot = {"loader": loader.state_dict(), "rng": checkpoint.rng_state()}
        if step == 0:
            val_loss = self.validation_losses(model, stage)[0]
            self.check_finite(stage, step, "validation loss", val_loss)
            self.log({"stage": stage, "step": 0, "tokens": 0, "split": "val", "val_loss": val_loss})
        batches = forever(loader)
        bar = tqdm(total=total, initial=step, desc=f"stage {stage}", disable=not self.progress, unit="step")
        model.train()
        average = (lambda: rt.average_gradients(params)) if rt.distributed and not sharded else None
        train_step = TrainStep(lambda ids: stage_loss(model, ids, stage), params, optimizer, cfg.clip, rt.autocast,
                               cuda_graph=cfg.cuda_graph, before_clip=average, uncapturable=uncapturable)
        started, tokens_at_start = time.perf_counter(), tokens
        layer_errors = None  # stage 1's per-layer MSE at the last validation
        try:
            while step < total:
                step_started = time.perf_counter()
                # The loss is summed on the device and read once a step: a read per micro-batch would
                # stop the host from queueing the next one while the GPU still runs this one's backward.
                lr = float(scheduler.get_last_lr()[0])
                loss_sum, grad_norm = train_step([next(batches).to(rt.device) for _ in range(cfg.grad_accum)])
                if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP2
                    grad_norm = grad_norm.full_tensor()
                scheduler.step()
                step += 1
                tokens += cfg.batch * cfg.seq_len
                snapshot = {"loader": loader.state_dict(), "rng": checkpoint.rng_state()}
                loss_value = rt.mean(loss_sum.item())
                self.check_finite(stage, step, "training loss", loss_value)
                self.check_finite(stage, step, "gradient norm", float(grad_norm))  # a NaN one makes NaN weights
                now = time.perf_counter()
                # tokens_per_s: the stage so far (what the bar shows); step_s: this optimizer step alone,
                # without validation, checkpoints or the first step's kernel compilation in other steps.
                speed = (tokens - tokens_at_start) / max(now - started, 1e-9)
                record = {"stage": stage, "step": step, "tokens": tokens, "loss": loss_value, "lr": lr,
                          "grad_norm": float(grad_norm), "tokens_per_s": speed, "step_s": now - step_started}
                self.log(record | ({"step_path": train_step.path} if cfg.cuda_graph else {}))
                bar.set_postfix(loss=f"{loss_value:.4g}", tok_s=f"{speed:,.0f}")
                bar.update(1)
                if step % cfg.eval_every == 0 or step == total:
                    val_loss, layer_errors = self.validation_losses(model, stage)
                    self.check_finite(stage, step, "validation loss", val_loss)
                    self.log({"stage": stage, "step": step, "tokens": tokens, "split": "val", "val_loss": val_loss})
                if step % cfg.save_every == 0 and step < total:
                    save()
        except TrainingDiverged:
            bar.close()
            raise
        except KeyboardInterrupt:
            bar.close()
            if step > (state["step"] if state is not None else 0):  # else nothing new to keep
                save()
                if rt.main:
                    print(f"\ninterrupted: checkpoint at step {step} saved in {ckpt_path}; rerun with --resume")
            raise
        bar.close()
        self.finish_stage(model, stage, names, sharded)
        if stage == 1:  # the last step validated, unless this invocation resumed past it
            self.write_layer_scores(layer_errors if layer_errors is not None else self.validation_losses(model, 1)[1])
        save(done=True)

    def check_finite(self, stage: int, step: int, what: str, value: float) -> None:
        """Raise TrainingDiverged when `value`, a loss every rank agrees on, is NaN or infinite."""
        if math.isfinite(value):
            return
        if step == 0:
            raise TrainingDiverged(f"stage {stage}: the {what} is {value} before any training, so the student's or "
                                   f"the teacher's outputs are not finite: check the weights of {self.cfg.model}, "
                                   "or try --precision fp32")
        lr = self.cfg.lr_stage1 if stage == 1 else self.cfg.lr_stage2
        raise TrainingDiverged(f"stage {stage} diverged at step {step}: the {what} is {value}; a lower --lr "
                               f"(stage {stage}'s is {lr:g}) keeps it finite")

    def took_stage1(self) -> bool:
        # The record is written last: a run cut while taking takes again.
        return (self.out / STAGE1_NAME).exists() and (self.out / LAYER_ERRORS_NAME).exists()

    def take_stage1(self) -> None:
        """With stage1_from: the source run's stage-1 tensors become this run's, and its layer scores this run's
        `LAYER_ERRORS_NAME` (with "stage1_from" naming it), from which this run's rule picks; with kl:N, the
        source's KL scores too where they were taken with this run's candidate settings, else this run scores
        the candidates itself (`select_by_kl`)."""
        if self.took_stage1():
            return
        source, theirs, scores = self.stage1_source
        self.save_config()
        if self.rt.main:
            shutil.copyfile(source / STAGE1_NAME, self.out / STAGE1_NAME)
        self.rt.barrier()
        extra = {"stage1_from": str(source)}
        if self.cfg.selection_rule == "kl" and same_kl_scoring(self.cfg, theirs, scores):
            extra |= {key: scores[key] for key in KL_RECORD_KEYS}
        self.write_layer_scores({int(k): v for k, v in scores["mse"].items()}, extra)

    def write_layer_scores(self, errors: dict[int, float], extra: dict | None = None) -> None:
        """After stage 1, `LAYER_ERRORS_NAME`: each linearized layer's stage-1 validation MSE ("mse") and
        `extra`; with any softmax_by, the rule ("softmax_by") and, for error:N and even:N, the layers it keeps
        softmax ("picked"); kl:N picks between the stages (`select_by_kl`)."""
        record = {"mse": {str(k): v for k, v in sorted(errors.items())}, **(extra or {})}
        selection = self.cfg.selection
        if selection is not None:
            rule, count = selection
            record["softmax_by"] = self.cfg.softmax_by
            if rule == "error":
                record["picked"] = top_layers(errors, count)
            elif rule == "even":  # picked before stage 1, which kept them softmax
                record["picked"] = sorted(set(self.preset_softmax) - set(self.cfg.softmax_layers))
        self.write_record(record, final=self.cfg.selection_rule != "kl")

    def write_record(self, record: dict, final: bool) -> None:
        """`LAYER_ERRORS_NAME`, and once the choice is made (`final`) its figure beside it."""
        if self.rt.main:  # replaced whole: an interrupted write leaves the last record, which a resume reads
            write_text_atomic(self.out / LAYER_ERRORS_NAME, json.dumps(record, indent=2))
            if final:
                write_layer_figure(record, (self.out / LAYER_ERRORS_NAME).with_suffix(".png"))
        self.rt.barrier()

    def select_by_kl(self) -> None:
        """With softmax_by kl:N, after stage 1: score every linearized layer and add to `LAYER_ERRORS_NAME`
        the mean per-token KL(teacher || model) on the validation batches of the all-linear candidate
        ("kl_all_linear") and of each one-softmax-layer candidate ("kl_restored"), the layer's score, their
        difference ("kl_gain"), the N highest ("picked"), "kl_train_steps" and the scoring's wall time
        ("kl_seconds"). With kl_train_steps, each candidate's KL is saved as it is taken ("kl_candidates",
        dropped at the end), so an interrupted selection resumes at the next candidate."""
        if self.cfg.selection_rule != "kl":
            return
        self.rt.barrier()
        record = json.loads((self.out / LAYER_ERRORS_NAME).read_text())
        if "picked" in record:
            return
        started = time.perf_counter() - record.get("kl_seconds", 0.0)
        layers = sorted(int(i) for i in record["mse"])
        if "kl_restored" in record:  # the scores of the run this one took its stage 1 from (`take_stage1`)
            baseline, restored_kl = record["kl_all_linear"], {int(k): v for k, v in record["kl_restored"].items()}
        elif self.cfg.kl_train_steps:
            scores = record.setdefault("kl_candidates", {})
            bar = tqdm(total=1 + len(layers), initial=len(scores), desc="KL-guided selection",
                       disable=not self.progress, unit="candidate")
            for restored in [None, *layers]:
                key = "all_linear" if restored is None else str(restored)
                if key in scores:
                    continue
                try:
                    scores[key] = self.candidate_kl(restored)
                except KeyboardInterrupt:
                    bar.close()
                    if self.rt.main:
                        print(f"\ninterrupted: KL-guided selection, {len(scores)} of {1 + len(layers)} candidates "
                              f"scored and saved in {self.out / LAYER_ERRORS_NAME}; rerun with --resume")
                    raise
                record["kl_seconds"] = time.perf_counter() - started
                self.write_record(record, final=False)
                bar.update(1)
            bar.close()
            self.kl_teacher = None  # its device memory goes back before stage 2
            del record["kl_candidates"]
            baseline, restored_kl = scores["all_linear"], {i: scores[str(i)] for i in layers}
        else:
            baseline, restored_kl = self.layer_kl()
        for key, kl in [("all-linear candidate", baseline), *((f"layer {i}'s candidate", v) for i, v in restored_kl.items())]:
            if not math.isfinite(kl):
                raise TrainingDiverged(f"KL-guided selection: the {key} scores a KL of {kl}; a lower stage-2 --lr "
                                       f"(now {self.cfg.lr_stage2:g}) or fewer --kl-train-steps keeps it finite")
        gains = {i: baseline - kl for i, kl in restored_kl.items()}
        record |= {"kl_all_linear": baseline, "kl_restored": {str(k): v for k, v in restored_kl.items()},
                   "kl_gain": {str(k): v for k, v in gains.items()}, "kl_train_steps": self.cfg.kl_train_steps,
                   "kl_seq_len": self.cfg.kl_seq_len or self.cfg.seq_len,
                   "kl_seconds": time.perf_counter() - started, "picked": top_layers(gains, self.cfg.selection[1])}
        self.write_record(record, final=True)

    def validation_batches(self, blocks=None) -> Iterator[torch.Tensor]:
        """This rank's first `val_batches` batches of `blocks` (default: the validation blocks), on its device."""
        loader = self.make_loader(self.val_blocks if blocks is None else blocks, seed=0)
        return (ids.to(self.rt.device) for _, ids in zip(range(self.cfg.val_batches), loader))

    def layer_kl(self) -> tuple[float, dict[int, float]]:
        """`layer_selection.restored_layer_kl` of the stage-1 student, averaged over the ranks."""
        model = build_student(self.cfg, self.out / STAGE1_NAME, self.preset_softmax, weights_dtype(self.rt, False))
        baseline, restored = restored_layer_kl(model.to(self.rt.device), self.validation_batches(self.kl_blocks),
                                               self.rt.autocast)
        means = self.rt.means([baseline, *restored.values()])
        return means[0], dict(zip(restored, means[1:]))

    def candidate_kl(self, restored: int | None) -> float:
        """One candidate's score with kl_train_steps K: the stage-1 student with layer `restored` (None: no
        layer) softmax, its LoRA adapters (stage 2's) trained K steps at the stage-2 lr, held constant, on
        `kl_distillation_loss`, every candidate on the same batches; then its mean per-token KL to the
        teacher on the validation batches, averaged over the ranks."""
        cfg, rt = self.cfg, self.rt
        softmax = sorted(set(self.preset_softmax) | ({restored} if restored is not None else set()))
        # Every candidate's adapters start from the same draw, whichever candidates ran before it in this
        # process: a resumed selection scores as an uninterrupted one.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            model, _ = prepare_stage(build_student(cfg, self.out / STAGE1_NAME, softmax, weights_dtype(rt, False)),
                                     cfg, 2)
        model.to(rt.device)
        model.train()
        if self.kl_teacher is None:
            self.kl_teacher = self.make_kl_teacher(model)
        groups = parameter_groups(model, cfg, 2)
        params = [p for group in groups for p in group["params"]]
        optimizer = make_optimizer(groups, rt.device, cuda_graph=cfg.cuda_graph, betas=cfg.betas,
                                   weight_decay=cfg.weight_decay)
        average = (lambda: rt.average_gradients(params)) if rt.distributed else None
        train_step = TrainStep(lambda batch: kl_distillation_loss(model, *batch), params, optimizer, cfg.clip,
                               rt.autocast, cuda_graph=cfg.cuda_graph, before_clip=average)
        training = self.kl_teacher.training
        for step in range(cfg.kl_train_steps):
            train_step(training[step * cfg.grad_accum:(step + 1) * cfg.grad_accum])
        [kl] = mean_kl(model, self.kl_teacher.validation, [nullcontext], rt.autocast, self.kl_teacher.scored)
        return rt.means([kl])[0]

    def make_kl_teacher(self, model) -> KLTeacher:
        """The batches every candidate trains and is scored on, with the teacher's states on each, computed
        once by `model` (any candidate: in `teacher_mode` each is the same teacher): on the training
        micro-batches in train mode, as the candidates train; on the scoring's batches as `mean_kl` scores."""
        cfg, rt = self.cfg, self.rt
        batches = forever(self.make_loader(self.train_blocks, seed=cfg.seed + 2))
        ids = [next(batches).to(rt.device) for _ in range(cfg.kl_train_steps * cfg.grad_accum)]
        with rt.autocast(True):
            training = [(batch, kl_teacher_states(model, batch)) for batch in ids]
        validation = list(self.validation_batches(self.kl_blocks))
        return KLTeacher(training, validation, teacher_final_states(model, validation, rt.autocast))

    def softmax_layers(self) -> list[int]:
        """The layers softmax in stage 2 and the final model: those softmax from the start plus, with
        softmax_by error:N or kl:N, those picked after stage 1."""
        if self.cfg.selection_rule in (None, "even"):
            return list(self.preset_softmax)
        record = json.loads((self.out / LAYER_ERRORS_NAME).read_text())
        return sorted(set(self.preset_softmax) | set(record["picked"]))

    def finish_stage(self, model, stage: int, names: set[str], sharded: bool) -> None:
        tensors = checkpoint.trained_tensors(model, names, sharded)
        if not self.rt.main:
            return
        if stage == 1:
            torch.save(tensors, self.out / STAGE1_NAME)
        else:
            torch.save(tensors, self.out / "stage2_lora.pt")

    def export(self) -> None:
        """Write the final model (LoRA merged) as a loadable directory, on the main rank."""
        if not self.rt.main:
            return
        # In float32 whatever the run's precision: the saved model is the teacher's weights in float32
        # with the trained tensors (float32 master weights) merged in.
        model = build_student(self.cfg, self.out / STAGE1_NAME, self.softmax_layers())
        lora_path = self.out / "stage2_lora.pt"
        if lora_path.exists() and 2 in self.cfg.stages:
            model, _ = prepare_stage(model, self.cfg, 2)
            model.load_state_dict(torch.load(lora_path, map_location="cpu"), strict=False)
            model = model.merge_and_unload()
        for layer in linearized_layers(model):
            layer.attention_transfer = False
        model.config.linearize = {**model.config.linearize, "distilled": True}  # convert wrote false
        model.save_pretrained(self.out)
        self.tokenizer.save_pretrained(self.out)
        normal_permissions(self.out)  # safetensors writes model.safetensors 0600


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
            run.stage(stage)
            if stage == 1:
                run.select_by_kl()
        run.export()
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
