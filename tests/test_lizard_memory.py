"""Lizard with the delta-rule memory (`memory="delta"`): full sequence == token by token, prefill then
decode, padding, save/load, a constant decode cache, gradients to its parameters, and the default
Lizard untouched; with its own decay (`memory_decay_init`), the naive memory on that decay, blind to the
gate and its temperature."""

import copy
import json

import pytest
import torch
from tiny_models import (
    TINY_OPTIONS,
    assert_left_padded_generates_like_unpadded,
    parameters_that_learn_alone,
    perturb_new_parameters,
    tiny_teacher,
)
from transformers import AutoModelForCausalLM, DynamicCache

import linearize
from linearize.attention import LinearizedAttention
from linearize.config import ConfigError
from linearize.ops import backend
from linearize.ops.delta_rule import DeltaRuleOptions
from linearize.ops.delta_rule.naive import delta_rule_recurrent, init_state

OPTIONS = {**TINY_OPTIONS["lizard"], "chunk_size": 4, "memory": "delta"}
# The memory with a decay of its own, far from the gate's (gamma about 0.9975 at init) so the two differ.
OWN_DECAY = {"memory_decay_init": 0.6}


def with_memory(arch="llama", **overrides):
    model = tiny_teacher(arch)
    linearize.convert(model, "lizard", **{**OPTIONS, **overrides})
    perturb_new_parameters(model)
    return model


def attention_layers(model):
    return [m for m in model.modules() if isinstance(m, LinearizedAttention)]


@pytest.mark.parametrize("arch, overrides", [("llama", {}), ("qwen2", {}), ("llama", OWN_DECAY),
                                             ("llama", {**OWN_DECAY, "gate": "vector"})])
def test_full_sequence_equals_token_by_token(arch, overrides):
    model = with_memory(arch, **overrides)
    ids = torch.randint(3, 128, (2, 13), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache(config=model.config)
    with torch.no_grad(), backend.recording() as ran:
        full = model(ids, use_cache=False).logits
        steps = torch.cat([model(ids[:, t:t + 1], past_key_values=cache).logits for t in range(13)], 1)
    torch.testing.assert_close(steps, full, atol=1e-4, rtol=0)
    assert ("delta_rule_step", "torch") in ran and ("chunk_delta_rule", "torch") in ran


@pytest.mark.parametrize("overrides", [{}, OWN_DECAY])
def test_prefill_then_decode_equals_full_sequence_and_the_memory_matters(overrides):
    model = with_memory(**overrides)
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


def test_a_vector_gate_is_refused_where_the_memory_decays_by_the_gate():
    with pytest.raises(ConfigError, match="memory=delta"):
        linearize.convert(tiny_teacher(), "lizard", **{**OPTIONS, "gate": "vector"})
    model = linearize.convert(tiny_teacher(), "lizard", **{**OPTIONS, **OWN_DECAY, "gate": "vector"})
    assert attention_layers(model)[0].memory_decay.shape == (4,)


@pytest.mark.parametrize("options, message", [
    ({"memory": "gla", "memory_decay_init": 0.9}, "set memory=delta"),
    ({"memory_decay_init": 0.0}, r"must be in \(0, 1\)"),
    ({"memory_decay_init": 1.0}, r"must be in \(0, 1\)"),
    ({"memory_decay_init": -0.5}, r"must be in \(0, 1\)"),
    ({"memory_decay_init": "nan"}, "finite"),
])
def test_bad_memory_decay_init_is_refused_in_one_line(options, message):
    with pytest.raises(ConfigError, match=message) as error:
        linearize.make_method_config("lizard", **{"memory": "delta", **options})
    assert "\n" not in str(error.value)


def memory_term(layer, x):
    """The memory's part of `layer`'s output on hidden states x: its output less that at mu = 0."""
    silent = copy.deepcopy(layer)
    with torch.no_grad():
        silent.memory_weight.zero_()
        return layer(x)[0] - silent(x)[0]


def hidden(model, L=21, seed=0):
    return torch.randn(2, L, model.config.hidden_size, generator=torch.Generator().manual_seed(seed))


def assert_output_adds_the_naive_memory(layer, x, out, without_memory):
    """`out` (the layer's output on x [B, L, hidden]) is `without_memory` (the same layer's output with no
    memory) plus o_proj of mu_h times the recurrent delta rule on the layer's own decay, in values and in
    the gradients of x and the memory's parameters."""
    B, L = x.shape[:2]
    H, d = layer.num_heads, layer.head_dim

    def heads(t):
        return t.view(B, L, -1, d).transpose(1, 2)

    q, k, v = heads(layer.q_proj(x)), heads(layer.k_proj(x)), heads(layer.v_proj(x))
    log_a = torch.nn.functional.logsigmoid(layer.memory_decay)[None, :, None].expand(B, H, L)
    b = torch.sigmoid(layer.memory_write(x)).transpose(1, 2)
    o, _ = delta_rule_recurrent(q, k, v, log_a, b, None, init_state(B, H, d, d, device="cpu"),
                                DeltaRuleOptions(eps=layer.cfg.eps))
    read = (layer.memory_weight[None, :, None, None] * o).transpose(1, 2).reshape(B, L, H * d)
    expected = without_memory + layer.o_proj(read)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)

    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    names = ["memory_write.weight", "memory_write.bias", "memory_weight", "memory_decay"]
    params = [x, *(layer.get_parameter(name) for name in names)]
    got = torch.autograd.grad((out * weights).sum(), params, retain_graph=True)
    want = torch.autograd.grad((expected * weights).sum(), params)
    for name, a, b in zip(["x", *names], got, want, strict=True):
        assert b.abs().sum() > 0, name
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=name)


