"""`chunked_cross_entropy` is `F.cross_entropy` over the full logits, and `chunked_kl_divergence` the KL
between two sets of full logits, value and gradients, without them."""

import pytest
import torch
import torch.nn.functional as F
from tiny_models import ARCHITECTURES, TINY_OPTIONS, tiny_teacher

from linearize.train.losses import IGNORE_INDEX, chunked_cross_entropy, chunked_kl_divergence, depending_on


def inputs(dtype, tokens=37, features=16, vocab=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, features, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, features, generator=g) / features**0.5).to(dtype).requires_grad_()
    labels = torch.randint(vocab, (tokens,), generator=g)
    labels[::5] = IGNORE_INDEX  # every fifth token ignored, the first included
    return hidden, weight, labels


def plain(hidden, weight, labels, softcap=None):
    logits = F.linear(hidden, weight).float()
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX)


def loss_and_grads(loss_fn, hidden, weight, labels, scale=1.0, teacher_first=False, **kwargs):
    """The loss and its gradients w.r.t. the hidden states and the weight; `labels` is the teacher's hidden
    states for a KL, which `teacher_first` passes before the weight."""
    h, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    loss = loss_fn(h, labels, w, **kwargs) if teacher_first else loss_fn(h, w, labels, **kwargs)
    (loss * scale).backward()
    return loss.detach(), h.grad, w.grad


TOLERANCES = {torch.float32: {}, torch.bfloat16: {"rtol": 2e-2, "atol": 2e-3}}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [8, 37, 1024])  # 8 does not divide the 37 tokens; 1024 takes all at once
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_chunked_equals_plain_cross_entropy_in_value_and_gradients(dtype, chunk, softcap):
    hidden, weight, labels = inputs(dtype)
    ours = loss_and_grads(chunked_cross_entropy, hidden, weight, labels, scale=0.5, chunk=chunk, softcap=softcap)
    reference = loss_and_grads(plain, hidden, weight, labels, scale=0.5, softcap=softcap)
    assert ours[0].dtype == torch.float32 and ours[1].dtype == ours[2].dtype == dtype
    for name, a, b in zip(("loss", "grad hidden", "grad weight"), ours, reference):
        torch.testing.assert_close(a, b, msg=name, **TOLERANCES[dtype])


def test_under_autocast_the_logits_are_bf16_as_a_linear_heads_are():
    """The trainer's case: float32 hidden states and head under bf16 autocast."""
    hidden, weight, labels = inputs(torch.float32, tokens=20)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = loss_and_grads(chunked_cross_entropy, hidden, weight, labels, chunk=6)
        reference = loss_and_grads(plain, hidden, weight, labels)
    assert ours[1].dtype == ours[2].dtype == torch.float32
    for name, a, b in zip(("loss", "grad hidden", "grad weight"), ours, reference):
        torch.testing.assert_close(a, b, msg=name, **TOLERANCES[torch.bfloat16])


def test_batched_inputs_a_frozen_head_and_no_grad():
    hidden, weight, labels = inputs(torch.float32, tokens=24)
    batched = hidden.detach().view(2, 12, -1).requires_grad_()
    loss = chunked_cross_entropy(batched, weight.detach(), labels.view(2, 12), chunk=5)
    loss.backward()
    torch.testing.assert_close(loss, plain(hidden, weight, labels))
    assert batched.grad.shape == (2, 12, hidden.shape[1])
    with torch.no_grad():
        torch.testing.assert_close(chunked_cross_entropy(hidden, weight, labels, chunk=5), loss.detach())


def test_every_label_ignored_gives_nan_and_zero_gradients_as_f_cross_entropy():
    hidden, weight, labels = inputs(torch.float32, tokens=6)
    ours = loss_and_grads(chunked_cross_entropy, hidden, weight, torch.full_like(labels, IGNORE_INDEX), chunk=4)
    assert ours[0].isnan() and not ours[1].any() and not ours[2].any()


def test_bad_shapes_are_refused():
    hidden, weight, labels = inputs(torch.float32, tokens=6)
    with pytest.raises(ValueError, match="differ in their tokens"):
        chunked_cross_entropy(hidden, weight, labels[:5])
    with pytest.raises(ValueError, match="does not take"):
        chunked_cross_entropy(hidden, weight.t(), labels)
    with pytest.raises(ValueError, match="chunk"):
        chunked_cross_entropy(hidden, weight, labels, chunk=0)


