"""STILL's chunked form (`ops.still.chunked`) against the reference op, values and gradients, and the
one-fold-per-step property of the routing it rests on."""

import pytest
import torch

from linearize.feature_maps import NormPreservingFeatureMap
from linearize.ops.common import repeat_kv
from linearize.ops.still import StillOptions, chunked
from linearize.ops.still import naive as still
from linearize.ops.still.chunked import fold_events, still_chunked
from linearize.ops.still.routing import ROUTINGS, fresh_routing

D, F = 8, 3


def _inputs(L, H, HKV, *, gate, pad, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, h, L, D, generator=g, dtype=dtype).requires_grad_() for h in (H, HKV, HKV))
    gate_t = torch.rand(2, H, L, D, generator=g, dtype=dtype).requires_grad_() if gate else None
    valid = torch.ones(2, L, dtype=torch.bool)
    valid[1, :pad] = False
    torch.manual_seed(seed)
    phi_q, phi_k = (NormPreservingFeatureMap(H, D, F).to(dtype) for _ in range(2))
    return q, k, v, gate_t, valid, phi_q, phi_k


def _options(window, chunk, per_chunk, routing):
    return StillOptions(window=window, chunk=chunk, per_chunk=per_chunk, routing=routing, scale=D**-0.5)


def _state(H, HKV, window, slots, dtype=torch.float64):
    return still.init_state(2, H, HKV, 2 * F, D, window, slots, device="cpu", dtype=dtype)


def _chunked(q, k, v, gate, valid, phi_q, phi_k, options, slots, C):
    fq, fk = phi_q(q), phi_k(repeat_kv(k, q.shape[1] // k.shape[1]))
    with torch.no_grad():
        fold, _ = fresh_routing(q, k, v, valid, _state(q.shape[1], k.shape[1], options.window, slots, q.dtype),
                                options, start=0)
    return still_chunked(q, k, v, fq, fk, gate, fold, valid, options, slots=slots, chunk=C)


def _reference(q, k, v, gate, valid, phi_q, phi_k, options, slots):
    y, _ = still.still_parallel(q, k, v, valid, gate, _state(q.shape[1], k.shape[1], options.window, slots),
                                phi_q, phi_k, options, start=0, fresh=True, keep_state=False)
    return y


def _grads(y, leaves, seed):
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed + 100), dtype=y.dtype)
    return torch.autograd.grad(y, leaves, dy)


# (L, H, H_kv, window, routing chunk, per_chunk, slots, C): slots fill and overflow (evictions), C
# divides L or not, and is smaller or larger than the window.
CASES = [
    (29, 4, 2, 6, 4, 2, 3, 8),    # GQA, C > window, C does not divide L
    (29, 4, 2, 6, 4, 2, 3, 3),    # C < window
    (40, 2, 2, 4, 4, 1, 2, 16),   # MHA, C a divisor, 4x the window
    (37, 4, 1, 8, 4, 2, 5, 5),    # one KV head
    (23, 4, 2, 5, 3, 0, 0, 4),    # no slots: every key folds as it leaves the window
    (12, 4, 2, 4, 4, 1, 4, 64),   # one block longer than the pass
]


@pytest.mark.parametrize("L,H,HKV,window,chunk,per_chunk,slots,C", CASES)
@pytest.mark.parametrize("gate", [True, False])
def test_chunked_equals_the_reference_values_and_gradients(L, H, HKV, window, chunk, per_chunk, slots, C, gate):
    q, k, v, g, valid, phi_q, phi_k = _inputs(L, H, HKV, gate=gate, pad=3, seed=L + C)
    options = _options(window, chunk, per_chunk, "saliency")
    leaves = [t for t in (q, k, v, g) if t is not None] + list(phi_q.parameters()) + list(phi_k.parameters())
    ours = _chunked(q, k, v, g, valid, phi_q, phi_k, options, slots, C)
    ref = _reference(q, k, v, g, valid, phi_q, phi_k, options, slots)
    torch.testing.assert_close(ours, ref, rtol=1e-9, atol=1e-11)
    for a, b in zip(_grads(ours, leaves, L), _grads(ref, leaves, L), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-9)


