"""Which form the dispatch points pick, without running a kernel."""

import pytest
import torch

from linearize.ops import backend, features
from linearize.ops import gla_window as dispatch

try:
    from linearize.ops.gla_window import triton as lizard_triton

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False


def test_features_take_the_kernel_where_the_backend_allows(monkeypatch):
    monkeypatch.setattr(backend, "kernels_available", lambda: True)
    monkeypatch.setattr(features, "features_with_grad", lambda *args: "with grad")
    monkeypatch.setattr(features, "features_without_grad", lambda *args: "without grad")
    q, k = torch.randn(1, 2, 5, 16), torch.randn(1, 1, 5, 16)
    w = torch.randn(2, 16, 8, requires_grad=True)
    assert features.lizard_features(q, k, w, w, None, torch.bfloat16) == "with grad"
    with torch.no_grad():
        assert features.lizard_features(q, k, w, w, None, torch.bfloat16) == "without grad"
    with backend.use_backend("torch"):
        fq, fk, qw, kw = features.lizard_features(q, k, w, w, None, torch.bfloat16)
    assert fq.shape == (1, 2, 5, 16) and fk.shape == (1, 2, 5, 16) and torch.equal(qw, q) and torch.equal(kw, k)


def test_backend_option_is_validated_and_scoped(monkeypatch):
    assert backend.get_backend() == "auto"
    with backend.use_backend("torch"):
        assert backend.get_backend() == "torch" and not backend.use_kernels()
    assert backend.get_backend() == "auto"
    with pytest.raises(backend.BackendError, match="one of auto, triton, torch"):
        backend.set_backend("cuda")
    monkeypatch.setenv("LINEARIZE_BACKEND", "torch")
    assert backend.get_backend() == "torch"
    monkeypatch.setenv("LINEARIZE_BACKEND", "fast")
    with pytest.raises(backend.BackendError, match="LINEARIZE_BACKEND"):
        backend.get_backend()
    monkeypatch.setenv("LINEARIZE_BACKEND", "auto")
    monkeypatch.setattr(backend, "kernels_available", lambda: False)
    with pytest.raises(backend.BackendError, match="needs triton"):
        backend.set_backend("triton")


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
def test_float32_features_beside_bf16_values_take_the_kernel(monkeypatch):
    """The PyTorch feature maps give float32 fq, fk, qw, kw while v stays in the projections' bf16:
    the dispatch casts all of them to that dtype, so the kernel still applies."""
    calls = []

    def fake_attention(*operands, **options):
        calls.append({t.dtype for t in operands if t.dim() == 4 and t.shape[-1] != 1})
        return operands[-1]

    # The real support check, as on a GPU (the interpreter's flag lets CPU tensors pass its device rule).
    monkeypatch.setattr(backend, "kernels_available", lambda: True)
    monkeypatch.setattr(lizard_triton, "INTERPRET", True)
    monkeypatch.setattr(dispatch, "lizard_attention", fake_attention)
    B, H, L, D = 1, 2, 5, 16
    fq, fk, qw, kw = (torch.randn(B, H, L, D) for _ in range(4))
    v = torch.randn(B, H, L, D, dtype=torch.bfloat16)
    log_g = torch.zeros(B, H, L, 1)
    valid = torch.ones(B, L, dtype=torch.bool)
    y, state = dispatch.gla_window(fq, fk, log_g, qw, kw, v, valid, None, dtype=torch.bfloat16, unpadded=True,
                                   window=4, scale=1.0, sinks=None, alpha=torch.ones(H))
    assert calls == [{torch.bfloat16}] and y.dtype == torch.bfloat16 and state is None