def test_depending_on_puts_a_tensor_in_the_graph_with_a_zero_gradient():
    """What keeps FSDP2's pre-backward hook on the root's (one-position) logits firing."""
    x = torch.randn(3, requires_grad=True)
    other = (x * 2).requires_grad_()
    fired = []
    other.register_hook(lambda grad: fired.append(grad.clone()))
    loss = depending_on((x**2).sum(), other)
    loss.backward()
    assert torch.equal(loss, (x**2).sum()) and torch.equal(x.grad, 2 * x.detach())
    assert len(fired) == 1 and not fired[0].any()
    with torch.no_grad():
        value = x.sum()
        assert depending_on(value, other) is value


def _loss_and_grads(model, loss_fn, ids):
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model, ids)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(ours, theirs, **tolerances):
    torch.testing.assert_close(ours[0], theirs[0], **tolerances)
    assert ours[1].keys() == theirs[1].keys() and ours[1]
    for name in ours[1]:
        torch.testing.assert_close(ours[1][name], theirs[1][name], msg=name, **tolerances)


def _own_loss(model, ids):
    return model(input_ids=ids, labels=ids, use_cache=False).loss


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_stage2_loss_is_the_models_own_loss_without_full_logits(arch):
    """Every parameter's gradient too (a full fine-tune: the head's weight gets one); Gemma 2 soft-caps
    its logits. The head only ever sees one position."""
    from linearize.train.losses import stage_loss

    model = tiny_teacher(arch).train()
    assert (arch == "gemma2") == (getattr(model.config, "final_logit_softcapping", None) is not None)
    ids = torch.randint(3, 100, (2, 24), generator=torch.Generator().manual_seed(0))
    positions = []
    model.get_output_embeddings().register_forward_hook(lambda m, args, out: positions.append(args[0].shape[1]))
    ours = _loss_and_grads(model, lambda m, x: stage_loss(m, x, 2), ids)
    assert positions == [1]
    _assert_same(ours, _loss_and_grads(model, _own_loss, ids))


def _lora_student(teacher):
    """(model, trained names): stage 2 of the recipes' Lizard on `teacher`, its lora_B moved off zero,
    where it starts and would leave lora_A without a gradient."""
    from linearize.train import DistillConfig
    from linearize.train.student import linearized_student, prepare_stage

    cfg = DistillConfig(model="tiny", method="lizard", out="unused", options=TINY_OPTIONS["lizard"])
    model, names = prepare_stage(linearized_student(teacher, cfg), cfg, 2)
    model.train()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.1, generator=torch.Generator().manual_seed(2))
    return model, names


