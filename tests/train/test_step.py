"""`TrainStep`: one optimizer step, eager or replayed from a CUDA graph, equal to the plain loop."""

from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
from tiny_models import TINY_OPTIONS, tiny_teacher

from linearize.convert import convert
from linearize.train.losses import stage_loss
from linearize.train.runtime import average_gradients
from linearize.train.step import WARMUP_STEPS, TrainStep, failing_line, graphable_optimizer, rates_on_device

# STILL's routing reads the device back unless every chunk's picks fit the slots (as they do at its
# training length): these options make them fit 24-token batches, so its step can be captured too.
GRAPHED_STUDENTS = {"lizard": TINY_OPTIONS["lizard"],
                    "still": {"window": 8, "budget": 14, "chunk_size": 4, "max_chunks": 6}}


def student(device="cpu", method="lizard"):
    options = GRAPHED_STUDENTS[method]
    model = convert(tiny_teacher(), method, **options).to(device).train()
    for name, p in model.named_parameters():
        p.requires_grad_(not name.startswith(("model.embed", "lm_head")))
    return model


def batches(steps, accum, device="cpu"):
    generator = torch.Generator().manual_seed(3)
    return [[torch.randint(3, 128, (2, 24), generator=generator).to(device) for _ in range(accum)]
            for _ in range(steps)]


def plain_loop(model, optimizer, params, data, autocast=nullcontext):
    """The loop TrainStep replaces, written out."""
    losses, norms = [], []
    for micro_batches in data:
        loss_sum = 0.0
        for ids in micro_batches:
            with autocast():
                loss = stage_loss(model, ids, 2)
            (loss / len(micro_batches)).backward()
            loss_sum += loss.item() / len(micro_batches)
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, 1.0)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss_sum)
    return losses, norms


def trained(model):
    return [p for p in model.parameters() if p.requires_grad]


