"""Which features path `fused.features` picks, without running a kernel."""

import pytest
import torch

from linearize import kernels
from linearize.attention import fused

try:
    from linearize.kernels import lizard_triton

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False


def test_training_features_take_the_kernel_unless_switched_off(monkeypatch):
    monkeypatch.setattr(kernels, "lizard_features_with_grad", lambda *args: "with grad")
    monkeypatch.setattr(kernels, "lizard_features", lambda *args: "without grad")
    q, k = torch.randn(1, 2, 5, 16), torch.randn(1, 1, 5, 16)
    w = torch.randn(2, 16, 16, requires_grad=True)
    assert fused.features(q, k, w, w, None, torch.bfloat16) == "with grad"
    with torch.no_grad():
        assert fused.features(q, k, w, w, None, torch.bfloat16) == "without grad"
    monkeypatch.setenv("LINEARIZE_FEATURES_BACKWARD", "0")  # the PyTorch ops for training only
    assert fused.features(q, k, w, w, None, torch.bfloat16) is None
    with torch.no_grad():
        assert fused.features(q, k, w, w, None, torch.bfloat16) == "without grad"
    monkeypatch.setenv("LINEARIZE_KERNELS", "0")
    with torch.no_grad():
        assert fused.features(q, k, w, w, None, torch.bfloat16) is None


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
def test_float32_features_beside_bf16_values_take_the_kernel(monkeypatch):
    """The PyTorch feature maps give float32 fq, fk, qw, kw while v stays in the projections' bf16:
    `run` casts all of them to that dtype, so the kernel still applies (it once fell back here)."""
    calls = []

    def fake_attention(*operands, **options):
        calls.append({t.dtype for t in operands if t.dim() == 4 and t.shape[-1] != 1})
        return operands[-1]

    # The real support check, as on a GPU (the interpreter's flag lets CPU tensors pass its device rule).
    monkeypatch.setattr(kernels, "available", lambda: True)
    monkeypatch.setattr(lizard_triton, "INTERPRET", True)
    monkeypatch.setattr(kernels, "lizard_attention", fake_attention)
    B, H, L, D = 1, 2, 5, 16
    fq, fk, qw, kw = (torch.randn(B, H, L, D) for _ in range(4))
    v = torch.randn(B, H, L, D, dtype=torch.bfloat16)
    log_g = torch.zeros(B, H, L, 1)
    valid = torch.ones(B, L, dtype=torch.bool)
    y, state = fused.run(fq, fk, log_g, qw, kw, v, valid, state=None, start=0, caching=False, dtype=torch.bfloat16,
                         can_continue=True, unpadded=True, window=4, scale=1.0, sinks=None, alpha=torch.ones(H))
    assert calls == [{torch.bfloat16}] and y.dtype == torch.bfloat16 and state is None
