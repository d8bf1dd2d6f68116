"""The Lizard/Liger op: naive parallel form == token-by-token recurrence, in values and gradients."""

import pytest
import torch

from linearize.ops.gla_window import GlaWindowOptions
from linearize.ops.gla_window import naive as gla_window

B, H, HKV, D, F = 2, 4, 2, 8, 6


def inputs(L, gate_dim, seed=0, pad=3):
    g = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    fq = torch.softmax(rand(B, H, L, F), -1)
    fk = torch.softmax(rand(B, H, L, F), -1)
    log_g = torch.nn.functional.logsigmoid(rand(B, H, L, gate_dim) + 2)
    qw, kw, v = rand(B, H, L, D), rand(B, HKV, L, D), rand(B, HKV, L, D)
    valid = torch.ones(B, L, dtype=torch.bool)
    valid[1, :pad] = False  # left padding in the second row
    tensors = [t.requires_grad_() for t in (fq, fk, log_g, qw, kw, v)]
    return tensors, valid


def options(window, sinks, shared=False, normalize=True, beta=1.0):
    return GlaWindowOptions(window=window, scale=D**-0.5, sinks=sinks, alpha=torch.linspace(0.5, 1.5, H, dtype=torch.float64),
                            beta=beta, normalize=normalize, shared=shared)


def empty_state(window):
    state = gla_window.init_state(B, H, HKV, F, D, window, device="cpu", dtype=torch.float64)
    return state


def run_recurrent(tensors, valid, window, opts):
    state, outputs = empty_state(window), []
    for t in range(valid.shape[1]):
        step = [x[:, :, t : t + 1] for x in tensors]
        y, state = gla_window.gla_window_recurrent_step(*step, valid[:, t : t + 1], state, opts)
        outputs.append(y)
    return torch.cat(outputs, 2), state


def check_pair(a, b, tensors):
    torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-9)
    weights = torch.randn_like(a)
    grads_a = torch.autograd.grad((a * weights).sum(), tensors, retain_graph=True)
    grads_b = torch.autograd.grad((b * weights).sum(), tensors, retain_graph=True)
    for ga, gb in zip(grads_a, grads_b):
        torch.testing.assert_close(ga, gb, atol=1e-10, rtol=1e-9)


@pytest.mark.parametrize("L", [1, 5, 16, 19])
@pytest.mark.parametrize("gate_dim", [1, F])
@pytest.mark.parametrize("variant", ["lizard", "shared", "liger"])
def test_parallel_equals_recurrent(L, gate_dim, variant):
    window = 4
    sinks = torch.randn(H, 3, dtype=torch.float64) if variant != "liger" else None
    opts = options(window, sinks, shared=variant == "shared", normalize=variant != "liger")
    tensors, valid = inputs(L, gate_dim)
    y_par, state_par = gla_window.gla_window_parallel(*tensors, valid, empty_state(window), opts)
    y_rec, state_rec = run_recurrent(tensors, valid, window, opts)
    check_pair(y_par, y_rec, tensors)
    for name in state_par:
        torch.testing.assert_close(state_par[name], state_rec[name], atol=1e-10, rtol=1e-9)


def test_parallel_continues_from_a_state():
    window, L = 4, 13
    opts = options(window, torch.randn(H, 2, dtype=torch.float64))
    tensors, valid = inputs(L, 1)
    full, _ = gla_window.gla_window_parallel(*tensors, valid, empty_state(window), opts)
    first, state = gla_window.gla_window_parallel(*[x[:, :, :6] for x in tensors], valid[:, :6], empty_state(window),
                                                  opts)
    second, _ = gla_window.gla_window_parallel(*[x[:, :, 6:] for x in tensors], valid[:, 6:], state, opts)
    torch.testing.assert_close(torch.cat([first, second], 2), full, atol=1e-10, rtol=1e-9)


def test_window_sees_exactly_the_last_w_tokens():
    """With a gate of zero (forget everything) and no linear mass, only the window term remains."""
    window, L = 3, 7
    tensors, valid = inputs(L, 1, pad=0)
    fq, fk, log_g, qw, kw, v = tensors
    opts = options(window, None, beta=0.0)
    y, _ = gla_window.gla_window_parallel(fq, fk, log_g, qw, kw, v, valid, empty_state(window), opts)
    i = 5
    scores = (qw[:, :, i : i + 1] @ kw.repeat_interleave(2, 1)[:, :, i - window + 1 : i + 1].transpose(-1, -2)) * D**-0.5
    expected = torch.softmax(scores, -1) @ v.repeat_interleave(2, 1)[:, :, i - window + 1 : i + 1]
    alpha = opts.alpha[None, :, None, None]
    torch.testing.assert_close(y[:, :, i : i + 1], alpha * expected)


@pytest.mark.parametrize("L", [1, 3, 40])
@pytest.mark.parametrize("gate_dim", [1, F])
@pytest.mark.parametrize("padded", [False, True])
def test_state_after_equals_the_state_of_the_parallel_form(L, gate_dim, padded):
    tensors, valid = inputs(L, gate_dim, pad=min(3, L))
    if not padded:
        valid = torch.ones(B, L, dtype=torch.bool)
    window = 5
    _, expected = gla_window.gla_window_parallel(*tensors, valid, empty_state(window), options(window, None))
    _, fk, log_g, _, kw, v = tensors
    state = gla_window.state_after(fk, log_g, kw, v, window, valid if padded else None)
    assert state.keys() == expected.keys()
    for name in state:
        torch.testing.assert_close(state[name], expected[name], atol=1e-12, rtol=1e-10)
