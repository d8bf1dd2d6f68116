"""The LoLCATs op: naive parallel form == token-by-token recurrence, in values and gradients."""

import pytest
import torch

from linearize.feature_maps import HedgehogFeatureMap
from linearize.ops.lolcats import LolcatsOptions
from linearize.ops.lolcats import naive as lolcats

B, H, HKV, D, F = 2, 4, 2, 8, 3


def setup(L, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, L, D, generator=g, dtype=torch.float64).requires_grad_() for h in (H, HKV, HKV))
    valid = torch.ones(B, L, dtype=torch.bool)
    valid[0, :2] = False
    torch.manual_seed(seed)
    phi_q, phi_k = HedgehogFeatureMap(H, D, F).double(), HedgehogFeatureMap(H, D, F).double()
    with torch.no_grad():
        phi_q.weight.add_(torch.randn_like(phi_q.weight))
        phi_k.weight.add_(torch.randn_like(phi_k.weight))
    return (q, k, v), valid, phi_q, phi_k


def state0(window):
    return lolcats.init_state(B, H, HKV, 2 * F, D, window, device="cpu", dtype=torch.float64)


@pytest.mark.parametrize("L", [1, 4, 9, 16])
@pytest.mark.parametrize("window", [1, 4])
def test_parallel_equals_recurrent(L, window):
    (q, k, v), valid, phi_q, phi_k = setup(L)
    opts = {"window": window, "scale": D**-0.5, "factor": torch.tensor([0.2, 0.5, 0.7, 0.9], dtype=torch.float64)}
    y_par, s_par = lolcats.lolcats_parallel(q, k, v, valid, state0(window), phi_q, phi_k, LolcatsOptions(**opts))
    state, ys = state0(window), []
    for t in range(L):
        y, state = lolcats.lolcats_step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], valid[:, t : t + 1],
                                        state, phi_q, phi_k, LolcatsOptions(**opts))
        ys.append(y)
    y_rec = torch.cat(ys, 2)
    torch.testing.assert_close(y_par, y_rec, atol=1e-10, rtol=1e-9)
    for name in s_par:
        torch.testing.assert_close(s_par[name], state[name], atol=1e-10, rtol=1e-9)
    w = torch.randn_like(y_par)
    params = [q, k, v, phi_q.weight, phi_k.weight]
    for a, b in zip(torch.autograd.grad((y_par * w).sum(), params, allow_unused=True, materialize_grads=True),
                    torch.autograd.grad((y_rec * w).sum(), params, allow_unused=True, materialize_grads=True)):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-9)


def test_factor_one_is_pure_sliding_window_softmax():
    (q, k, v), valid, phi_q, phi_k = setup(10)
    valid[:] = True
    opts = {"window": 3, "scale": D**-0.5, "factor": torch.ones(H, dtype=torch.float64), "eps": 0.0}
    y, _ = lolcats.lolcats_parallel(q, k, v, valid, state0(3), phi_q, phi_k, LolcatsOptions(**opts))
    kr, vr = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    i = 7
    expected = torch.softmax(q[:, :, i : i + 1] @ kr[:, :, i - 2 : i + 1].transpose(-1, -2) * D**-0.5, -1) @ vr[:, :, i - 2 : i + 1]
    torch.testing.assert_close(y[:, :, i : i + 1], expected)
