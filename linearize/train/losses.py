"""The distillation's losses: each stage's (`stage_loss`), and next-token cross-entropy and KL over a
large vocabulary without the [tokens, vocab] logits (`chunked_cross_entropy`, `chunked_kl_divergence`).

A causal LM's loss is usually taken on its full logits: for 16K tokens of Llama-3's 128K vocabulary
those are 4 GiB in bf16, 8 GiB once HF upcasts them to float32 for the loss, and their gradient as
much again; Qwen3's 152K vocabulary adds a fifth. `chunked_cross_entropy` takes the hidden states and
the head's weight instead and goes over `chunk` tokens at a time: a chunk's logits, their
log-sum-exp, the target's logit and, when a gradient will be wanted, the chunk's gradients w.r.t. the
hidden states and the weight, computed there and then from the chunk's logits, which are then freed.
The backward pass only scales those gradients by the incoming one. So at most one chunk's logits
exist at a time, and the head's GEMMs are the plain loss's (one forward, one or two for the
gradients), none recomputed.

The arithmetic is the plain loss's, chunk by chunk: logits in the matmul's dtype (bf16 under autocast),
upcast to float32, optionally soft-capped (Gemma 2: softcap * tanh(logits / softcap)), and the
mean over the labels that are not `ignore_index`, as `F.cross_entropy(logits.float(), labels)`.
Nothing reads back from the device, so a CUDA graph can hold it. `chunked_kl_divergence` goes the same
way over a teacher's and a student's hidden states, the teacher's logits a constant target.
"""

from __future__ import annotations

import torch
from torch import nn

from .masking import unpadded_attention
from .student import linearized_layers

IGNORE_INDEX = -100  # HF's and F.cross_entropy's default
CHUNK = 1024  # tokens a chunk: 1024 x 128K float32 logits are 0.5 GiB


class TrainingDiverged(ValueError):
    """A stage's loss or gradient norm stopped being finite. Nothing is saved once it is seen: a checkpoint
    or model of non-finite weights would only fail later, in whatever loads it."""


def compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype of the logits' matmul: autocast's where it is on (as an nn.Linear head gets), else the
    operands' common dtype."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(hidden.dtype, weight.dtype)


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, chunk: int = CHUNK,
                          ignore_index: int = IGNORE_INDEX, softcap: float | None = None) -> torch.Tensor:
    """Mean cross-entropy of the logits `hidden @ weight.T` ([..., hidden] @ [vocab, hidden]) against
    `labels` ([...], the same leading shape), skipping `ignore_index`, as
    `F.cross_entropy(F.linear(hidden, weight).float().flatten(0, -2), labels.flatten(), ignore_index=...)`
    (with `softcap`, of softcap * tanh(logits / softcap)), `chunk` tokens at a time. A float32 scalar;
    NaN where every label is ignored, as F.cross_entropy gives."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1 token, got {chunk}")
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"hidden states {tuple(hidden.shape)} and labels {tuple(labels.shape)} differ in their tokens")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"head weight {tuple(weight.shape)} does not take hidden states of {hidden.shape[-1]} features")
    return _ChunkedCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1), chunk,
                                      ignore_index, softcap, compute_dtype(hidden, weight))


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk, ignore_index, softcap, dtype):
        want_hidden, want_weight = ctx.needs_input_grad[:2]  # all False under no_grad
        valid = labels != ignore_index
        targets = labels.masked_fill(~valid, 0)[:, None]
        count = valid.sum()
        # Each token's share of the mean (0 for ignored ones); clamped so that all-ignored gives zero gradients.
        share = valid.float() / count.clamp(min=1)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty(hidden.shape, dtype=dtype, device=hidden.device) if want_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            for start in range(0, hidden.shape[0], chunk):
                end = min(start + chunk, hidden.shape[0])
                h = hidden[start:end].to(dtype)
                logits, tanh = _capped((h @ w.t()).float(), softcap)
                lse = torch.logsumexp(logits, dim=-1)
                picked = logits.gather(1, targets[start:end]).squeeze(1)
                total = total + ((lse - picked) * valid[start:end]).sum()
                if not (want_hidden or want_weight):
                    continue
                # d loss / d logits: (softmax - one-hot at the target) times the token's share, in place.
                grad = logits.sub_(lse[:, None]).exp_()
                grad.scatter_add_(1, targets[start:end], -valid[start:end, None].float())
                grad.mul_(share[start:end, None])
                _add_chunk_gradients(grad, tanh, h, w, grad_hidden, grad_weight, start)
        _keep_gradients(ctx, grad_hidden, grad_weight, hidden, weight)
        return total / count

    @staticmethod
    def backward(ctx, grad_loss):
        return *_scaled_gradients(ctx, grad_loss), None, None, None, None, None


def _add_chunk_gradients(grad: torch.Tensor, tanh: torch.Tensor | None, h: torch.Tensor, w: torch.Tensor,
                         grad_hidden: torch.Tensor | None, grad_weight: torch.Tensor | None, start: int) -> None:
    """A chunk's share of the gradients, from `grad`, d loss / d (soft-capped) logits of the chunk's
    tokens from `start` on: through the soft-cap (`tanh`, which it overwrites), then into those rows of
    `grad_hidden` and onto `grad_weight` (each where wanted), in the matmul's dtype (`h`'s and `w`'s)."""
    if tanh is not None:
        grad.mul_(tanh.mul_(tanh).neg_().add_(1))  # d softcap*tanh(x/softcap) / dx = 1 - tanh^2
    grad = grad.to(h.dtype)
    if grad_hidden is not None:
        grad_hidden[start:start + grad.shape[0]] = grad @ w
    if grad_weight is not None:
        grad_weight += grad.t() @ h


