"""StillAttention splits long parallel calls into blocks that continue each other's state exactly."""

import torch
from tiny_models import TINY_OPTIONS, perturb_new_parameters, tiny_teacher
from transformers import DynamicCache

import linearize
from linearize.ops import still as still_attention


def forward(model, ids, cache=None):
    model.zero_grad()
    logits = model(ids, past_key_values=cache, use_cache=cache is not None).logits
    logits.square().mean().backward()
    return logits.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_blocked_parallel_calls_equal_one_call(monkeypatch):
    model = tiny_teacher()
    linearize.convert(model, "still", **TINY_OPTIONS["still"])
    perturb_new_parameters(model)
    ids = torch.randint(3, 128, (2, 37), generator=torch.Generator().manual_seed(0))
    whole, whole_grads = forward(model, ids)
    monkeypatch.setattr(still_attention, "MAX_PARALLEL", 10)
    blocked, blocked_grads = forward(model, ids)
    torch.testing.assert_close(blocked, whole, atol=1e-5, rtol=1e-5)
    assert len(blocked_grads) == len(whole_grads)
    for a, b in zip(blocked_grads, whole_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    cached, _ = forward(model, ids, DynamicCache(config=model.config))  # with a cache, through the same path
    torch.testing.assert_close(cached, whole, atol=1e-5, rtol=1e-5)
