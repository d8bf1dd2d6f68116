import pytest
import torch

from linearize.feature_maps import per_head_projection
from linearize.ops.features import naive as feature_maps


@pytest.mark.parametrize("L, block", [(37, 8), (32, 8), (5, 1024)])
def test_per_head_projection_matches_einsum(monkeypatch, L, block):
    """Values and both gradients equal the plain einsum's, with the weight gradient's tokens split
    into blocks (L = 37: the last block padded)."""
    monkeypatch.setattr(feature_maps, "GRADIENT_BLOCK", block)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, L, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 16, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    g = torch.randn(3, 4, L, 8, generator=gen, dtype=torch.float64)

    out = per_head_projection(x, w)
    dx, dw = torch.autograd.grad(out, (x, w), g)
    ref = torch.einsum("bhld,hdf->bhlf", x, w)
    rdx, rdw = torch.autograd.grad(ref, (x, w), g)

    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(dx, rdx, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dw, rdw, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(per_head_projection, (x[:1, :2, :9], w[:2]))


def test_frozen_input_gets_no_gradient():
    """Stage 1 trains the feature map on frozen projections: only the weight's gradient is computed."""
    x = torch.randn(2, 3, 10, 8)
    w = torch.randn(3, 8, 4, requires_grad=True)
    per_head_projection(x, w).square().sum().backward()
    assert x.grad is None and w.grad is not None and w.grad.abs().sum() > 0