def _keep_gradients(ctx, grad_hidden, grad_weight, hidden: torch.Tensor, weight: torch.Tensor) -> None:
    ctx.save_for_backward(grad_hidden, grad_weight)
    ctx.dtypes = (hidden.dtype, weight.dtype)


def _scaled_gradients(ctx, grad_loss) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The (hidden, weight) gradients a chunked loss's forward computed, times the incoming gradient."""
    grad_hidden, grad_weight = ctx.saved_tensors
    hidden_dtype, weight_dtype = ctx.dtypes
    if grad_hidden is not None:
        grad_hidden = (grad_hidden.float() * grad_loss).to(hidden_dtype)
    if grad_weight is not None:
        grad_weight = (grad_weight * grad_loss).to(weight_dtype)
    return grad_hidden, grad_weight


def _capped(logits: torch.Tensor, softcap: float | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """softcap * tanh(logits / softcap) and the tanh (for the gradient), or the logits as they are."""
    if softcap is None:
        return logits, None
    tanh = torch.tanh(logits / softcap)
    return tanh * softcap, tanh


def chunked_kl_divergence(hidden: torch.Tensor, teacher_hidden: torch.Tensor, weight: torch.Tensor, *,
                          chunk: int = CHUNK, softcap: float | None = None) -> torch.Tensor:
    """Mean over tokens of KL(p_teacher || p) between the next-token distributions of the logits
    `hidden @ weight.T` and `teacher_hidden @ weight.T` (both [..., hidden], the same tokens; with
    `softcap`, of softcap * tanh(logits / softcap)), as the same sum over the full float32 logits,
    `chunk` tokens at a time. A float32 scalar (float64 from float64 states), whose gradient reaches
    `hidden` and `weight` through the student's logits alone: the teacher's distribution is the target,
    as if taken under no_grad."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1 token, got {chunk}")
    if hidden.shape != teacher_hidden.shape:
        raise ValueError(f"hidden states {tuple(hidden.shape)} and the teacher's {tuple(teacher_hidden.shape)} differ")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"head weight {tuple(weight.shape)} does not take hidden states of {hidden.shape[-1]} features")
    features = hidden.shape[-1]
    return _ChunkedKL.apply(hidden.reshape(-1, features), teacher_hidden.detach().reshape(-1, features), weight,
                            chunk, softcap, compute_dtype(hidden, weight))


class _ChunkedKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, teacher_hidden, weight, chunk, softcap, dtype):
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
        tokens = hidden.shape[0]
        wide = torch.promote_types(dtype, torch.float32)  # the logits' dtype: float32, or float64 kept
        total = torch.zeros((), dtype=wide, device=hidden.device)
        grad_hidden = torch.empty(hidden.shape, dtype=dtype, device=hidden.device) if want_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=wide, device=weight.device) if want_weight else None
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            for start in range(0, tokens, chunk):
                end = min(start + chunk, tokens)
                h = hidden[start:end].to(dtype)
                # In place where it can: four [chunk, vocab] tensors at most (five with a soft-cap).
                logits, tanh = _capped((h @ w.t()).to(wide), softcap)
                log_q = logits.sub_(torch.logsumexp(logits, dim=-1, keepdim=True))
                target, _ = _capped((teacher_hidden[start:end].to(dtype) @ w.t()).to(wide), softcap)
                log_p = target.sub_(torch.logsumexp(target, dim=-1, keepdim=True))
                p = log_p.exp()
                total = total + torch.sub(log_p, log_q).mul_(p).sum()
                if not (want_hidden or want_weight):
                    continue
                # d KL / d logits = softmax(logits) - p, over the mean's tokens.
                grad = log_q.exp_().sub_(p).div_(tokens)
                _add_chunk_gradients(grad, tanh, h, w, grad_hidden, grad_weight, start)
        _keep_gradients(ctx, grad_hidden, grad_weight, hidden, weight)
        return total / tokens

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = _scaled_gradients(ctx, grad_loss)
        return grad_hidden, None, grad_weight, None, None, None


def depending_on(value: torch.Tensor, *others: torch.Tensor) -> torch.Tensor:
    """`value`, with `others` put in its autograd graph: backward gives them zero gradients. For a loss
    taken beside a module's output rather than from it: hooks that run when the output's gradient
    arrives (FSDP2's pre-backward unshard of the root's weights) then still run."""
    others = tuple(t for t in others if t.requires_grad)
    return _DependingOn.apply(value, *others) if others and torch.is_grad_enabled() else value


class _DependingOn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, value, *others):
        ctx.others = [(t.shape, t.dtype, t.device) for t in others]
        return value.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, *(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.others)


def stage_loss(model, input_ids: torch.Tensor, stage: int) -> torch.Tensor:
    """One packed (unpadded) batch's loss: next-token cross-entropy in stage 2 (`next_token_loss`), the
    mean of the layers' attention-transfer errors in stage 1."""
    with unpadded_attention(model):
        if stage == 2:
            return next_token_loss(model, input_ids)
        layers = linearized_layers(model)
        for layer in layers:  # each layer records its first loss of the step
            layer.transfer_loss = None
        # Through the full model (FSDP's root) but with logits for one position only: stage 1 needs
        # just the per-layer losses recorded on the way.
        model(input_ids=input_ids, use_cache=False, logits_to_keep=1)
    losses = [layer.transfer_loss for layer in layers]
    return torch.stack(losses).float().mean()


def causal_lm_of(model):
    """The HF causal LM itself, under peft's wrapper or not."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def linear_head(model) -> tuple[nn.Linear | None, float | None]:
    """The model's output head where it is a bias-free Linear, whose logits the chunked losses form from
    the final hidden states (None for any other head: the loss then takes HF's logits), and the logits'
    soft-cap (Gemma 2 caps them)."""
    causal_lm = causal_lm_of(model)
    head = causal_lm.get_output_embeddings()
    linear = isinstance(head, nn.Linear) and head.bias is None
    return (head if linear else None), getattr(causal_lm.config, "final_logit_softcapping", None)


def next_token_loss(model, input_ids: torch.Tensor) -> torch.Tensor:
    """`model(input_ids=input_ids, labels=input_ids).loss` (HF's mean next-token cross-entropy), taken by
    `chunked_cross_entropy` so that no [tokens, vocab] logits exist (8 GiB in float32 for 16K tokens of a
    128K vocabulary). The loss comes from a forward hook on the decoder, on its final hidden states, while
    the whole model (under peft, through its wrapper; under FSDP2, the root, whose weights, the head's
    among them, are gathered then) runs with logits for one position only. Those logits stay in the
    loss's graph (with zero gradient): FSDP2 gathers the root's weights again for the backward (the
    final norm's) when their gradient arrives. A head other than a bias-free Linear takes HF's own loss."""
    head, softcap = linear_head(model)
    if head is None:
        return model(input_ids=input_ids, labels=input_ids, use_cache=False).loss
    # Token t predicts token t + 1; the last one predicts nothing.
    labels = torch.cat([input_ids[:, 1:], input_ids.new_full((input_ids.shape[0], 1), IGNORE_INDEX)], dim=1)
    losses = []

    def loss_from(module, args, output):
        losses.append(chunked_cross_entropy(output[0], head.weight, labels, softcap=softcap))

    handle = causal_lm_of(model).get_decoder().register_forward_hook(loss_from)
    try:
        logits = model(input_ids=input_ids, use_cache=False, logits_to_keep=1).logits
    finally:
        handle.remove()
    return depending_on(losses[0], logits)
