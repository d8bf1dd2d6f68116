"""Which linearized layers a hybrid keeps softmax (`DistillConfig.softmax_by`, docs/training.md).

Three rules choose N of the layers the model linearizes (never the explicit `softmax_layers`, nor the
sliding layers `layers="full"` keeps):

- `even:N`, before training: the middle layer of each of N equal groups of the linearized layers
  (`even_layers`).
- `error:N`, after stage 1: the N layers with the highest stage-1 validation MSE (`top_layers` of it).
- `kl:N`, after stage 1: KL-guided layer selection (Li et al., "Distilling to Hybrid Attention Models
  via KL-Guided Layer Selection", arXiv 2512.20569, github.com/fla-org/hybrid-distillation). Their
  selector restores exactly one layer to softmax in the otherwise all-linear student, trains that
  student briefly with a KL distillation, and ranks the layers by how far it then lowers the KL to the
  teacher; the top N stay softmax. With `kl_train_steps` K > 0 (`KLSelection`) each candidate is
  built with its layer softmax, its LoRA adapters trained K steps on `kl_distillation_loss`, and scored
  by `mean_kl`; with K = 0, `restored_layer_kl` scores the stage-1 student as it is, one forward per
  candidate layer.

A linearized layer switches between its own attention and the teacher's softmax by its
`attention_transfer` flag, which makes it return the teacher's output computed from the same
projections (stage 1's target): no weights are copied, and the model with every layer switched is the
teacher, whose distribution the KL is taken against.
"""

from __future__ import annotations

import itertools
import json
import math
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass

import torch
from torch.nn import functional as F
from tqdm.auto import tqdm

from ..cli_args import write_text_atomic
from .layer_report import write_layer_figure
from .losses import TrainingDiverged, causal_lm_of, chunked_kl_divergence, linear_head
from .run_dir import KL_RECORD_KEYS, LAYER_ERRORS_NAME, STAGE1_NAME, same_kl_scoring
from .step import TrainStep, make_optimizer
from .student import build_student, parameter_groups, prepare_stage, weights_dtype

# Elements of a [tokens, vocab] float32 block: the KL is summed over blocks of this size, so that a
# large vocabulary (Gemma's 262K) never needs float32 copies of a whole batch's logits.
KL_BLOCK_ELEMENTS = 1 << 25


