"""STILL with the delta-rule memory (`memory="delta"`): the layer's output is STILL's plus mu_h times the
naive memory's read-out (values and gradients), generate == token by token == the static decoder,
save/load and a constant decode cache (with Lizard's, alike), a silent memory at init, and the default STILL untouched."""

import pytest
import torch
from test_lizard_memory import assert_output_adds_the_naive_memory
from test_lizard_memory import with_memory as lizard_with_memory
from tiny_models import (
    TINY_OPTIONS,
    parameters_that_learn_alone,
    perturb_new_parameters,
    tiny_teacher,
)
from transformers import AutoModelForCausalLM, DynamicCache

import linearize
from linearize.attention import LinearizedAttention
from linearize.cache import cache_nbytes
from linearize.config import ConfigError
from linearize.decode import greedy_decode
from linearize.ops import backend

OPTIONS = {**TINY_OPTIONS["still"], "memory": "delta"}


def with_memory(**overrides):
    model = tiny_teacher()
    linearize.convert(model, "still", **{**OPTIONS, **overrides})
    perturb_new_parameters(model)
    return model


def without_memory_like(model):
    """The default STILL holding `model`'s weights (all but the memory's)."""
    plain = tiny_teacher()
    linearize.convert(plain, "still", **TINY_OPTIONS["still"])
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    assert not missing and all(".memory_" in name for name in unexpected)
    return plain


def attention_layers(model):
    return [m for m in model.modules() if isinstance(m, LinearizedAttention)]


def test_the_output_is_still_plus_the_weighted_naive_memory_in_values_and_gradients():
    model = with_memory()
    plain = without_memory_like(model)
    layer, twin = model.model.layers[0].self_attn, plain.model.layers[0].self_attn
    x = torch.randn(2, 13, model.config.hidden_size, generator=torch.Generator().manual_seed(0), requires_grad=True)
    rope = model.model.rotary_emb(x, torch.arange(13)[None])
    with backend.recording() as ran:
        out = layer(x, position_embeddings=rope)[0]
    assert ("chunk_delta_rule", "torch") in ran
    assert_output_adds_the_naive_memory(layer, x, out, twin(x, position_embeddings=rope)[0])


def test_generate_equals_token_by_token_and_the_static_decoder():
    model = with_memory()
    ids = torch.randint(3, 128, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        generated = model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False)[:, 19:]
        seq = ids
        for _ in range(12):
            seq = torch.cat([seq, model(seq, use_cache=False).logits[:, -1:].argmax(-1)], 1)
    assert torch.equal(generated, seq[:, 19:])
    with backend.recording() as ran:
        decoded = greedy_decode(model, ids, 12, cuda_graph=False)
    assert torch.equal(decoded, generated)
    assert ("delta_rule_step", "torch") in ran


def test_token_by_token_equals_the_full_sequence_and_the_memory_matters():
    model = with_memory()
    ids = torch.randint(3, 128, (2, 25), generator=torch.Generator().manual_seed(2))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        steps = torch.cat([model(ids[:, t:t + 1], past_key_values=cache).logits for t in range(25)], 1)
        for layer in attention_layers(model):
            layer.memory_weight.zero_()
        without = model(ids, use_cache=False).logits
    torch.testing.assert_close(steps, full, atol=1e-4, rtol=0)
    assert (without - full).abs().max() > 1e-3
    assert all(layer.state["memory_S"].shape == (2, 4, 16, 16) for layer in cache.layers)


BUILDERS = {"lizard": lizard_with_memory, "still": with_memory}


@pytest.mark.parametrize("method", sorted(BUILDERS))
def test_save_and_load_give_identical_logits(method, tmp_path):
    model = BUILDERS[method]()
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert all(layer.cfg.memory == "delta" for layer in attention_layers(reloaded))
    ids = torch.randint(3, 128, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)


@pytest.mark.parametrize("method", sorted(BUILDERS))
def test_decode_cache_bytes_constant(method):
    model = BUILDERS[method]()
    ids = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(0))
    sizes = []
    for new in (10, 120):
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                 return_dict_in_generate=True)
        sizes.append(cache_nbytes(out.past_key_values))
    assert sizes[0] == sizes[1] > 0


def test_the_memory_starts_silent_so_the_student_is_the_default_still():
    """At init (memory weight 0, decay near 1) a delta STILL gives the default STILL's logits exactly;
    the default adds no parameter, so existing checkpoints load as before."""
    model = tiny_teacher()
    linearize.convert(model, "still", **OPTIONS)
    layer = attention_layers(model)[0]
    assert torch.equal(layer.memory_weight, torch.zeros(layer.num_heads))
    torch.testing.assert_close(torch.sigmoid(layer.memory_decay), torch.full((layer.num_heads,), 0.9975))
    plain = without_memory_like(model)
    ids = torch.randint(3, 128, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, plain(ids).logits)
    assert not any("memory" in name for name, _ in plain.named_parameters())


def test_gradients_reach_exactly_the_new_parameters_and_the_memory_has_head_scalars():
    model = with_memory()
    new = {id(p) for m in attention_layers(model) for p in m.new_parameters()}
    assert parameters_that_learn_alone(model, [p for m in attention_layers(model) for p in m.new_parameters()]) == new
    layer = attention_layers(model)[0]
    assert [id(p) for p in layer.head_scalars()] == [id(layer.memory_weight), id(layer.memory_write.bias),
                                                     id(layer.memory_decay)]


@pytest.mark.parametrize("method", sorted(BUILDERS))
def test_the_write_strength_joins_the_fused_decode_projections_after_the_gate(method):
    from linearize.fused_projections import fuse_projections

    model = BUILDERS[method]()
    ids = torch.randint(3, 128, (2, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(ids).logits
        fuse_projections(model)
        fused = model(ids).logits
    layer = attention_layers(model)[0]
    assert layer.fused_qkv.linears[3:] == [layer.gate, layer.memory_write]
    torch.testing.assert_close(fused, expected, rtol=1e-5, atol=1e-5)


def test_without_the_gate_the_write_strength_is_the_only_input_projection():
    model = with_memory(gate=False)
    layer = attention_layers(model)[0]
    assert layer.input_projections() == [layer.memory_write]
    ids = torch.randint(3, 128, (1, 11), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        parts = torch.cat([model(ids[:, :7], past_key_values=cache).logits,
                           *(model(ids[:, t:t + 1], past_key_values=cache).logits for t in range(7, 11))], 1)
    torch.testing.assert_close(parts, full, atol=1e-4, rtol=0)


@pytest.mark.parametrize("decay", [0.0, 1.0, -0.5, 1.5])
def test_a_decay_outside_0_1_is_refused(decay):
    with pytest.raises(ConfigError, match="memory_decay_init") as refused:
        linearize.convert(tiny_teacher(), "still", **{**OPTIONS, "memory_decay_init": decay})
    assert "\n" not in str(refused.value)


def test_an_unknown_memory_is_refused():
    with pytest.raises(ConfigError, match="memory must be one of np_map, delta"):
        linearize.convert(tiny_teacher(), "still", **{**TINY_OPTIONS["still"], "memory": "gla"})
