"""Hyper-parameters of a distillation run, with the papers' defaults (Lizard / LoLCATs recipe)."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from ..config import LAYER_CHOICES, MethodConfig, make_method_config

# softmax_by's rules: what each one ranks the layers by. "even" needs no training to choose.
SOFTMAX_BY_RULES = ("error", "even", "kl")
AFTER_STAGE1 = {"error": "their stage-1 validation error", "kl": "their KL divergence after stage 1"}


def parse_softmax_by(text) -> tuple[str, int]:
    """"RULE:N" (RULE one of SOFTMAX_BY_RULES, N >= 1 layers) as (RULE, N); otherwise a one-line ValueError
    (TypeError: not a string)."""
    if not isinstance(text, str):
        raise TypeError(f"softmax_by must be RULE:N (RULE one of {', '.join(SOFTMAX_BY_RULES)}), got {text!r}")
    rule, sep, count = text.strip().partition(":")
    if not sep or rule not in SOFTMAX_BY_RULES:
        raise ValueError(f"softmax_by {text!r}: expected RULE:N with RULE one of {', '.join(SOFTMAX_BY_RULES)}, "
                         "e.g. kl:2")
    if not count.strip().isdecimal() or int(count) < 1:
        raise ValueError(f"softmax_by {text!r}: N, the number of layers kept softmax, must be a whole number >= 1")
    return rule, int(count)


def check_recall_share(share) -> None:
    """A share of the training tokens for recall documents: a number in [0, 1) (ValueError naming it)."""
    if isinstance(share, bool) or not isinstance(share, int | float) or not math.isfinite(share) or not 0 <= share < 1:
        raise ValueError(f"recall_share (--recall-share) must be a share of the training tokens, at least 0 and "
                         f"below 1 (e.g. 0.2), got {share!r}")


def check_far_weight(weight) -> None:
    """A stage-1 emphasis on far-attending positions: a finite number >= 0 (ValueError naming it)."""
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight) or weight < 0:
        raise ValueError(f"far_weight (--far-weight) must be a number at least 0 (e.g. 4; 0: every position "
                         f"alike), got {weight!r}")


def check_trainable_length(method: str, options: dict, seq_len: int, stages: list[int]) -> None:
    """Refuse (ValueError naming seq_len and the method's option) a training length on which the run would
    learn nothing: one token (every attention, softmax or linear, returns that token's value, so every loss
    is 0 whatever the weights), or for stage 1 a length the linear part never sees (LoLCATs' linear
    attention covers only the tokens before its window; STILL's checks its softmax budget, below)."""
    if isinstance(seq_len, int) and seq_len < 2:
        raise ValueError(f"seq_len (--seq-len) {seq_len}: a sequence of one token trains nothing (every attention "
                         "returns its value, so the loss is 0 whatever the weights): give --seq-len 2 or more, "
                         f"and more than {method}'s window to train what it adds")
    if method == "lolcats" and 1 in stages:
        window = make_method_config("lolcats", **options).window
        if seq_len <= window:
            raise ValueError(f"seq_len (--seq-len) {seq_len} is not longer than lolcats' window ({window}): its linear "
                             "attention sees only the tokens before the window, so stage 1 would train nothing; "
                             "train on longer sequences (--seq-len) or give it a smaller window (--set window=N)")


@dataclass
class DistillConfig:
    model: str
    method: str
    out: str
    data: str = "default"
    # The share of each stage's training tokens given to seeded synthetic recall documents (key-value lists,
    # passkeys and multi-key needles, each question followed by its answer: `linearize.data.recall`); 0: none.
    recall_share: float = 0.0
    # Stage 1 weights each position's attention-transfer error by w_t = 1 + far_weight * far_t, far_t the
    # teacher's softmax mass (mean over heads) on keys beyond the method's window, and w divided by its mean
    # over the sequence (`linearize.attention.far_mass`); 0: every position alike, the plain MSE.
    far_weight: float = 0.0
    stage: str = "both"  # "1", "2" or "both"; Liger's published recipe is stage 2 alone
    max_tokens: int = 20_000_000  # training tokens per stage
    seq_len: int = 2048
    batch: int = 8  # sequences per optimizer step, over all ranks and accumulation steps
    grad_accum: int = 1
    lr_stage1: float = 1e-3
    lr_stage2: float = 5e-4
    # Stage-1 lr multiplier of the per-head scalars (Lizard's alpha, sinks and gate bias; LoLCATs' window
    # factors): at lr 1e-3 they move by ~1e-3 a step, too little to leave their init in a short run.
    head_lr_scale: float = 1.0
    betas: tuple[float, float] = (0.9, 0.99)
    weight_decay: float = 0.0
    warmup_ratio: float = 0.1
    clip: float = 1.0
    lora_r: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")
    options: dict = field(default_factory=dict)  # method options (see linearize.config), as `method_config` types them
    softmax_layers: list[int] = field(default_factory=list)
    # "full": linearize the teacher's full-attention layers only, keeping its sliding-window layers
    # (`linearize.architectures.layers_kept_softmax`); "all": every layer.
    layers: str = "all"
    # "RULE:N": N more layers, among those linearized, stay softmax (docs/training.md, "Layer-wise hybrids"):
    # "error:N" after stage 1, the N it left with the highest validation MSE; "kl:N" after stage 1, the N
    # whose restoring alone to softmax brings the model's next-token distribution closest to the teacher's
    # (KL-guided layer selection, arXiv 2512.20569); "even:N" before training, N evenly spaced ones.
    softmax_by: str | None = None
    # With "kl:N": optimizer steps each one-softmax-layer candidate's LoRA adapters train on the KL to the
    # teacher before it is scored, as the method trains its candidates (0: score the stage-1 student as it is).
    kl_train_steps: int = 0
    # With "kl:N": the validation sequences' length the candidates are scored on (0: seq_len). A method
    # whose short-range part is exact (STILL's softmax budget) shows what its linear part loses only past it.
    kl_seq_len: int = 0
    # A run folder whose finished stage 1 this run takes instead of training its own (`run_dir.
    # stage1_source` checks that it was trained with this run's stage-1 settings): hybrids that differ only in
    # how many layers, or which rule, keep softmax share one stage 1, and with kl:N one candidate scoring.
    stage1_from: str | None = None
    # Stage 2 under torchrun: FSDP2 (the default), or (fsdp=False) a whole replica on every rank with the
    # gradients averaged in one all-reduce a step, as stage 1 always trains: then steps can be CUDA graphs.
    fsdp: bool = True
    fsdp_reshard: bool = True  # FSDP2: free each layer's gathered weights after its forward
    fsdp_replicate: bool = False  # FSDP2: whole weights on every rank (HSDP), gradients all-reduced per layer
    save_every: int = 100  # optimizer steps between checkpoints
    eval_every: int = 100
    val_batches: int = 4
    seed: int = 0
    gradient_checkpointing: bool = False  # recompute each decoder layer in backward: less memory, more time
    # Replay each optimizer step from a CUDA graph (linearize/train/step.py): on one GPU, and under torchrun
    # wherever no FSDP2 hooks run (stage 1, and stage 2 with fsdp=False).
    cuda_graph: bool = False
    device: str | None = None  # None: cuda if available
    precision: str = "auto"  # auto: bf16 autocast on cuda, float32 on cpu

    def __post_init__(self):
        if self.stage not in ("1", "2", "both"):
            raise ValueError(f"--stage must be 1, 2 or both, got {self.stage!r}")
        for name in ("max_tokens", "seq_len", "batch", "grad_accum", "save_every", "eval_every", "head_lr_scale",
                     "lr_stage1", "lr_stage2", "clip"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):  # a recipe's `max_tokens: lots`
                raise TypeError(f"{name} must be a number, got {value!r}")
            if not math.isfinite(value) or value <= 0:  # NaN passes `<= 0`
                raise ValueError(f"{name} must be > 0, got {value}")
        check_recall_share(self.recall_share)
        check_far_weight(self.far_weight)
        if not 0 <= self.warmup_ratio <= 1:
            raise ValueError(f"warmup_ratio must be in [0, 1], got {self.warmup_ratio}")
        if self.batch % self.grad_accum:
            raise ValueError(f"batch ({self.batch}) must be a multiple of grad_accum ({self.grad_accum})")
        check_trainable_length(self.method, self.options, self.seq_len, self.stages)
        micro = self.batch // self.grad_accum
        if self.max_tokens // self.seq_len < micro:
            # The data would be blamed otherwise: the training split is cut to max_tokens // seq_len sequences.
            raise ValueError(f"max_tokens (--max-tokens) {self.max_tokens:,} holds {self.max_tokens // self.seq_len} "
                             f"sequence(s) of seq_len {self.seq_len}, fewer than one micro-batch of {micro}: give "
                             f"--max-tokens {micro * self.seq_len} or more (steps are --batch x --seq-len tokens)")
        if self.layers not in LAYER_CHOICES:
            raise ValueError(f"layers must be one of {', '.join(LAYER_CHOICES)}, got {self.layers!r}")
        if self.softmax_by is not None:
            rule, count = parse_softmax_by(self.softmax_by)
            self.softmax_by = f"{rule}:{count}"
            if rule in AFTER_STAGE1 and self.stage != "both":
                raise ValueError(f"softmax_by {self.softmax_by} picks layers by {AFTER_STAGE1[rule]}: it needs both "
                                 "stages (--stage both)")
        if isinstance(self.kl_train_steps, bool) or not isinstance(self.kl_train_steps, int) or self.kl_train_steps < 0:
            raise ValueError(f"kl_train_steps must be a whole number >= 0, got {self.kl_train_steps!r}")
        if self.kl_train_steps and self.selection_rule != "kl":
            raise ValueError(f"kl_train_steps ({self.kl_train_steps}) trains the candidates of softmax_by kl:N; "
                             f"this run's softmax_by is {self.softmax_by}")
        if isinstance(self.kl_seq_len, bool) or not isinstance(self.kl_seq_len, int) or self.kl_seq_len < 0:
            raise ValueError(f"kl_seq_len must be a whole number >= 0, got {self.kl_seq_len!r}")
        if self.kl_seq_len and self.selection_rule != "kl":
            raise ValueError(f"kl_seq_len ({self.kl_seq_len}) is the length softmax_by kl:N scores its candidates "
                             f"on; this run's softmax_by is {self.softmax_by}")
        if self.stage1_from is not None:
            if not isinstance(self.stage1_from, str) or not self.stage1_from.strip():
                raise ValueError(f"stage1_from must be a run folder, got {self.stage1_from!r}")
            if self.stage != "both":
                raise ValueError(f"stage1_from ({self.stage1_from}) stands in for this run's stage 1: it needs both "
                                 "stages (--stage both)")
        if not self.fsdp and (self.fsdp_replicate or not self.fsdp_reshard):
            raise ValueError("--fsdp-replicate and --no-fsdp-reshard set how FSDP2 shards stage 2; "
                             "--no-fsdp trains stage 2 without FSDP2 (whole replicas): pick one")
        if self.method == "liger" and 1 in self.stages:
            raise ValueError("liger adds no parameters for stage 1 (attention transfer) to train: "
                             "use --stage 2, its published recipe")
        if self.precision not in ("auto", "bf16", "fp32"):
            raise ValueError(f"precision must be auto, bf16 or fp32, got {self.precision!r}")
        # `options` stay as given (what distill_config.json records and a resume compares); the layers below
        # take this typed config, parsed once here.
        self.method_config: MethodConfig = make_method_config(self.method, **self.options)
        if self.method == "still" and 1 in self.stages:
            still = self.method_config
            if not still.folds_within(self.seq_len):
                raise ValueError(
                    f"STILL's softmax budget ({still.budget} slots, {still.per_chunk} picks per "
                    f"{still.chunk_size}-token chunk) holds every token of a {self.seq_len}-token sequence: "
                    "its linear state would see none, so stage 1 would train nothing. Train on longer "
                    "sequences (--seq-len) or give it a smaller budget")
        self.betas = tuple(self.betas)
        self.lora_targets = tuple(self.lora_targets)

    @property
    def selection(self) -> tuple[str, int] | None:
        """`softmax_by` as (rule, N), or None."""
        return None if self.softmax_by is None else parse_softmax_by(self.softmax_by)

    @property
    def selection_rule(self) -> str | None:
        """`softmax_by`'s rule ("kl", "error" or "even"), or None."""
        return None if self.selection is None else self.selection[0]

    @property
    def stages(self) -> list[int]:
        return [1, 2] if self.stage == "both" else [int(self.stage)]

    def steps(self) -> int:
        """Optimizer steps per stage."""
        return max(1, self.max_tokens // (self.batch * self.seq_len))

    def lr(self, stage: int) -> float:
        return self.lr_stage1 if stage == 1 else self.lr_stage2

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_json(cls, path: str | Path) -> DistillConfig:
        fields = json.loads(Path(path).read_text())
        if not isinstance(fields, dict):
            raise TypeError(f"expected a JSON object of DistillConfig fields, got {type(fields).__name__}")
        # A saved config may give the error rule as `softmax_by_error: N` (0: none), which is softmax_by "error:N".
        count = fields.pop("softmax_by_error", 0)
        if count and fields.get("softmax_by") is None:
            fields["softmax_by"] = f"error:{count}"
        return cls(**fields)

    def same_run(self, other: DistillConfig) -> list[str]:
        """Fields that differ in a way that makes resuming `other` as this run wrong."""
        # A run folder may move (or be copied) between invocations; the rest only affects speed or logging.
        # stage1_from: where stage 1 came from, once it is taken, no longer matters.
        free = {"out", "save_every", "eval_every", "device", "fsdp", "fsdp_reshard", "fsdp_replicate", "cuda_graph",
                "stage1_from"}
        return [f.name for f in dataclasses.fields(self)
                if f.name not in free and getattr(self, f.name) != getattr(other, f.name)]
