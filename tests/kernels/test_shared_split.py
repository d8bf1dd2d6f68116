"""The shared normaliser's backward split (`lizard_triton.shared_split`) equals its PyTorch reference."""

import pytest
import torch
from interpreted import cases
from test_lizard_triton import HAS_TRITON

# (B, H, L, D, dtype of dy and the branch outputs[, dy as the model hands it: a [B, L, H, D] tensor
# viewed as [B, H, L, D]]): odd lengths leave a partial block of rows.
CASES = {
    "bf16-L37-D64": (2, 3, 37, 64, torch.bfloat16),
    "fp32-L50-D16": (1, 4, 50, 16, torch.float32),
    "bf16-L1-D128": (3, 2, 1, 128, torch.bfloat16),
    "bf16-L37-D64-dy-BLHD": (2, 3, 37, 64, torch.bfloat16, True),
}


def errors(device, B, H, L, D, dtype, transposed_dy=False) -> list[float]:
    """Max abs error of each output, relative to the reference output's largest magnitude."""
    from linearize.ops.gla_window.triton import shared_split, shared_split_reference

    g = torch.Generator(device=device).manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=g, device=device)
    dy, y_gla, y_win = (r(B, H, L, D).to(dtype) for _ in range(3))
    if transposed_dy:
        dy = dy.transpose(1, 2).contiguous().transpose(1, 2)
        assert not dy.is_contiguous()
    den = r(B, H, L).abs() * 5 + 0.1
    row_max = r(B, H, L)
    lse = row_max + r(B, H, L).abs()
    got = shared_split(dy, y_gla, y_win, den, lse, row_max)
    ref = shared_split_reference(dy, y_gla, y_win, den, lse, row_max)
    out = []
    for a, b in zip(got, ref, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        out.append(((a - b).abs().max() / b.abs().max()).item())
    return out


FAST_CASES = ("bf16-L37-D64-dy-BLHD",)


@pytest.mark.parametrize("name", cases(CASES, FAST_CASES))
def test_interpreted_shared_split_equals_the_reference(name, interpreter):
    errs = interpreter.case("test_shared_split", name)
    assert max(errs) < 1e-6, errs


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs CUDA and triton")
@pytest.mark.parametrize("name", list(CASES))
def test_shared_split_on_cuda_equals_the_reference(name):
    assert max(errors("cuda", *CASES[name])) < 1e-6