def test_groups_of_blocks_carry_the_linear_state(monkeypatch):
    """Blocks go in groups bounded by GROUP_ELEMENTS scores; the linear state carries from group to group."""
    L, slots, C = 50, 3, 4
    q, k, v, g, valid, phi_q, phi_k = _inputs(L, 4, 2, gate=True, pad=3, seed=5)
    options = _options(6, 4, 2, "saliency")
    ref = _reference(q, k, v, g, valid, phi_q, phi_k, options, slots)
    for elements in (1, 2 * 4 * C * (slots + 6 - 1 + C) * 3):  # one block a group; three
        monkeypatch.setattr(chunked, "GROUP_ELEMENTS", elements)
        torch.testing.assert_close(_chunked(q, k, v, g, valid, phi_q, phi_k, options, slots, C), ref,
                                   rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("routing", ROUTINGS)
def test_chunked_equals_the_reference_under_every_routing(routing):
    L, slots, C = 45, 3, 7
    q, k, v, g, valid, phi_q, phi_k = _inputs(L, 4, 2, gate=True, pad=5, seed=3)
    options = _options(5, 4, 2, routing)
    leaves = [q, k, v, g, *phi_q.parameters(), *phi_k.parameters()]
    ours = _chunked(q, k, v, g, valid, phi_q, phi_k, options, slots, C)
    ref = _reference(q, k, v, g, valid, phi_q, phi_k, options, slots)
    torch.testing.assert_close(ours, ref, rtol=1e-9, atol=1e-11)
    for a, b in zip(_grads(ours, leaves, 0), _grads(ref, leaves, 0), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-9)


def test_the_cases_overflow_the_slots():
    """The cases above route keys through the slots and evict some (a key folds after its departure
    and before the pass ends): the part of the form the salient lists serve."""
    L, window, slots = 29, 6, 3
    q, k, v, _, valid, _, _ = _inputs(L, 4, 2, gate=False, pad=3, seed=L + 8)
    fold, _ = fresh_routing(q, k, v, valid, _state(4, 2, window, slots), _options(window, 4, 2, "saliency"), start=0)
    departed = torch.arange(L) + window
    assert ((fold > departed) & (fold < L)).any()  # evicted
    assert ((fold >= L) & (departed < L)).any()  # held to the end


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_takes_16_and_32_bit_operands(dtype):
    L, slots = 33, 3
    q, k, v, g, valid, phi_q, phi_k = _inputs(L, 4, 2, gate=True, pad=2, seed=1)
    options = _options(6, 4, 2, "saliency")
    ref = _reference(q, k, v, g, valid, phi_q, phi_k, options, slots)
    low = [t.detach().to(dtype).requires_grad_() for t in (q, k, v, g)]
    y = _chunked(*low, valid, phi_q.to(dtype), phi_k.to(dtype), options, slots, 8)
    assert y.dtype == dtype
    y.float().sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in low)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(y.double(), ref.detach(), rtol=tol, atol=tol)


@pytest.mark.parametrize("routing", ROUTINGS)
def test_each_step_folds_at_most_one_key(routing):
    """One key leaves the window per step, and it folds itself or evicts at most one slot holder, so no
    two keys (padding included) share a fold time: the chunked form's fold table holds every fold."""
    for seed in range(6):
        g = torch.Generator().manual_seed(seed)
        L = int(torch.randint(20, 90, (1,), generator=g))
        window = int(torch.randint(2, 9, (1,), generator=g))
        chunk = int(torch.randint(2, window + 1, (1,), generator=g))  # the config's rule: chunk <= window
        per_chunk, slots = int(torch.randint(1, chunk + 1, (1,), generator=g)), int(torch.randint(1, 6, (1,), generator=g))
        q, k, v, _, valid, _, _ = _inputs(L, 4, 2, gate=False, pad=seed, seed=seed)
        with torch.no_grad():
            fold, _ = fresh_routing(q, k, v, valid, _state(4, 2, window, slots), _options(window, chunk, per_chunk, routing),
                                    start=0)
        for times in fold.flatten(0, 1):
            within = times[times < L]
            assert within.unique().numel() == within.numel()
        fold_at = fold_events(fold, valid, L)
        folded = valid[:, None, :] & (fold < L)
        assert (fold_at != L).sum() == folded.sum()  # every fold has its own entry