@pytest.mark.parametrize("autocast", [False, True])
def test_stage2_loss_of_a_linearized_student_with_lora_is_its_own_loss(autocast):
    """The distillation's stage 2: LoRA on the student's q/k/v; under autocast, the teacher's weights in
    bf16 as a bf16 run loads them (its buffers float32, as loading leaves them). Only the adapters get
    gradients."""
    from linearize.train.losses import stage_loss

    teacher = tiny_teacher()
    if autocast:
        for p in teacher.parameters():
            p.data = p.data.to(torch.bfloat16)
    model, names = _lora_student(teacher)
    assert {p.dtype for n, p in model.named_parameters() if n in names} == {torch.float32}
    ids = torch.randint(3, 100, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        ours = _loss_and_grads(model, lambda m, x: stage_loss(m, x, 2), ids)
        theirs = _loss_and_grads(model, _own_loss, ids)
    assert set(ours[1]) == names and all(g.any() for g in ours[1].values())
    _assert_same(ours, theirs, **({"rtol": 2e-2, "atol": 1e-4} if autocast else {}))


@pytest.mark.parametrize("method", ["lizard", "still"])
def test_stage1_under_activation_checkpointing_keeps_the_forwards_losses_and_gradients(method):
    """Checkpointing re-runs each decoder layer's forward in the backward. The losses the step returned
    stay the layers' record (a loss kept from the recomputation would hold that layer's recomputed
    activations until the next step: every layer's, by the end of the backward), the gradients are the
    ones without checkpointing, and no gradient crosses a layer: each one's loss is its own."""
    from linearize.train import DistillConfig
    from linearize.train.losses import stage_loss
    from linearize.train.student import enable_checkpointing, linearized_layers, linearized_student, prepare_stage

    cfg = DistillConfig(model="tiny", method=method, out="unused", options=TINY_OPTIONS[method])
    model, names = prepare_stage(linearized_student(tiny_teacher(), cfg), cfg, 1)
    model.train()
    ids = torch.randint(3, 100, (2, 24), generator=torch.Generator().manual_seed(0))
    plain = _loss_and_grads(model, lambda m, x: stage_loss(m, x, 1), ids)
    enable_checkpointing(model)
    inputs = []
    for layer in model.model.layers:
        layer.register_forward_pre_hook(lambda m, args, kwargs: inputs.append(kwargs.get("hidden_states", *args[:1])),
                                        with_kwargs=True)
    recorded = []

    def recording_loss(m, x):
        loss = stage_loss(m, x, 1)
        recorded.extend(layer.transfer_loss for layer in linearized_layers(m))
        return loss

    checkpointed = _loss_and_grads(model, recording_loss, ids)
    layers = linearized_layers(model)
    assert len(recorded) == len(layers) > 1
    assert all(layer.transfer_loss is kept for layer, kept in zip(layers, recorded, strict=True))
    assert inputs and not any(hidden.requires_grad for hidden in inputs)
    assert set(checkpointed[1]) == names and any(g.any() for g in checkpointed[1].values())
    _assert_same(checkpointed, plain)


def test_stage2_under_activation_checkpointing_has_the_same_gradients():
    """Without the embeddings' output requiring a gradient (`enable_checkpointing`), the adapters of
    every layer still get theirs: non-reentrant checkpointing needs no input that requires one."""
    from linearize.train.losses import stage_loss
    from linearize.train.student import enable_checkpointing

    model, names = _lora_student(tiny_teacher())
    ids = torch.randint(3, 100, (2, 24), generator=torch.Generator().manual_seed(1))
    plain = _loss_and_grads(model, lambda m, x: stage_loss(m, x, 2), ids)
    enable_checkpointing(model)
    checkpointed = _loss_and_grads(model, lambda m, x: stage_loss(m, x, 2), ids)
    assert set(checkpointed[1]) == names and all(g.any() for g in checkpointed[1].values())
    _assert_same(checkpointed, plain)


def plain_kl(hidden, teacher_hidden, weight, softcap=None):
    """Mean over tokens of KL(teacher || student) from the full float32 logits, the teacher's detached."""
    logits, target = F.linear(hidden, weight).float(), F.linear(teacher_hidden, weight).float().detach()
    if softcap is not None:
        logits, target = (torch.tanh(x / softcap) * softcap for x in (logits, target))
    log_q, log_p = logits.log_softmax(-1), target.log_softmax(-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1).mean()


def kl_inputs(dtype, tokens=37):
    hidden, weight, _ = inputs(dtype, tokens=tokens)
    # The teacher's states near the student's, as a distilled student's are, so the two distributions overlap.
    g = torch.Generator().manual_seed(3)
    teacher_hidden = (hidden.detach().float() + 0.5 * torch.randn(hidden.shape, generator=g)).to(dtype).requires_grad_()
    return hidden, teacher_hidden, weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [8, 37, 1024])
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_chunked_kl_equals_the_kl_of_the_full_logits_in_value_and_gradients(dtype, chunk, softcap):
    hidden, teacher_hidden, weight = kl_inputs(dtype)
    ours = loss_and_grads(chunked_kl_divergence, hidden, weight, teacher_hidden, scale=0.5, chunk=chunk, softcap=softcap,
                          teacher_first=True)
    reference = loss_and_grads(plain_kl, hidden, weight, teacher_hidden, scale=0.5, softcap=softcap, teacher_first=True)
    assert ours[0].dtype == torch.float32 and ours[1].dtype == ours[2].dtype == dtype
    assert ours[0] > 0.05  # the two distributions differ: the gradients are not all ~0
    for name, a, b in zip(("loss", "grad hidden", "grad weight"), ours, reference):
        torch.testing.assert_close(a, b, msg=name, **TOLERANCES[dtype])


def test_the_chunked_kl_sends_no_gradient_to_the_teacher_and_is_zero_against_itself():
    hidden, teacher_hidden, weight = kl_inputs(torch.float32, tokens=20)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = chunked_kl_divergence(hidden, teacher_hidden, weight, chunk=6)
        reference = plain_kl(hidden, teacher_hidden, weight)
    torch.testing.assert_close(loss, reference.float(), **TOLERANCES[torch.bfloat16])
    loss.backward()
    assert teacher_hidden.grad is None and hidden.grad is not None and weight.grad is not None
    same = chunked_kl_divergence(hidden.detach(), hidden.detach(), weight.detach(), chunk=7)
    assert abs(same.item()) < 1e-6
    with pytest.raises(ValueError, match="differ"):
        chunked_kl_divergence(hidden, teacher_hidden[:5], weight)