@pytest.mark.parametrize(("cuda_graph", "uncapturable", "path"), [
    (False, None, "eager"),
    (True, None, "eager (parameters not on a CUDA device)"),
    (True, "FSDP2's hooks", "eager (FSDP2's hooks)"),
    (False, "FSDP2's hooks", "eager"),
])
def test_eager_step_equals_the_plain_loop_with_accumulation(cuda_graph, uncapturable, path):
    """On the CPU, or where the caller says the step cannot be captured, asking for a graph steps
    eagerly and says why."""
    data = batches(3, accum=2)
    reference = student()
    ref_losses, ref_norms = plain_loop(reference, torch.optim.AdamW(trained(reference), lr=1e-2), trained(reference),
                                       data)
    model = student()
    step = TrainStep(lambda ids: stage_loss(model, ids, 2), trained(model), torch.optim.AdamW(trained(model), lr=1e-2),
                     1.0, lambda cache: nullcontext(), cuda_graph=cuda_graph, uncapturable=uncapturable)
    results = [step(micro_batches) for micro_batches in data]
    assert step.path == path
    assert [float(loss) for loss, _ in results] == pytest.approx(ref_losses, rel=1e-6)
    assert [float(norm) for _, norm in results] == pytest.approx(ref_norms, rel=1e-6)
    for p, q in zip(trained(model), trained(reference), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert all(p.grad is None for p in trained(model))


def paired(data):
    """Each micro-batch with a second tensor the loss takes beside its ids: a per-sequence weight."""
    return [[(ids, 1.0 + ids[:, 0].float() / 128) for ids in micro_batches] for micro_batches in data]


def weighted_loss(model, ids, weights):
    return stage_loss(model, ids, 2) * weights.mean()


def test_a_micro_batch_may_be_a_tuple_that_the_loss_takes_whole():
    """(ids, what was computed on them before): the eager step is the plain loop over the same tuples."""
    data = paired(batches(3, accum=2))
    reference = student()
    optimizer = torch.optim.AdamW(trained(reference), lr=1e-2)
    for micro_batches in data:
        for ids, weights in micro_batches:
            (weighted_loss(reference, ids, weights) / len(micro_batches)).backward()
        torch.nn.utils.clip_grad_norm_(trained(reference), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    model = student()
    step = TrainStep(lambda batch: weighted_loss(model, *batch), trained(model),
                     torch.optim.AdamW(trained(model), lr=1e-2), 1.0, lambda cache: nullcontext())
    for micro_batches in data:
        step(micro_batches)
    for p, q in zip(trained(model), trained(reference), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


@pytest.mark.filterwarnings(r"ignore:Detected call of `lr_scheduler.step\(\)` before")
def test_a_graphable_optimizer_keeps_device_rates_that_a_scheduler_fills_in_place():
    """A replayed step reads the rate through the tensor the graph captured: the scheduler must fill that
    tensor, never replace it. A checkpoint of an eager run brings float rates back: they become tensors."""
    p = torch.nn.Parameter(torch.zeros(3))
    optimizer = graphable_optimizer([{"params": [p], "lr": 0.5}], torch.device("cpu"), betas=(0.9, 0.99))
    rate = optimizer.param_groups[0]["lr"]
    assert isinstance(rate, torch.Tensor) and optimizer.defaults["capturable"]
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (s + 1))
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] is rate and float(rate) == pytest.approx(0.25)
    optimizer.param_groups[0]["lr"] = 0.125
    rates_on_device(optimizer, torch.device("cpu"))
    assert isinstance(optimizer.param_groups[0]["lr"], torch.Tensor) and float(optimizer.param_groups[0]["lr"]) == 0.125


def test_a_failure_is_placed_at_the_code_that_called_into_torch():
    """A capture refused deep inside torch is reported where our (or HF's) code asked for it."""
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([float("nan"), 0.0])

    def clip():
        torch.nn.utils.clip_grad_norm_([p], 1.0, error_if_nonfinite=True)

    with pytest.raises(RuntimeError) as caught:
        clip()
    assert failing_line(caught.value).startswith("test_step.py:")
    assert failing_line(caught.value).endswith("(clip)")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("method", GRAPHED_STUDENTS)
@pytest.mark.parametrize("accum", [1, 2])
def test_a_graphed_step_trains_as_the_eager_loop_does(accum, method):
    """Warm-up steps, the capture, then replays on new micro-batches: same losses and parameters as the
    plain loop, under bf16 autocast as the trainer runs (float32 master weights)."""
    device = torch.device("cuda")
    data = batches(WARMUP_STEPS + 4, accum, device)

    def autocast(cache=True):
        return torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=cache)

    reference = student(device, method)
    groups = [{"params": trained(reference), "lr": 1e-3}]
    ref_losses, _ = plain_loop(reference, graphable_optimizer(groups, device), trained(reference), data,
                               autocast=lambda: autocast())
    model = student(device, method)
    optimizer = graphable_optimizer([{"params": trained(model), "lr": 1e-3}], device)
    step = TrainStep(lambda ids: stage_loss(model, ids, 2), trained(model), optimizer, 1.0, autocast, cuda_graph=True)
    losses = [float(step(micro_batches)[0]) for micro_batches in data]
    assert step.path == "cuda graph"
    assert losses == pytest.approx(ref_losses, rel=2e-2)
    for p, q in zip(trained(model), trained(reference), strict=True):
        torch.testing.assert_close(p, q, rtol=2e-2, atol=2e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_graphed_step_replays_on_each_tensor_of_a_tuple_micro_batch():
    """The graph holds a copy of every tensor of a tuple micro-batch and replays on the new values of each:
    the weights change every step, so a replay that kept the captured ones would drift from the loop."""
    device = torch.device("cuda")
    data = paired(batches(WARMUP_STEPS + 4, 2, device))

    def autocast(cache=True):
        return torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=cache)

    reference = student(device)
    optimizer = graphable_optimizer([{"params": trained(reference), "lr": 1e-3}], device)
    ref_losses = []
    for micro_batches in data:
        total = 0.0
        for ids, weights in micro_batches:
            with autocast():
                loss = weighted_loss(reference, ids, weights)
            (loss / len(micro_batches)).backward()
            total += loss.item() / len(micro_batches)
        torch.nn.utils.clip_grad_norm_(trained(reference), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ref_losses.append(total)
    model = student(device)
    step = TrainStep(lambda batch: weighted_loss(model, *batch), trained(model),
                     graphable_optimizer([{"params": trained(model), "lr": 1e-3}], device), 1.0, autocast,
                     cuda_graph=True)
    losses = [float(step(micro_batches)[0]) for micro_batches in data]
    assert step.path == "cuda graph"
    assert losses == pytest.approx(ref_losses, rel=2e-2)
    for p, q in zip(trained(model), trained(reference), strict=True):
        torch.testing.assert_close(p, q, rtol=2e-2, atol=2e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_graphed_step_holds_the_gradient_all_reduce_of_replicas():
    """Under torchrun, replicas average their gradients in one NCCL all-reduce before clipping; the
    capture must hold it (a one-rank group here: the mean over one rank is the gradient itself)."""
    device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    try:
        data = batches(WARMUP_STEPS + 3, 2, device)
        reference = student(device)
        ref_losses, _ = plain_loop(reference, graphable_optimizer([{"params": trained(reference), "lr": 1e-3}], device),
                                   trained(reference), data)
        model = student(device)
        optimizer = graphable_optimizer([{"params": trained(model), "lr": 1e-3}], device)
        step = TrainStep(lambda ids: stage_loss(model, ids, 2), trained(model), optimizer, 1.0,
                         lambda cache: nullcontext(), cuda_graph=True,
                         before_clip=lambda: average_gradients(trained(model), 1))
        losses = [float(step(micro_batches)[0]) for micro_batches in data]
        assert step.path == "cuda graph"
        assert losses == pytest.approx(ref_losses, rel=1e-4)
        for p, q in zip(trained(model), trained(reference), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
    finally:
        dist.destroy_process_group()
