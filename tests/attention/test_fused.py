"""Which implementation the ops' forms pick, without running a kernel."""

import dataclasses

import pytest
import torch

from linearize.ops import backend, features
from linearize.ops import gla_window as dispatch

try:
    from linearize.ops.gla_window import triton as lizard_triton

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False


def stubbed(form: backend.Form, keep: str = "torch") -> backend.Form:
    """`form` with every implementation but `keep` returning its own name instead of running."""
    return backend.Form(form.name, tuple(impl if impl.name == keep else
                                         dataclasses.replace(impl, run=lambda call, name=impl.name: name)
                                         for impl in form.implementations))


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
def test_features_take_the_kernel_where_the_backend_allows(monkeypatch):
    from linearize.ops.features import triton as features_triton

    monkeypatch.setattr(backend, "kernels_available", lambda: True)
    monkeypatch.setattr(features_triton, "features_unsupported", lambda *args: None)
    monkeypatch.setattr(features, "FEATURES", stubbed(features.FEATURES))
    q, k = torch.randn(1, 2, 5, 16), torch.randn(1, 1, 5, 16)
    w = torch.randn(2, 16, 8, requires_grad=True)
    wide = torch.randn(2, 16, 16, requires_grad=True)  # the backward's tiles take 16 features and up
    with backend.recording() as ran:
        assert features.lizard_features(q, k, wide, wide, None, torch.bfloat16) == "triton-differentiable"
        with torch.no_grad():
            assert features.lizard_features(q, k, w, w, None, torch.bfloat16) == "triton"
    assert ran == [("lizard_features", "triton-differentiable"), ("lizard_features", "triton")]
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

    def fake_attention(*operands, **config):
        calls.append({t.dtype for t in operands[:6] if t.shape[-1] != 1})
        return operands[5]

    # The real support check, as on a GPU (the interpreter's flag lets CPU tensors pass its device rule).
    monkeypatch.setattr(backend, "kernels_available", lambda: True)
    monkeypatch.setattr(lizard_triton, "INTERPRET", True)
    monkeypatch.setattr(lizard_triton, "lizard_attention_triton", fake_attention)
    B, H, L, D = 1, 2, 5, 16
    fq, fk, qw, kw = (torch.randn(B, H, L, D) for _ in range(4))
    v = torch.randn(B, H, L, D, dtype=torch.bfloat16)
    log_g = torch.zeros(B, H, L, 1)
    options = dispatch.GlaWindowOptions(window=4, scale=1.0, alpha=torch.ones(H))
    with backend.recording() as ran:
        y, state = dispatch.chunk_gla_window(fq, fk, log_g, qw, kw, v, options, dtype=torch.bfloat16)
    assert calls == [{torch.bfloat16}] and y.dtype == torch.bfloat16 and state is None
    assert ran == [("chunk_gla_window", "triton")]


def test_each_form_falls_back_to_pytorch_and_says_why():
    """On a CPU without the interpreter every form runs its PyTorch implementation, and its kernels'
    reasons name what stopped them; the backend `torch` refuses the kernels for every form."""
    B, H, L, D = 1, 2, 5, 16
    fq, fk, qw, kw, v = (torch.rand(B, H, L, D) for _ in range(5))
    log_g = torch.zeros(B, H, L, 1)
    options = dispatch.GlaWindowOptions(window=4, scale=1.0, alpha=torch.ones(H))
    with backend.use_backend("torch"), backend.recording() as ran:
        y, state = dispatch.chunk_gla_window(fq, fk, log_g, qw, kw, v, options, output_final_state=True)
        y2, state2 = dispatch.continue_gla_window(fq, fk, log_g, qw, kw, v, options)
        y3, _ = dispatch.gla_window_step(*(t[:, :, :1] for t in (fq, fk, log_g, qw, kw, v)), state, options)
    assert ran == [("chunk_gla_window", "torch"), ("continue_gla_window", "torch"), ("gla_window_step", "torch")]
    torch.testing.assert_close(y, y2)
    for name in state:
        torch.testing.assert_close(state[name], state2[name])
    assert y3.shape == (B, H, 1, D)
    with backend.use_backend("torch"):
        reasons = dispatch.FORMS["continue_gla_window"].reasons(dispatch._Pass(fq, fk, log_g, qw, kw, v, options))
    assert reasons == {"triton-continued": "the backend is torch", "triton-fresh": "the backend is torch",
                       "torch": None}
