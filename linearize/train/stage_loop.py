"""One distillation stage's loop: build the stage's student, resume it where a checkpoint left it, train,
validate, log and checkpoint every so many steps, and keep what the stage trained.

Stage 1 trains only the new modules of every linearized layer to match that layer's softmax output
(MSE), all layers at once in one forward pass: each layer returns the teacher's output, so the next
layer sees teacher hidden states, and records its own error. Stage 2 trains peft LoRA adapters on q/k/v
with next-token cross-entropy.
"""

from __future__ import annotations

import math
import time

import torch
from tqdm.auto import tqdm

from . import checkpoint
from .layer_selection import take_stage1, write_layer_scores
from .losses import TrainingDiverged, stage_loss
from .resume import StageCheckpoint, saved_stage
from .run_dir import CHECKPOINT_NAME, LORA_NAME, STAGE1_NAME
from .runtime import shard
from .step import TrainStep, make_optimizer
from .student import build_student, linearized_layers, parameter_groups, prepare_stage, weights_dtype


def lr_factor(step: int, total: int, warmup_ratio: float) -> float:
    """Linear warmup over the first warmup_ratio of steps, then cosine decay to zero."""
    warmup = max(1, int(total * warmup_ratio))
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def forever(loader):
    while True:
        yield from loader


def validation_losses(run, model, stage: int) -> tuple[float, dict[int, float]]:
    """Mean validation loss and, in stage 1, each linearized layer's mean MSE {layer index: MSE}."""
    layers = linearized_layers(model) if stage == 1 else []
    totals, count = torch.zeros(1 + len(layers), dtype=torch.float64), 0
    model.eval()
    with torch.no_grad(), run.rt.autocast():
        for ids in run.validation_batches():
            loss = stage_loss(model, ids, stage)
            totals += torch.stack([loss, *(layer.transfer_loss for layer in layers)]).detach().double().cpu()
            count += 1
    model.train()
    means = run.rt.means((totals / max(1, count)).tolist())
    return means[0], {layer.layer_idx: mean for layer, mean in zip(layers, means[1:])}


def check_finite(run, stage: int, step: int, what: str, value: float) -> None:
    """Raise TrainingDiverged when `value`, a loss every rank agrees on, is NaN or infinite."""
    if math.isfinite(value):
        return
    if step == 0:
        raise TrainingDiverged(f"stage {stage}: the {what} is {value} before any training, so the student's or "
                               f"the teacher's outputs are not finite: check the weights of {run.cfg.model}, "
                               "or try --precision fp32")
    lr = run.cfg.lr_stage1 if stage == 1 else run.cfg.lr_stage2
    raise TrainingDiverged(f"stage {stage} diverged at step {step}: the {what} is {value}; a lower --lr "
                           f"(stage {stage}'s is {lr:g}) keeps it finite")


