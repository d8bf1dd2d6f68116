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
  teacher; the top N stay softmax. With `kl_train_steps` K > 0 (`Run.select_by_kl`) each candidate is
  built with its layer softmax, its LoRA adapters trained K steps on `kl_distillation_loss`, and scored
  by `mean_kl`; with K = 0, `restored_layer_kl` scores the stage-1 student as it is, one forward per
  candidate layer.

A linearized layer switches between its own attention and the teacher's softmax by its
`attention_transfer` flag, which makes it return the teacher's output computed from the same
projections (stage 1's target): no weights are copied, and the model with every layer switched is the
teacher, whose distribution the KL is taken against.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext

import torch
from torch.nn import functional as F

from .losses import causal_lm_of, chunked_kl_divergence, linear_head

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