def even_layers(candidates: list[int], n: int) -> list[int]:
    """N of the `candidates` (sorted layer indices), evenly spaced: split them into N groups of equal
    size (as equal as whole layers allow) and take each group's middle, candidates[floor((2g + 1) M / 2N)]
    for g = 0 .. N-1, M = len(candidates). 30 layers: N = 15 gives 1, 3, .., 29; N = 8 gives 1, 5, 9,
    13, 16, 20, 24, 28."""
    m = len(candidates)
    if not 1 <= n < m:
        raise ValueError(f"even:{n} needs 1 <= N < {m}, the linearized layers it chooses from")
    return [candidates[(2 * g + 1) * m // (2 * n)] for g in range(n)]


def top_layers(scores: dict[int, float], n: int) -> list[int]:
    """The `n` layers with the highest scores (ties: the lower index first), in layer order."""
    return sorted(sorted(scores, key=lambda i: (-scores[i], i))[:n])


def linearized_attention(model) -> dict[int, torch.nn.Module]:
    """{layer index: its linearized attention} for the model's linearized layers."""
    from ..attention import LinearizedAttention

    return {m.layer_idx: m for m in model.modules() if isinstance(m, LinearizedAttention)}


@contextmanager
def softmax_in(model, layers: Iterable[int]) -> Iterator[None]:
    """Within it, the model's linearized layers in `layers` return the teacher's softmax output and the
    others their own; every layer's flag is restored after."""
    attention = linearized_attention(model)
    before = {i: a.attention_transfer for i, a in attention.items()}
    teacher = set(layers)
    try:
        for i, a in attention.items():
            a.attention_transfer = i in teacher
        yield
    finally:
        for i, a in attention.items():
            a.attention_transfer = before[i]


def token_kl_sum(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """Sum over the positions of KL(teacher || student) between their next-token distributions (a float64
    scalar), computed in float32 or the logits' wider dtype."""
    vocab = teacher_logits.shape[-1]
    teacher, student = teacher_logits.reshape(-1, vocab), student_logits.reshape(-1, vocab)
    rows = max(1, KL_BLOCK_ELEMENTS // vocab)
    dtype = torch.promote_types(teacher.dtype, torch.float32)  # bf16 logits are taken in float32
    total = torch.zeros((), dtype=torch.float64, device=teacher.device)
    for start in range(0, teacher.shape[0], rows):
        log_p = torch.log_softmax(teacher[start:start + rows].to(dtype), dim=-1)
        log_q = torch.log_softmax(student[start:start + rows].to(dtype), dim=-1)
        total += F.kl_div(log_q, log_p, log_target=True, reduction="sum").double()
    return total


@contextmanager
def teacher_mode(model) -> Iterator[None]:
    """Within it, the model is its teacher: every linearized layer returns the teacher's softmax output
    and, on a peft model (stage 2's LoRA), the adapters are off."""
    with ExitStack() as stack:
        if hasattr(model, "disable_adapter"):
            stack.enter_context(model.disable_adapter())
        stack.enter_context(softmax_in(model, linearized_attention(model)))
        yield


def final_states(model, input_ids: torch.Tensor) -> torch.Tensor:
    """What a KL is taken from, one forward: where the head is a bias-free Linear, the decoder's final
    hidden states (`mean_token_kl` forms the logits from them chunk by chunk: no [tokens, vocab] logits,
    8.6 GB in bf16 for 16K tokens of Gemma's 262K vocabulary); else HF's logits."""
    head, _ = linear_head(model)
    if head is None:
        return model(input_ids=input_ids, use_cache=False).logits
    captured = []
    handle = causal_lm_of(model).get_decoder().register_forward_hook(lambda module, args, output: captured.append(output[0]))
    try:
        model(input_ids=input_ids, use_cache=False, logits_to_keep=1)
    finally:
        handle.remove()
    return captured[0]


def mean_token_kl(model, teacher_states: torch.Tensor, student_states: torch.Tensor) -> torch.Tensor:
    """The mean per-token KL(teacher || student) between two of the model's `final_states`, a float32
    scalar (float64 from a float64 model) with the student's gradient."""
    head, softcap = linear_head(model)
    if head is None:
        return (token_kl_sum(teacher_states, student_states) / student_states.shape[:-1].numel()).float()
    return chunked_kl_divergence(student_states, teacher_states, head.weight, softcap=softcap)


@contextmanager
def evaluating(model) -> Iterator[None]:
    training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(training)


def teacher_final_states(model, batches: Iterable[torch.Tensor], autocast=nullcontext) -> list[torch.Tensor]:
    """The teacher's `final_states` on each of `batches`, as `mean_kl` takes them: computed once, they
    serve every student scored on the same batches (KL-guided selection's candidates share one teacher)."""
    with evaluating(model), torch.no_grad(), autocast(), teacher_mode(model):
        return [final_states(model, ids) for ids in batches]


def mean_kl(model, batches: Iterable[torch.Tensor], students: list[Callable[[], AbstractContextManager]],
            autocast=nullcontext, teachers: list[torch.Tensor] | None = None) -> list[float]:
    """For each of `students` (factories of the contexts under which the model is that student), the mean
    per-token KL(teacher || student) on `batches` (packed [B, L] token ids, no padding), the teacher
    being the model under `teacher_mode`. Per batch: one teacher forward, or its `teachers` entry
    (`teacher_final_states` of the same batches), and one forward per student."""
    sums = torch.zeros(len(students), dtype=torch.float64)
    tokens = 0
    # Not under `masking.unpadded_attention` (nor is `teacher_final_states`): with no mask, HF runs
    # sliding-window layers (Gemma's) as full causal attention, and the teacher here must be the teacher.
    with evaluating(model), torch.no_grad(), autocast():
        for index, ids in enumerate(batches):
            if teachers is None:
                with teacher_mode(model):
                    teacher = final_states(model, ids)
            else:
                teacher = teachers[index]
            for row, student_mode in enumerate(students):
                with student_mode():
                    student = final_states(model, ids)
                sums[row] += mean_token_kl(model, teacher, student).double().cpu() * ids.numel()
                del student
            tokens += ids.numel()
            del teacher
    return (sums / max(1, tokens)).tolist()


def restored_layer_kl(model, batches: Iterable[torch.Tensor], autocast=nullcontext) -> tuple[float, dict[int, float]]:
    """KL-guided layer scores of the model as it is, on `batches`: the mean per-token KL(teacher || model)
    of the model with all its linearized layers linear, and {i: the same with only layer i restored to
    the teacher's softmax} for each linearized layer i (`mean_kl`)."""
    layers = sorted(linearized_attention(model))
    means = mean_kl(model, batches, [lambda i=i: softmax_in(model, [] if i is None else [i]) for i in [None, *layers]],
                    autocast)
    return means[0], dict(zip(layers, means[1:]))


def kl_teacher_states(model, input_ids: torch.Tensor) -> torch.Tensor:
    """The teacher's `final_states` on one packed batch as `kl_distillation_loss` takes them: the same model
    (`teacher_mode`) with its linearized layers softmax and its adapters off, no gradient."""
    from .masking import unpadded_attention

    with unpadded_attention(model), torch.no_grad(), teacher_mode(model):
        return final_states(model, input_ids)


def kl_distillation_loss(model, input_ids: torch.Tensor, teacher: torch.Tensor | None = None) -> torch.Tensor:
    """The mean per-token KL(teacher || model) on one packed batch (`mean_token_kl`), a float32 scalar whose
    gradient reaches what the model trains. `teacher`: `kl_teacher_states` of these ids, computed before
    (under the same autocast), or None to compute it here. The candidates of `kl_train_steps` train on
    it, all against one precomputed teacher."""
    from .masking import unpadded_attention

    if teacher is None:
        teacher = kl_teacher_states(model, input_ids)
    with unpadded_attention(model):
        student = final_states(model, input_ids)
    return mean_token_kl(model, teacher, student).float()


# The selection itself, on a run (`run.Run`): its record, `LAYER_ERRORS_NAME`, written after stage 1.


def write_record(run, record: dict, final: bool) -> None:
    """`LAYER_ERRORS_NAME`, and once the choice is made (`final`) its figure beside it."""
    if run.rt.main:  # replaced whole: an interrupted write leaves the last record, which a resume reads
        write_text_atomic(run.out / LAYER_ERRORS_NAME, json.dumps(record, indent=2))
        if final:
            write_layer_figure(record, (run.out / LAYER_ERRORS_NAME).with_suffix(".png"))
    run.rt.barrier()


def write_layer_scores(run, errors: dict[int, float], extra: dict | None = None) -> None:
    """After stage 1, `LAYER_ERRORS_NAME`: each linearized layer's stage-1 validation MSE ("mse") and
    `extra`; with any softmax_by, the rule ("softmax_by") and, for error:N and even:N, the layers it keeps
    softmax ("picked"); kl:N picks between the stages (`KLSelection`)."""
    cfg = run.cfg
    record = {"mse": {str(k): v for k, v in sorted(errors.items())}, **(extra or {})}
    selection = cfg.selection
    if selection is not None:
        rule, count = selection
        record["softmax_by"] = cfg.softmax_by
        if rule == "error":
            record["picked"] = top_layers(errors, count)
        elif rule == "even":  # picked before stage 1, which kept them softmax
            record["picked"] = sorted(set(run.preset_softmax) - set(cfg.softmax_layers))
    write_record(run, record, final=cfg.selection_rule != "kl")


def take_stage1(run) -> None:
    """With stage1_from: the source run's stage-1 tensors become this run's, and its layer scores this run's
    `LAYER_ERRORS_NAME` (with "stage1_from" naming it), from which this run's rule picks; with kl:N, the
    source's KL scores too where they were taken with this run's candidate settings, else this run scores
    the candidates itself (`KLSelection`)."""
    if run.took_stage1():
        return
    source, theirs, scores = run.stage1_source
    run.save_config()
    if run.rt.main:
        shutil.copyfile(source / STAGE1_NAME, run.out / STAGE1_NAME)
    run.rt.barrier()
    extra = {"stage1_from": str(source)}
    if run.cfg.selection_rule == "kl" and same_kl_scoring(run.cfg, theirs, scores):
        extra |= {key: scores[key] for key in KL_RECORD_KEYS}
    write_layer_scores(run, {int(k): v for k, v in scores["mse"].items()}, extra)


@dataclass
class KLTeacher:
    """What KL-guided selection's trained candidates share (`KLSelection.candidate_kl`): the teacher does not
    change between them, so its forwards run once. `training`: the K x grad_accum micro-batches each candidate
    trains on, each with `kl_teacher_states` on it; `validation`: the batches each is scored on, and
    `scored` the teacher's `teacher_final_states` on them. They stay on the device: a value per token and
    hidden unit (SmolLM2, 10 steps of 4 x 1,024 tokens: 94M values, 377 MB in float32)."""

    training: list[tuple[torch.Tensor, torch.Tensor]]
    validation: list[torch.Tensor]
    scored: list[torch.Tensor]


class KLSelection:
    """softmax_by kl:N after stage 1, on a run (`run.Run`): score every linearized layer, pick the N best."""

    def __init__(self, run):
        self.run = run
        self.kl_teacher: KLTeacher | None = None  # `candidate_kl`'s, made by its first candidate

    def select(self) -> None:
        """With softmax_by kl:N, after stage 1: score every linearized layer and add to `LAYER_ERRORS_NAME`
        the mean per-token KL(teacher || model) on the validation batches of the all-linear candidate
        ("kl_all_linear") and of each one-softmax-layer candidate ("kl_restored"), the layer's score, their
        difference ("kl_gain"), the N highest ("picked"), "kl_train_steps" and the scoring's wall time
        ("kl_seconds"). With kl_train_steps, each candidate's KL is saved as it is taken ("kl_candidates",
        dropped at the end), so an interrupted selection resumes at the next candidate."""
        run = self.run
        cfg = run.cfg
        if cfg.selection_rule != "kl":
            return
        run.rt.barrier()
        record = json.loads((run.out / LAYER_ERRORS_NAME).read_text())
        if "picked" in record:
            return
        started = time.perf_counter() - record.get("kl_seconds", 0.0)
        layers = sorted(int(i) for i in record["mse"])
        if "kl_restored" in record:  # the scores of the run this one took its stage 1 from (`take_stage1`)
            baseline, restored_kl = record["kl_all_linear"], {int(k): v for k, v in record["kl_restored"].items()}
        elif cfg.kl_train_steps:
            scores = record.setdefault("kl_candidates", {})
            bar = tqdm(total=1 + len(layers), initial=len(scores), desc="KL-guided selection",
                       disable=not run.progress, unit="candidate")
            for restored in [None, *layers]:
                key = "all_linear" if restored is None else str(restored)
                if key in scores:
                    continue
                try:
                    scores[key] = self.candidate_kl(restored)
                except KeyboardInterrupt:
                    bar.close()
                    if run.rt.main:
                        print(f"\ninterrupted: KL-guided selection, {len(scores)} of {1 + len(layers)} candidates "
                              f"scored and saved in {run.out / LAYER_ERRORS_NAME}; rerun with --resume")
                    raise
                record["kl_seconds"] = time.perf_counter() - started
                write_record(run, record, final=False)
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
                                       f"(now {cfg.lr_stage2:g}) or fewer --kl-train-steps keeps it finite")
        gains = {i: baseline - kl for i, kl in restored_kl.items()}
        record |= {"kl_all_linear": baseline, "kl_restored": {str(k): v for k, v in restored_kl.items()},
                   "kl_gain": {str(k): v for k, v in gains.items()}, "kl_train_steps": cfg.kl_train_steps,
                   "kl_seq_len": cfg.kl_seq_len or cfg.seq_len,
                   "kl_seconds": time.perf_counter() - started, "picked": top_layers(gains, cfg.selection[1])}
        write_record(run, record, final=True)

    def layer_kl(self) -> tuple[float, dict[int, float]]:
        """`restored_layer_kl` of the stage-1 student, averaged over the ranks."""
        run = self.run
        model = build_student(run.cfg, run.out / STAGE1_NAME, run.preset_softmax, weights_dtype(run.rt, False))
        baseline, restored = restored_layer_kl(model.to(run.rt.device), run.validation_batches(run.kl_blocks),
                                               run.rt.autocast)
        means = run.rt.means([baseline, *restored.values()])
        return means[0], dict(zip(restored, means[1:]))

    def candidate_kl(self, restored: int | None) -> float:
        """One candidate's score with kl_train_steps K: the stage-1 student with layer `restored` (None: no
        layer) softmax, its LoRA adapters (stage 2's) trained K steps at the stage-2 lr, held constant, on
        `kl_distillation_loss`, every candidate on the same batches; then its mean per-token KL to the
        teacher on the validation batches, averaged over the ranks."""
        run = self.run
        cfg, rt = run.cfg, run.rt
        softmax = sorted(set(run.preset_softmax) | ({restored} if restored is not None else set()))
        # Every candidate's adapters start from the same draw, whichever candidates ran before it in this
        # process: a resumed selection scores as an uninterrupted one.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            model, _ = prepare_stage(build_student(cfg, run.out / STAGE1_NAME, softmax, weights_dtype(rt, False)),
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
        run = self.run
        cfg, rt = run.cfg, run.rt
        loader = run.make_loader(run.train_blocks, seed=cfg.seed + 2)
        batches = itertools.chain.from_iterable(itertools.repeat(loader))  # the loader's epochs, one after another
        ids = [next(batches).to(rt.device) for _ in range(cfg.kl_train_steps * cfg.grad_accum)]
        with rt.autocast(True):
            training = [(batch, kl_teacher_states(model, batch)) for batch in ids]
        validation = list(run.validation_batches(run.kl_blocks))
        return KLTeacher(training, validation, teacher_final_states(model, validation, rt.autocast))
