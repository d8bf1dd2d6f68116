"""The fused RMSNorm computes the teacher's norm, and conversion swaps every one without changing keys."""

import pytest
import torch
from tiny_models import tiny_teacher
from transformers.models.llama.modeling_llama import LlamaRMSNorm

import linearize
from linearize.norms import FusedRMSNorm


def pair(dtype, weight_dtype=None):
    teacher = LlamaRMSNorm(48, eps=1e-5)
    teacher.weight.data = (1 + 0.3 * torch.randn(48, generator=torch.Generator().manual_seed(0))).to(
        weight_dtype or dtype)
    return teacher, FusedRMSNorm(teacher)


def test_float32_values_and_gradients_equal_the_teachers_norm():
    teacher, fused = pair(torch.float32)
    x = 3 * torch.randn(2, 7, 48, dtype=torch.float32, requires_grad=True)
    g = torch.randn(2, 7, 48)
    ours, ref = fused(x), teacher(x)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    (dx, dw), (rdx, rdw) = (torch.autograd.grad(y, (x, teacher.weight), g) for y in (ours, ref))
    torch.testing.assert_close(dx, rdx, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dw, rdw, rtol=1e-5, atol=1e-5)


def test_autocast_keeps_the_inputs_precision():
    """Under bf16 autocast (training) a float32 residual stream is normalised in float32, as by HF."""
    teacher, fused = pair(torch.float32)
    x = 3 * torch.randn(2, 7, 48)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours, ref = fused(x), teacher(x)
    assert ours.dtype == ref.dtype == torch.float32
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_bf16_inputs(weight_dtype):
    """bf16 weights: one rounding instead of two, so within a unit in the last place; float32 weights
    on bf16 inputs (HF promotes the result to float32): exactly HF's."""
    teacher, fused = pair(torch.bfloat16, weight_dtype)
    x = (3 * torch.randn(4, 5, 48)).to(torch.bfloat16)
    ours, ref = fused(x), teacher(x)
    assert ours.dtype == ref.dtype
    if weight_dtype == torch.float32:
        assert torch.equal(ours, ref)
    else:
        assert ((ours.float() - ref.float()).abs() <= ref.float().abs() * 2**-7 + 1e-6).all()


def test_conversion_fuses_every_norm_and_keeps_the_checkpoint_keys(tmp_path):
    model = tiny_teacher()
    keys = set(model.state_dict())
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    linearize.convert(model, "lizard", softmax_layers=list(range(model.config.num_hidden_layers)))
    assert not any(type(m).__name__ == "LlamaRMSNorm" for m in model.modules())
    assert sum(isinstance(m, FusedRMSNorm) for m in model.modules()) == 2 * model.config.num_hidden_layers + 1
    assert set(model.state_dict()) == keys  # every layer kept softmax: nothing new either
    with torch.no_grad():
        fused_logits = model(ids).logits
    model.save_pretrained(tmp_path)
    reloaded = linearize.load_model(str(tmp_path))
    assert all(type(m).__name__ != "LlamaRMSNorm" for m in reloaded.modules())
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, fused_logits)
    teacher = tiny_teacher()
    with torch.no_grad():
        torch.testing.assert_close(teacher(ids).logits, fused_logits, rtol=1e-5, atol=1e-5)
