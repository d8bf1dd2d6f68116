"""The blocked LoLCATs op equals the naive parallel form: values, gradients, final state."""

import pytest
import torch
from test_lolcats import setup, state0

from linearize.ops.lolcats import LolcatsOptions
from linearize.ops.lolcats import naive as lolcats
from linearize.ops.lolcats.chunk import lolcats_chunked

FACTOR = torch.tensor([0.2, 0.5, 0.7, 0.9], dtype=torch.float64)


@pytest.mark.parametrize("L", [1, 5, 16, 23])
@pytest.mark.parametrize("window", [1, 4, 6])
def test_chunked_equals_naive(L, window):
    (q, k, v), valid, phi_q, phi_k = setup(L)
    opts = {"window": window, "scale": 8**-0.5, "factor": FACTOR}
    y_ref, s_ref = lolcats.lolcats_parallel(q, k, v, valid, state0(window), phi_q, phi_k, LolcatsOptions(**opts))
    y, s = lolcats_chunked(q, k, v, valid, state0(window), phi_q, phi_k, LolcatsOptions(**opts))
    torch.testing.assert_close(y, y_ref, atol=1e-10, rtol=1e-9)
    for name in s_ref:
        torch.testing.assert_close(s[name], s_ref[name], atol=1e-10, rtol=1e-9)
    w = torch.randn_like(y)
    params = [q, k, v, phi_q.weight, phi_k.weight]
    grads = torch.autograd.grad((y * w).sum(), params, allow_unused=True, materialize_grads=True)
    grads_ref = torch.autograd.grad((y_ref * w).sum(), params, allow_unused=True, materialize_grads=True)
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-9)


def test_chunked_continues_from_a_state():
    (q, k, v), valid, phi_q, phi_k = setup(19)
    opts = {"window": 4, "scale": 8**-0.5, "factor": FACTOR}
    _, state = lolcats.lolcats_parallel(q[:, :, :7], k[:, :, :7], v[:, :, :7], valid[:, :7], state0(4), phi_q, phi_k,
                                        LolcatsOptions(**opts))
    rest = (q[:, :, 7:], k[:, :, 7:], v[:, :, 7:], valid[:, 7:], state, phi_q, phi_k)
    y_ref, _ = lolcats.lolcats_parallel(*rest, LolcatsOptions(**opts))
    y, _ = lolcats_chunked(*rest, LolcatsOptions(**opts))
    torch.testing.assert_close(y, y_ref, atol=1e-10, rtol=1e-9)
