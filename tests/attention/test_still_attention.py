"""StillAttention splits long parallel calls into blocks that continue each other's state exactly, and
a prompt prefilled then decoded gives the whole sequence's logits, under every routing rule and with
the delta-rule memory."""

import itertools

import pytest
import torch
from tiny_models import TINY_OPTIONS, perturb_new_parameters, tiny_teacher
from transformers import DynamicCache

import linearize
from linearize.ops import backend
from linearize.ops import still as still_attention
from linearize.ops.backend import Form
from linearize.ops.still.routing import ROUTINGS


def forward(model, ids, cache=None):
    model.zero_grad()
    logits = model(ids, past_key_values=cache, use_cache=cache is not None).logits
    logits.square().mean().backward()
    return logits.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def still_model(routing, memory="np_map"):
    model = tiny_teacher()
    linearize.convert(model, "still", **TINY_OPTIONS["still"], routing=routing, memory=memory)
    perturb_new_parameters(model)
    return model


@pytest.mark.parametrize("routing", ["saliency", "diagonal", "dot", "key_norm", "uniform"])
def test_blocked_parallel_calls_equal_one_call(monkeypatch, routing):
    """The naive form in blocks continuing each other's state gives the fresh call's logits and
    gradients (which the chunked form computes in one call)."""
    model = still_model(routing)
    ids = torch.randint(3, 128, (2, 37), generator=torch.Generator().manual_seed(0))
    with backend.use_backend("torch"), backend.recording() as ran:
        whole, whole_grads = forward(model, ids)
    assert {impl for form, impl in ran if form == "chunk_still"} == {"torch-chunked"}
    naive_only = tuple(impl for impl in still_attention.CHUNK.implementations if impl.name != "torch-chunked")
    monkeypatch.setattr(still_attention, "CHUNK", Form("chunk_still", naive_only))
    monkeypatch.setattr(still_attention, "MAX_PARALLEL", 10)
    blocked, blocked_grads = forward(model, ids)
    torch.testing.assert_close(blocked, whole, atol=1e-5, rtol=1e-5)
    assert len(blocked_grads) == len(whole_grads)
    for a, b in zip(blocked_grads, whole_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    cached, _ = forward(model, ids, DynamicCache(config=model.config))  # with a cache, through the same path
    torch.testing.assert_close(cached, whole, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("routing", "memory"), [(routing, "np_map") for routing in ROUTINGS] + [("saliency", "delta")])
def test_prefill_then_decode_equals_the_whole_sequence(routing, memory):
    """A prefill, steps of one token, a chunk of six, steps again: past the budget (14) and through
    several chunks (4), so the slots fill and evict by the routing's scores in every form; the second
    row left-padded (its padding's logits are not compared). With `memory="delta"` the cache carries
    the memory's state too."""
    model = still_model(routing, memory)
    assert {layer.self_attn.cfg.routing for layer in model.model.layers} == {routing}
    ids = torch.randint(3, 128, (2, 30), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    cuts = [0, 11, *range(12, 21), 26, *range(27, 31)]
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        whole = model(ids, attention_mask=mask, use_cache=False).logits
        parts = [model(ids[:, a:b], attention_mask=mask[:, :b], past_key_values=cache).logits
                 for a, b in itertools.pairwise(cuts)]
    real = mask.bool()
    torch.testing.assert_close(torch.cat(parts, 1)[real], whole[real], atol=1e-5, rtol=1e-5)
    assert all(("memory_S" in layer.state) == (memory == "delta") for layer in cache.layers)
