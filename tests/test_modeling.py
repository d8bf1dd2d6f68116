"""Linearized models end to end: prefill == decode, padding, generate, save/load, gradients."""

import pytest
import torch
from tiny_models import (
    ARCHITECTURES,
    METHODS,
    TINY_OPTIONS,
    assert_left_padded_generates_like_unpadded,
    covering,
    perturb_new_parameters,
    tiny_teacher,
)
from transformers import AutoModelForCausalLM, DynamicCache

import linearize
from linearize.attention import LinearizedAttention


def linearized(method, arch="llama", **overrides):
    model = tiny_teacher(arch)
    linearize.convert(model, method, **{**TINY_OPTIONS[method], **overrides})
    perturb_new_parameters(model)
    return model


def decode_token_by_token(model, ids):
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        return torch.cat([model(ids[:, t : t + 1], past_key_values=cache).logits for t in range(ids.shape[1])], 1)


@pytest.mark.parametrize("arch,method", covering(list(ARCHITECTURES), METHODS))
@pytest.mark.parametrize("length", [16, 21])  # a multiple of the window (8) and chunk (4), and not
def test_full_sequence_equals_token_by_token(method, arch, length):
    model = linearized(method, arch)
    ids = torch.randint(3, 128, (2, length), generator=torch.Generator().manual_seed(length))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
    torch.testing.assert_close(decode_token_by_token(model, ids), full, atol=1e-4, rtol=0)


@pytest.mark.parametrize("method", METHODS)
def test_prefill_then_decode_equals_full_sequence(method):
    model = linearized(method)
    ids = torch.randint(3, 128, (2, 30), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        parts = [model(ids[:, a:b], past_key_values=cache).logits for a, b in [(0, 11), (11, 12), (12, 30)]]
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-4, rtol=0)


@pytest.mark.parametrize("method", METHODS)
def test_left_padded_batch_generates_like_unpadded(method):
    assert_left_padded_generates_like_unpadded(linearized(method), new_tokens=12)


def test_sampling_generate_runs_and_is_seeded():
    model = linearized("lizard")
    ids = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(0))
    outs = []
    for _ in range(2):
        torch.manual_seed(7)
        outs.append(model.generate(ids, max_new_tokens=8, do_sample=True, top_k=20, temperature=0.9))
    assert outs[0].shape == (2, 14) and torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("method", METHODS)
def test_save_and_load_give_identical_logits(method, tmp_path):
    model = linearized(method, softmax_layers=[1]) if method == "lizard" else linearized(method)
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(reloaded) is type(model)
    ids = torch.randint(3, 128, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)


@pytest.mark.parametrize("method", METHODS)
def test_gradients_reach_exactly_the_new_parameters(method):
    model = linearized(method)
    new = {id(p) for m in model.modules() if isinstance(m, LinearizedAttention) for p in m.new_parameters()}
    for p in model.parameters():
        p.requires_grad_(id(p) in new)
    if method == "liger":
        assert not new  # Liger adds nothing: it learns only through LoRA
        return
    ids = torch.randint(3, 128, (2, 20), generator=torch.Generator().manual_seed(0))
    model(ids, labels=ids).loss.backward()
    got = {id(p) for p in model.parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert got == new


def test_hybrid_keeps_softmax_layers_and_their_kv_cache():
    model = tiny_teacher("llama", num_hidden_layers=3)
    linearize.convert(model, "lizard", softmax_layers=[1], **TINY_OPTIONS["lizard"])
    kinds = [type(layer.self_attn).__name__ for layer in model.model.layers]
    assert kinds == ["LizardAttention", "LlamaAttention", "LizardAttention"]
    ids = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
    torch.testing.assert_close(decode_token_by_token(model, ids), full, atol=1e-4, rtol=0)


@pytest.mark.parametrize("method, options", [
    ("still", {"budget": 32, "max_chunks": 6, "routing": "recency"}),
    ("lizard", {"window": 4, "gate_temperature": 4.0}),
])
def test_inference_options_change_the_forward_as_a_conversion_with_them_would(method, options, tmp_path):
    model = linearized(method)
    ids = torch.randint(3, 128, (2, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids).logits
        linearize.set_inference_options(model, **{key: str(value) for key, value in options.items()})
        after = model(ids).logits
        # The same weights converted with those options from the start.
        expected = linearized(method, **options)(ids).logits
    assert not torch.allclose(after, before) and torch.equal(after, expected)
    model.save_pretrained(tmp_path)
    saved = AutoModelForCausalLM.from_pretrained(tmp_path).config.linearize["options"]
    assert saved == {**saved, **options}


def test_inference_options_refuse_what_the_weights_depend_on():
    with pytest.raises(linearize.ConfigError, match="still cannot change feature_dim, window after training"):
        linearize.set_inference_options(linearized("still"), window=4, feature_dim=8)
    with pytest.raises(linearize.ConfigError, match="budget \\(4\\) must be >= window"):
        linearize.set_inference_options(linearized("still"), budget=4)
    with pytest.raises(linearize.ConfigError, match="lizard cannot change gate, num_sinks after training; "
                       "options it can: window, gate_temperature"):
        linearize.set_inference_options(linearized("lizard"), num_sinks=4, gate="vector")
    with pytest.raises(linearize.ConfigError, match="lolcats cannot change window after training; options it can: none"):
        linearize.set_inference_options(linearized("lolcats"), window=4)
    with pytest.raises(linearize.ConfigError, match="softmax attention only"):
        linearize.set_inference_options(tiny_teacher(), budget=32)


def test_converting_twice_is_refused():
    model = linearized("lizard")
    with pytest.raises(linearize.UnsupportedModelError, match="already linearized"):
        linearize.convert(model, "still")


def test_gate_temperature_slows_the_forgetting():
    """gamma = sigmoid(w.x + b) ** (1 / T): the log gate of the same logits is divided by T, and the model
    still decodes token by token as it runs the whole sequence."""
    hot, cold = linearized("lizard"), linearized("lizard", gate_temperature=16.0)
    layer_hot, layer_cold = hot.model.layers[0].self_attn, cold.model.layers[0].self_attn
    logits = torch.randn(2, 5, layer_hot.num_heads)
    layer_hot.projected = layer_cold.projected = (logits,)
    torch.testing.assert_close(layer_cold.log_gate(2, 5, "cpu"), layer_hot.log_gate(2, 5, "cpu") / 16)
    ids = torch.randint(3, 128, (2, 21), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = cold(ids, use_cache=False).logits
        assert not torch.allclose(full, hot(ids, use_cache=False).logits)
    torch.testing.assert_close(decode_token_by_token(cold, ids), full, atol=1e-4, rtol=0)
