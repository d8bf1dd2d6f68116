"""The chunked Lizard/Liger op equals the naive parallel form, values, gradients and final state."""

import pytest
import torch
from test_gla_window import F, H, check_pair, empty_state, inputs, options

from linearize.ops.gla_window import naive as gla_window
from linearize.ops.gla_window.chunk import gla_window_chunked


@pytest.mark.parametrize("L", [1, 7, 16, 37])
@pytest.mark.parametrize("gate_dim", [1, F])
@pytest.mark.parametrize("window,chunk", [(4, 4), (5, 3), (1, 8)])
@pytest.mark.parametrize("variant", ["lizard", "shared", "liger"])
def test_chunked_equals_naive(L, gate_dim, window, chunk, variant):
    sinks = torch.randn(H, 2, dtype=torch.float64) if variant != "liger" else None
    opts = options(window, sinks, shared=variant == "shared", normalize=variant != "liger")
    tensors, valid = inputs(L, gate_dim)
    y_ref, s_ref = gla_window.gla_window_parallel(*tensors, valid, empty_state(window), opts)
    y, s = gla_window_chunked(*tensors, valid, empty_state(window), opts.replace(chunk=chunk))
    check_pair(y, y_ref, tensors)
    for name in s_ref:
        torch.testing.assert_close(s[name], s_ref[name], atol=1e-10, rtol=1e-9)


def test_chunked_continues_from_a_state():
    window = 4
    opts = options(window, torch.randn(H, 2, dtype=torch.float64))
    tensors, valid = inputs(21, 1)
    _, state = gla_window.gla_window_parallel(*[x[:, :, :9] for x in tensors], valid[:, :9], empty_state(window),
                                              opts)
    rest = [x[:, :, 9:] for x in tensors]
    y_ref, _ = gla_window.gla_window_parallel(*rest, valid[:, 9:], state, opts)
    y, _ = gla_window_chunked(*rest, valid[:, 9:], state, opts.replace(chunk=5))
    torch.testing.assert_close(y, y_ref, atol=1e-10, rtol=1e-9)


def test_strong_decay_does_not_overflow():
    """Gates near 0 over a whole chunk: relative-to-chunk decays stay finite."""
    window, L = 4, 40
    tensors, valid = inputs(L, 1)
    with torch.no_grad():
        tensors[2].fill_(-30.0)  # gamma = e^-30 per token; over 40 tokens e^-1200 underflows an absolute form
    y, _ = gla_window_chunked(*tensors, valid, empty_state(window), options(window, None).replace(chunk=16))
    assert torch.isfinite(y).all()