def test_own_decay_is_the_naive_memory_on_that_decay_in_values_and_gradients():
    model = with_memory(**OWN_DECAY)
    layer = attention_layers(model)[0]
    x = hidden(model, 13).requires_grad_()
    silent = copy.deepcopy(layer)
    with torch.no_grad():
        silent.memory_weight.zero_()
    with backend.recording() as ran:
        out = layer(x)[0]
    assert ("chunk_delta_rule", "torch") in ran
    assert_output_adds_the_naive_memory(layer, x, out, silent(x)[0])


def test_own_decay_differs_from_the_gates_and_ignores_the_gate_and_its_temperature():
    own = with_memory(**OWN_DECAY)
    by_gate = with_memory()
    missing, unexpected = by_gate.load_state_dict(own.state_dict(), strict=False)
    assert not missing and all(name.endswith("memory_decay") for name in unexpected)
    x = hidden(own)
    own_layer, gate_layer = attention_layers(own)[0], attention_layers(by_gate)[0]
    with torch.no_grad():
        own_term, gate_term = memory_term(own_layer, x), memory_term(gate_layer, x)
        assert (own_term - gate_term).abs().max() > 1e-3
        for layer in (own_layer, gate_layer):
            layer.gate.bias.sub_(3.0)
            layer.gate.weight.mul_(2.0)
        torch.testing.assert_close(memory_term(own_layer, x), own_term, atol=1e-6, rtol=0)
        assert (memory_term(gate_layer, x) - gate_term).abs().max() > 1e-3
        own_term, gate_term = memory_term(own_layer, x), memory_term(gate_layer, x)
        for model in (own, by_gate):
            linearize.set_inference_options(model, gate_temperature="16")
        torch.testing.assert_close(memory_term(own_layer, x), own_term, atol=1e-6, rtol=0)
        assert (memory_term(gate_layer, x) - gate_term).abs().max() > 1e-3


def test_own_decay_is_a_head_scalar_and_saves_and_loads(tmp_path):
    model = with_memory(**OWN_DECAY)
    layer = attention_layers(model)[0]
    assert any(p is layer.memory_decay for p in layer.head_scalars())
    fresh = attention_layers(linearize.convert(tiny_teacher(), "lizard", **OPTIONS, **OWN_DECAY))[0]
    torch.testing.assert_close(torch.sigmoid(fresh.memory_decay), torch.full((4,), 0.6))
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert all(layer.cfg.memory_decay_init == 0.6 for layer in attention_layers(reloaded))
    torch.testing.assert_close(attention_layers(reloaded)[0].memory_decay, layer.memory_decay, atol=0, rtol=0)
    ids = torch.randint(3, 128, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)


def test_a_checkpoint_without_the_option_loads_as_decaying_by_the_gate(tmp_path):
    """config.json written before the option existed has no memory_decay_init: it loads as None."""
    model = with_memory()
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["linearize"]["options"].pop("memory_decay_init") is None
    (tmp_path / "config.json").write_text(json.dumps(config))
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert all(layer.cfg.memory_decay_init is None for layer in attention_layers(reloaded))
    ids = torch.randint(3, 128, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)


@pytest.mark.parametrize("overrides, decay", [({}, []), (OWN_DECAY, ["memory_decay"])])
def test_the_memory_keeps_its_checkpoint_names(overrides, decay):
    """Lizard's memory lives on the attention module under the names its checkpoints hold; decaying by
    the gate, it has no decay parameter of its own."""
    names = {name for name in with_memory(**overrides).state_dict() if "memory" in name}
    assert names == {f"model.layers.{i}.self_attn.{key}" for i in range(2)
                     for key in ("memory_write.weight", "memory_write.bias", "memory_weight", *decay)}
