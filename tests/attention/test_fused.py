"""Which features path `fused.features` picks, without running a kernel."""

import torch

from linearize import kernels
from linearize.attention import fused


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
