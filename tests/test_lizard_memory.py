"""Lizard with the delta-rule memory (`memory="delta"`): full sequence == token by token, prefill then
decode, padding, save/load, a constant decode cache, gradients to its parameters, and the default
Lizard untouched."""

import pytest
import torch
from tiny_models import (
    TINY_OPTIONS,
    assert_left_padded_generates_like_unpadded,
    parameters_that_learn_alone,
    perturb_new_parameters,
    tiny_teacher,
)
from transformers import DynamicCache

import linearize
from linearize.attention import LinearizedAttention
from linearize.config import ConfigError
from linearize.ops import backend

OPTIONS = {**TINY_OPTIONS["lizard"], "chunk_size": 4, "memory": "delta"}


def with_memory(arch="llama", **overrides):
    model = tiny_teacher(arch)
    linearize.convert(model, "lizard", **{**OPTIONS, **overrides})
    perturb_new_parameters(model)
    return model


def attention_layers(model):
    return [m for m in model.modules() if isinstance(m, LinearizedAttention)]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_full_sequence_equals_token_by_token(arch):
    model = with_memory(arch)
    ids = torch.randint(3, 128, (2, 13), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache(config=model.config)
    with torch.no_grad(), backend.recording() as ran:
        full = model(ids, use_cache=False).logits
        steps = torch.cat([model(ids[:, t:t + 1], past_key_values=cache).logits for t in range(13)], 1)
    torch.testing.assert_close(steps, full, atol=1e-4, rtol=0)
    assert ("delta_rule_step", "torch") in ran and ("chunk_delta_rule", "torch") in ran


def test_prefill_then_decode_equals_full_sequence_and_the_memory_matters():
    model = with_memory()
    ids = torch.randint(3, 128, (2, 30), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        parts = [model(ids[:, a:b], past_key_values=cache).logits for a, b in [(0, 11), (11, 12), (12, 30)]]
        for layer in attention_layers(model):
            layer.memory_weight.zero_()
        without = model(ids, use_cache=False).logits
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-4, rtol=0)
    assert (without - full).abs().max() > 1e-3
    assert all(layer.state["memory_S"].shape == (2, 4, 16, 16) for layer in cache.layers)


def test_left_padded_batch_generates_like_unpadded():
    assert_left_padded_generates_like_unpadded(with_memory())


def test_gradients_reach_exactly_the_new_parameters():
    model = with_memory()
    new = {id(p) for m in attention_layers(model) for p in m.new_parameters()}
    assert parameters_that_learn_alone(model, [p for m in attention_layers(model) for p in m.new_parameters()]) == new
    layer = attention_layers(model)[0]
    assert {id(layer.memory_weight), id(layer.memory_write.weight)} <= new


def test_the_memory_starts_silent_so_the_default_lizard_is_unchanged():
    """At init (memory weight 0) a delta Lizard gives the default Lizard's logits; the default adds no
    parameter, so existing checkpoints load as before."""
    ids = torch.randint(3, 128, (2, 17), generator=torch.Generator().manual_seed(0))
    plain, delta = tiny_teacher(), tiny_teacher()
    linearize.convert(plain, "lizard", **TINY_OPTIONS["lizard"])
    linearize.convert(delta, "lizard", **{**TINY_OPTIONS["lizard"], "memory": "delta"})
    with torch.no_grad():
        torch.testing.assert_close(delta(ids).logits, plain(ids).logits, atol=1e-6, rtol=0)
    assert not any("memory" in name for name, _ in plain.named_parameters())


def test_a_vector_gate_is_refused():
    with pytest.raises(ConfigError, match="memory=delta"):
        linearize.convert(tiny_teacher(), "lizard", **{**OPTIONS, "gate": "vector"})


def test_the_memory_keeps_its_checkpoint_names():
    """Lizard's memory lives on the attention module under the names its checkpoints hold (it decays by
    the gate, so it has no decay parameter of its own)."""
    names = {name for name in with_memory().state_dict() if "memory" in name}
    assert names == {f"model.layers.{i}.self_attn.{key}" for i in range(2)
                     for key in ("memory_write.weight", "memory_write.bias", "memory_weight")}