def train_stage(run, stage: int) -> None:
    """Train `stage` of `run` (a `run.Run`) to its end, from its checkpoint where an earlier invocation left one;
    with stage1_from, stage 1 is the source run's (`layer_selection.take_stage1`)."""
    cfg, rt = run.cfg, run.rt
    if stage == 1 and cfg.stage1_from:
        take_stage1(run)
        return
    ckpt_path = run.out / CHECKPOINT_NAME
    # The main rank alone writes checkpoints (the previous stage's last one just now): no rank reads
    # before it is done, or it finds the checkpoint between the old one's rename and the new one's.
    rt.barrier()
    done, state = saved_stage(ckpt_path, stage)
    if done:
        return  # finished in an earlier invocation

    # Stage 1's losses are taken inside each layer while the layer returns the teacher's output, so
    # FSDP2's unshard-for-backward hooks (set on layer outputs) never fire: there, every rank keeps a
    # whole replica and the few trained parameters' gradients are averaged by hand (one all-reduce,
    # which a CUDA graph can hold; FSDP2's hooks cannot be captured). Stage 2 does so too with fsdp=False.
    sharded = rt.distributed and stage == 2 and cfg.fsdp
    dtype = weights_dtype(rt, sharded)
    if stage == 2:
        model = build_student(cfg, run.out / STAGE1_NAME, run.softmax_layers(), dtype)
    else:
        model = build_student(cfg, None, run.preset_softmax, dtype)
    model, names = prepare_stage(model, cfg, stage)
    run.save_config()
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
    loader = run.make_loader(run.train_blocks, seed=cfg.seed + stage)
    ckpt = StageCheckpoint(ckpt_path, stage, model, optimizer, scheduler, loader, names, sharded, rt.main)
    if state is not None:
        ckpt.restore(state, rt.device)

    ckpt.mark()
    if ckpt.step == 0:
        val_loss = validation_losses(run, model, stage)[0]
        check_finite(run, stage, 0, "validation loss", val_loss)
        run.log({"stage": stage, "step": 0, "tokens": 0, "split": "val", "val_loss": val_loss})
    batches = forever(loader)
    bar = tqdm(total=total, initial=ckpt.step, desc=f"stage {stage}", disable=not run.progress, unit="step")
    model.train()
    average = (lambda: rt.average_gradients(params)) if rt.distributed and not sharded else None
    train_step = TrainStep(lambda ids: stage_loss(model, ids, stage), params, optimizer, cfg.clip, rt.autocast,
                           cuda_graph=cfg.cuda_graph, before_clip=average, uncapturable=uncapturable)
    started, tokens_at_start, first_step = time.perf_counter(), ckpt.tokens, ckpt.step
    layer_errors = None  # stage 1's per-layer MSE at the last validation
    try:
        while ckpt.step < total:
            step_started = time.perf_counter()
            # The loss is summed on the device and read once a step: a read per micro-batch would
            # stop the host from queueing the next one while the GPU still runs this one's backward.
            lr = float(scheduler.get_last_lr()[0])
            loss_sum, grad_norm = train_step([next(batches).to(rt.device) for _ in range(cfg.grad_accum)])
            if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP2
                grad_norm = grad_norm.full_tensor()
            scheduler.step()
            ckpt.step += 1
            ckpt.tokens += cfg.batch * cfg.seq_len
            step, tokens = ckpt.step, ckpt.tokens
            ckpt.mark()
            loss_value = rt.mean(loss_sum.item())
            check_finite(run, stage, step, "training loss", loss_value)
            check_finite(run, stage, step, "gradient norm", float(grad_norm))  # a NaN one makes NaN weights
            now = time.perf_counter()
            # tokens_per_s: the stage so far (what the bar shows); step_s: this optimizer step alone,
            # without validation, checkpoints or the first step's kernel compilation in other steps.
            speed = (tokens - tokens_at_start) / max(now - started, 1e-9)
            record = {"stage": stage, "step": step, "tokens": tokens, "loss": loss_value, "lr": lr,
                      "grad_norm": float(grad_norm), "tokens_per_s": speed, "step_s": now - step_started}
            run.log(record | ({"step_path": train_step.path} if cfg.cuda_graph else {}))
            bar.set_postfix(loss=f"{loss_value:.4g}", tok_s=f"{speed:,.0f}")
            bar.update(1)
            if step % cfg.eval_every == 0 or step == total:
                val_loss, layer_errors = validation_losses(run, model, stage)
                check_finite(run, stage, step, "validation loss", val_loss)
                run.log({"stage": stage, "step": step, "tokens": tokens, "split": "val", "val_loss": val_loss})
            if step % cfg.save_every == 0 and step < total:
                ckpt.save()
    except TrainingDiverged:
        bar.close()
        raise
    except KeyboardInterrupt:
        bar.close()
        if ckpt.step > first_step:  # else nothing new to keep
            ckpt.save()
            if rt.main:
                print(f"\ninterrupted: checkpoint at step {ckpt.step} saved in {ckpt_path}; rerun with --resume")
        raise
    bar.close()
    keep_trained(run, model, stage, names, sharded)
    if stage == 1:  # the last step validated, unless this invocation resumed past it
        write_layer_scores(run, layer_errors if layer_errors is not None else validation_losses(run, model, 1)[1])
    ckpt.save(done=True)


def keep_trained(run, model, stage: int, names: set[str], sharded: bool) -> None:
    """What the stage trained, on the main rank: stage 1's new modules (`STAGE1_NAME`), stage 2's adapters."""
    tensors = checkpoint.trained_tensors(model, names, sharded)
    if not run.rt.main:
        return
    torch.save(tensors, run.out / (STAGE1_NAME if stage == 1 else LORA_NAME))
