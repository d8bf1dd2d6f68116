"""Lizard with the sparse cache (`sparse_slots`): full sequence == prefill then decode, padding,
save/load, a constant decode cache, and `sparse_slots=0` the default Lizard exactly."""

import pytest
import torch
from tiny_models import (
    TINY_OPTIONS,
    assert_left_padded_generates_like_unpadded,
    perturb_new_parameters,
    tiny_teacher,
)
from transformers import DynamicCache

import linearize
from linearize.config import ConfigError
from linearize.loading import load_model
from linearize.ops import backend

OPTIONS = {**TINY_OPTIONS["lizard"], "chunk_size": 4, "combine": "shared", "sparse_slots": 3}


def with_cache(arch="llama", **overrides):
    model = tiny_teacher(arch)
    linearize.convert(model, "lizard", **{**OPTIONS, **overrides})
    perturb_new_parameters(model)
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_prefill_then_decode_equals_full_sequence_and_the_cache_matters(arch):
    model = with_cache(arch)
    ids = torch.randint(3, 128, (2, 30), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache(config=model.config)
    with torch.no_grad(), backend.recording() as ran:
        full = model(ids, use_cache=False).logits
        parts = [model(ids[:, a:b], past_key_values=cache).logits for a, b in [(0, 11), (11, 12), (12, 13), (13, 30)]]
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-4, rtol=0)
    assert {("chunk_sparse_cache", "torch"), ("continue_sparse_cache", "torch"), ("sparse_cache_step", "torch")} <= set(ran)
    shapes = {name: tuple(t.shape) for name, t in cache.layers[0].state.items()}
    assert shapes["cache_k"] == (2, 2, 3, 16) and shapes["ring_k"] == (2, 2, 8, 16)
    # From token 8 on, token 0 and others have left the 8-token window: the cache changes the output.
    plain = with_cache(arch, sparse_slots=0)
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        without = plain(ids, use_cache=False).logits
    torch.testing.assert_close(without[:, :8], full[:, :8], atol=1e-5, rtol=0)
    assert (without[:, 8:] - full[:, 8:]).abs().max() > 1e-3


def test_the_decode_cache_keeps_its_size():
    model = with_cache()
    ids = torch.randint(3, 128, (1, 24), generator=torch.Generator().manual_seed(1))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :4], past_key_values=cache)
        sizes = [layer.nbytes() for layer in cache.layers]
        for t in range(4, 24):
            model(ids[:, t:t + 1], past_key_values=cache)
            assert [layer.nbytes() for layer in cache.layers] == sizes


def test_left_padded_batch_generates_like_unpadded():
    assert_left_padded_generates_like_unpadded(with_cache())


def test_save_and_load_keep_the_cache_and_the_logits(tmp_path):
    model = with_cache()
    ids = torch.randint(3, 128, (2, 20), generator=torch.Generator().manual_seed(2))
    model.save_pretrained(tmp_path)
    loaded = load_model(tmp_path)
    assert loaded.config.linearize["options"]["sparse_slots"] == 3
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=0, rtol=0)


def test_gradients_reach_the_cached_tokens():
    model = with_cache(window=2)
    ids = torch.randint(3, 128, (1, 16), generator=torch.Generator().manual_seed(3))
    model(ids, labels=ids).loss.backward()
    layer = next(m for m in model.modules() if isinstance(m, linearize.attention.LinearizedAttention))
    assert layer.feature_map_q.weight.grad.abs().sum() > 0 and layer.sinks.grad.abs().sum() > 0


def test_a_long_sequence_trains_through_the_parallel_form():
    """A training step at 256 tokens runs the parallel pass (no loop of decode steps), and its gradients
    reach every new parameter in use (`alpha` is not, under the shared normaliser)."""
    model = with_cache()
    ids = torch.randint(3, 128, (1, 256), generator=torch.Generator().manual_seed(5))
    with backend.recording() as ran:
        model(ids, labels=ids).loss.backward()
    assert {form for form, _ in ran if "sparse_cache" in form} == {"chunk_sparse_cache"}
    layer = next(m for m in model.modules() if isinstance(m, linearize.attention.LinearizedAttention))
    for name, parameter in layer.named_parameters():
        if "proj" not in name and name != "alpha":
            assert torch.isfinite(parameter.grad).all() and parameter.grad.abs().sum() > 0, name


def test_no_slots_is_the_default_lizard_bit_for_bit():
    ids = torch.randint(3, 128, (2, 17), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    default = with_cache(sparse_slots=0)
    options = {key: value for key, value in OPTIONS.items() if key != "sparse_slots"}
    torch.manual_seed(0)
    plain = tiny_teacher()
    linearize.convert(plain, "lizard", **options)
    plain.load_state_dict(default.state_dict())
    with torch.no_grad():
        assert torch.equal(default(ids).logits, plain(ids).logits)
    assert linearize.config.LizardConfig().sparse_slots == 0


def test_negative_slots_are_refused():
    with pytest.raises(ConfigError, match="sparse_slots"):
        linearize.convert(tiny_teacher(), "lizard", **{**OPTIONS, "sparse_slots": -1})


def test_the_cache_and_the_delta_memory_together_decode_like_the_full_sequence():
    model = with_cache(memory="delta", combine="alpha")
    ids = torch.randint(3, 128, (2, 20), generator=torch.Generator().manual_seed(4))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        parts = [model(ids[:, :12], past_key_values=cache).logits]
        parts += [model(ids[:, t:t + 1], past_key_values=cache).logits for t in range(12, 20)]
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-4, rtol=0)
    assert {"memory_S", "cache_k", "S"} <= set(cache.layers[0].state)
