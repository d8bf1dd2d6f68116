"""`fuse_projections`: q/k/v and gate/up as one GEMM each, the same outputs, no extra memory, undone exactly."""

import pytest
import torch
from tiny_models import METHODS, tiny_student

from linearize.fused_projections import FusedGatedMLP, fuse_projections


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q, k and v have biases
@pytest.mark.parametrize("method", METHODS)
def test_fused_layers_give_the_same_logits_and_undo_restores_the_model(method, arch):
    model = tiny_student(method, arch)
    ids = torch.randint(3, 128, (2, 13), generator=torch.Generator().manual_seed(0))
    before = {name: t.clone() for name, t in model.state_dict().items()}
    with torch.no_grad():
        expected = model(ids).logits
        undo = fuse_projections(model)
        fused = model(ids).logits
    assert undo is not None and fuse_projections(model) is None  # already fused: nothing more to do
    layers = model.get_decoder().layers
    assert all(isinstance(layer.mlp, FusedGatedMLP) and layer.self_attn.fused_qkv is not None for layer in layers)
    # Lizard's and STILL's gates read the same input as q, k and v: they join their GEMM.
    assert all(layer.self_attn.fused_qkv.linears[3:] == layer.self_attn.input_projections() for layer in layers)
    assert any(layer.self_attn.input_projections() for layer in layers) == (method in ("lizard", "still"))
    torch.testing.assert_close(fused, expected, rtol=1e-5, atol=1e-5)
    undo()
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[name], before[name]) for name in before)
    assert all(layer.self_attn.fused_qkv is None and not isinstance(layer.mlp, FusedGatedMLP) for layer in layers)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected, rtol=0, atol=0)


def test_fusing_costs_no_memory_and_undo_separates_the_weights_again():
    model = tiny_student()
    attention, mlp = model.get_decoder().layers[0].self_attn, model.get_decoder().layers[0].mlp
    parameters = sum(p.numel() for p in model.parameters())
    undo = fuse_projections(model)
    storage = attention.fused_qkv.weight.untyped_storage().data_ptr()
    assert {p.weight.untyped_storage().data_ptr() for p in (attention.q_proj, attention.k_proj, attention.v_proj)} == {storage}
    assert sum(p.numel() for p in model.parameters()) == parameters
    undo()
    pointers = {m.weight.untyped_storage().data_ptr() for m in (attention.q_proj, attention.k_proj, attention.v_proj,
                                                               mlp.gate_proj, mlp.up_proj)}
    assert len(pointers) == 5


def test_an_input_projection_in_another_dtype_stays_out_of_the_fused_gemm():
    model = tiny_student()
    attention = model.get_decoder().layers[0].self_attn
    attention.gate.double()
    ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(ids).logits
        fuse_projections(model)
        fused = model(ids).logits
    assert attention.fused_qkv.linears == [attention.q_proj, attention.k_proj, attention.v_proj]
    torch.testing.assert_close(fused, expected, rtol=1e-5, atol=1e-5)


def test_layers_with_lora_are_left_alone():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_student(), LoraConfig(r=2, target_modules=["q_proj", "k_proj", "v_proj", "gate_proj"]))
    assert fuse_projections(model.base_model.model) is None


def test_hooked_layers_are_left_alone():
    """A hook (accelerate's offloading, a user's probe) expects its own layer's call: no fusing there."""
    model = tiny_student()
    for layer in model.get_decoder().layers:
        layer.self_attn.k_proj.register_forward_hook(lambda *args: None)
        layer.mlp.up_proj.register_forward_pre_hook(lambda *args: None)
    assert fuse_projections(model) is None
