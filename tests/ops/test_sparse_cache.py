"""The sparse-cache op: the parallel form (one pass, or continuing a carried state) and the decode
step == the token-by-token reference over the whole history, in values and gradients; the parallel
form leaves the decode loop's state; the selection follows its rule, ties included; the decode state
keeps its size."""

import pytest
import torch

from linearize.ops import sparse_cache
from linearize.ops.gla_window import GlaWindowOptions
from linearize.ops.gla_window.naive import gla_window_parallel
from linearize.ops.gla_window.naive import init_state as gla_init_state
from linearize.ops.sparse_cache import (
    SparseCacheOptions,
    chunk_sparse_cache,
    continue_sparse_cache,
    sparse_cache_naive,
    sparse_cache_step,
)
from linearize.ops.sparse_cache.recurrent import sparse_cache_loop

B, H, HKV, F, D = 2, 4, 2, 6, 5
TIGHT = {"atol": 1e-10, "rtol": 1e-9}


def inputs(L, seed=0, gate_dim=1, padded=True, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    fq = torch.rand(B, H, L, F, generator=g, dtype=dtype)  # non-negative features, as Hedgehog's
    fk = torch.rand(B, H, L, F, generator=g, dtype=dtype)
    log_g = -0.5 * torch.rand(B, H, L, gate_dim, generator=g, dtype=dtype)
    qw = torch.randn(B, H, L, D, generator=g, dtype=dtype)
    kw = torch.randn(B, HKV, L, D, generator=g, dtype=dtype)
    v = torch.randn(B, HKV, L, D, generator=g, dtype=dtype)
    valid = torch.ones(B, L, dtype=torch.bool)
    if padded and L > 4:
        valid[0, :2] = False  # left padding
        valid[1, -1] = False  # right padding
    return [t.requires_grad_() for t in (fq, fk, log_g, qw, kw, v)], valid


def make_options(window=3, slots=2, shared=True, sinks=True, normalize=True, chunk=4, dtype=torch.float64,
                 device="cpu"):
    alpha = torch.tensor([0.5, 1.0, 1.5, 2.0], dtype=dtype, device=device)
    branches = GlaWindowOptions(window=window, scale=0.6, alpha=alpha,
                                sinks=torch.linspace(-1, 1, H * 2, dtype=dtype, device=device).view(H, 2) if sinks
                                else None, shared=shared, normalize=normalize, chunk=chunk)
    return SparseCacheOptions(branches=branches, slots=slots)


def with_ties(params, positions, value):
    """The inputs with the tokens at `positions` given no key features and the value `value` in every
    coordinate: the state reads 0 for each, so all score ||v||^2 = D value^2 exactly, in any form."""
    fq, fk, log_g, qw, kw, v = (p.detach().clone() for p in params)
    fk[:, :, positions] = 0
    v[:, :, positions] = value
    return [t.requires_grad_() for t in (fq, fk, log_g, qw, kw, v)]


def assert_states_equal(state, reference):
    for name, expected in reference.items():
        if expected.is_floating_point():
            torch.testing.assert_close(state[name], expected, **TIGHT)
        else:
            assert torch.equal(state[name], expected), name


CASES = [
    {"window": 3, "slots": 2},                        # more tokens leave than fit: evictions
    {"window": 2, "slots": 5, "shared": False},       # beta * linear + alpha * softmax
    {"window": 4, "slots": 1, "sinks": False, "normalize": False},
    {"window": 1, "slots": 3, "chunk": 3},            # only the current token in the window
    {"window": 3, "slots": 2, "chunk": 64},           # one block of queries
]


def assert_same_values_and_gradients(y, y_ref, params):
    """y equals y_ref, and so do the gradients of one random projection of each with respect to `params`."""
    torch.testing.assert_close(y, y_ref, **TIGHT)
    weights = torch.randn_like(y)
    grads = torch.autograd.grad((y * weights).sum(), params, retain_graph=True)
    grads_ref = torch.autograd.grad((y_ref * weights).sum(), params, retain_graph=True)
    for a, b in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(a, b, **TIGHT)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("gate_dim", [1, F])
def test_one_pass_equals_the_reference_in_values_and_gradients(case, gate_dim):
    params, valid = inputs(23, gate_dim=gate_dim)
    options = make_options(**case)
    y_ref, _ = sparse_cache_naive(*params, valid, options)
    y, _ = chunk_sparse_cache(*params, options, valid=valid)
    assert_same_values_and_gradients(y, y_ref, params)


@pytest.mark.parametrize("case", CASES[:4])
def test_one_pass_leaves_the_decode_loops_state(case):
    """The state after a parallel pass is the one the loop of decode steps leaves, slot for slot."""
    params, valid = inputs(23, seed=1)
    options = make_options(**case)
    _, state = chunk_sparse_cache(*params, options, valid=valid, output_final_state=True)
    empty = sparse_cache.init_state(B, H, HKV, F, D, options, device="cpu", dtype=torch.float64)
    with torch.no_grad():
        _, reference = sparse_cache_loop(*params, valid, empty, options)
    assert_states_equal(state, reference)


@pytest.mark.parametrize("case", CASES[:2])
def test_decode_steps_and_continued_passes_equal_the_reference(case):
    params, valid = inputs(16, seed=3)
    options = make_options(**case)
    y_ref, cached = sparse_cache_naive(*params, valid, options)
    # A prefill of 5 tokens, passes of 4, 1 and 2 continuing it (shorter than the window too), then
    # four decode steps.
    pieces, state = [], None
    for start, stop in ((0, 5), (5, 9), (9, 10), (10, 12)):
        part = [t[:, :, start:stop] for t in params]
        y, state = continue_sparse_cache(*part, options, state=state, valid=valid[:, start:stop])
        pieces.append(y)
    for t in range(12, 16):
        y, state = sparse_cache_step(*[p[:, :, t:t + 1] for p in params], state, options, valid=valid[:, t:t + 1])
        pieces.append(y)
    torch.testing.assert_close(torch.cat(pieces, 2), y_ref, **TIGHT)
    weights = torch.randn_like(y_ref)
    grads_ref = torch.autograd.grad((y_ref * weights).sum(), params)
    grads = torch.autograd.grad((torch.cat(pieces, 2) * weights).sum(), params)
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, **TIGHT)
    # The slots hold exactly the positions the reference keeps.
    for b in range(B):
        for h in range(HKV):
            held = sorted(p for p in state["cache_pos"][b, h].tolist() if p >= 0)
            assert held == cached[b, h].nonzero()[:, 0].tolist()


def test_the_cache_keeps_the_worst_recalled_tokens():
    """Each token's score is the state's recall error for it as it leaves, written out here; at the
    end the cache holds the tokens that scored highest of all that left."""
    L, w, slots = 20, 3, 4
    params, _ = inputs(L, seed=5, padded=False)
    fk, log_g, v = (p.detach() for p in (params[1], params[2], params[5]))
    options = make_options(window=w, slots=slots)
    _, state = chunk_sparse_cache(*params, options, output_final_state=True)
    v_rep = v.repeat_interleave(H // HKV, 1)
    S, z, scores = torch.zeros(B, H, F, D, dtype=v.dtype), torch.zeros(B, H, F, dtype=v.dtype), {}
    for t in range(L):
        gamma = log_g[:, :, t].exp()
        S = gamma[..., None] * S + fk[:, :, t, :, None] * v_rep[:, :, t, None, :]
        z = gamma * z + fk[:, :, t]
        if t >= w:
            f = fk[:, :, t - w]
            read = torch.einsum("bhf,bhfd->bhd", f, S) / (torch.einsum("bhf,bhf->bh", f, z) + 1e-6)[..., None]
            scores[t - w] = (v_rep[:, :, t - w] - read).square().sum(-1).view(B, HKV, H // HKV).mean(-1)
    for b in range(B):
        for h in range(HKV):
            held = state["cache_pos"][b, h].tolist()
            assert len(set(held)) == slots and all(0 <= p < L - w for p in held)
            torch.testing.assert_close(state["cache_score"][b, h], torch.stack([scores[p][b, h] for p in held]),
                                       **TIGHT)
            left_out = [scores[p][b, h] for p in scores if p not in held]
            assert max(left_out) <= state["cache_score"][b, h].min()


def test_ties_go_to_the_newer_token():
    """Four tokens of one high score: the cache keeps the two newest (a newcomer enters on a tie and the
    earlier of equal scores leaves), in the parallel pass, the decode loop and the reference alike."""
    L, tied = 16, [1, 3, 4, 7]
    params, _ = inputs(L, seed=11, padded=False)
    params = with_ties(params, tied, 4.0)
    options = make_options(window=2, slots=2)
    y_ref, cached = sparse_cache_naive(*params, None, options)
    y, state = chunk_sparse_cache(*params, options, output_final_state=True)
    torch.testing.assert_close(y, y_ref, **TIGHT)
    assert (state["cache_pos"] == torch.tensor([4, 7])).all()
    assert (state["cache_score"] == D * 16.0).all()
    assert cached.nonzero()[:, 2].view(B, HKV, 2).eq(torch.tensor([4, 7])).all()
    empty = sparse_cache.init_state(B, H, HKV, F, D, options, device="cpu", dtype=torch.float64)
    with torch.no_grad():
        _, reference = sparse_cache_loop(*params, torch.ones(B, L, dtype=torch.bool), empty, options)
    assert_states_equal(state, reference)


@pytest.mark.parametrize("case", CASES[:2])
def test_zero_error_and_repeated_tokens_equal_the_reference(case):
    """Tokens the state recalls exactly (no features, zero value: score 0) and a run of repeated
    tokens of one score, filling the cache and then evicted: values and gradients as the reference's,
    one pass and in pieces, and the loop's state."""
    L = 23
    params, valid = inputs(L, seed=6)
    params = with_ties(params, [2, 3, 4, 9], 0.0)
    params = with_ties(params, [12, 13, 14, 15, 16], 0.5)
    options = make_options(**case)
    y_ref, _ = sparse_cache_naive(*params, valid, options)
    y, state = chunk_sparse_cache(*params, options, valid=valid, output_final_state=True)
    assert_same_values_and_gradients(y, y_ref, params)
    pieces, carried = [], None
    for start, stop in ((0, 4), (4, 13), (13, 14), (14, L)):
        part = [t[:, :, start:stop] for t in params]
        y_part, carried = continue_sparse_cache(*part, options, state=carried, valid=valid[:, start:stop])
        pieces.append(y_part)
    torch.testing.assert_close(torch.cat(pieces, 2), y_ref, **TIGHT)
    empty = sparse_cache.init_state(B, H, HKV, F, D, options, device="cpu", dtype=torch.float64)
    with torch.no_grad():
        _, reference = sparse_cache_loop(*params, valid, empty, options)
    assert_states_equal(state, reference)
    assert_states_equal(carried, reference)


def test_a_token_enters_by_matching_the_lowest_score():
    """With one slot, the cached token's score never decreases and is the running maximum."""
    params, _ = inputs(16, seed=7, padded=False)
    options = make_options(window=2, slots=1)
    state = sparse_cache.init_state(B, H, HKV, F, D, options, device="cpu", dtype=torch.float64)
    best = torch.full((B, HKV), float("-inf"), dtype=torch.float64)
    with torch.no_grad():
        for t in range(16):
            before = state["cache_score"][..., 0].clone()
            _, state = sparse_cache_step(*[p[:, :, t:t + 1] for p in params], state, options)
            after = state["cache_score"][..., 0]
            assert (after >= before).all()
            best = torch.maximum(best, after)
            torch.testing.assert_close(after, best)
    assert torch.isfinite(best).all()


def test_the_decode_state_keeps_its_size():
    params, _ = inputs(10, seed=2, padded=False)
    options = make_options(window=3, slots=2)
    _, state = continue_sparse_cache(*[p[:, :, :1] for p in params], options)
    shapes = {name: tuple(t.shape) for name, t in state.items()}
    with torch.no_grad():
        for t in range(1, 10):
            _, state = sparse_cache_step(*[p[:, :, t:t + 1] for p in params], state, options)
            assert {name: tuple(t.shape) for name, t in state.items()} == shapes
    assert shapes["cache_k"] == (B, HKV, 2, D) and shapes["ring_k"] == (B, HKV, 3, D)


def test_with_the_window_wider_than_the_text_it_is_the_window_op():
    """No token leaves: the cache stays empty and the op is `gla_window`'s."""
    params, valid = inputs(7, seed=4)
    options = make_options(window=8, slots=3)
    y, state = chunk_sparse_cache(*params, options, valid=valid, output_final_state=True)
    empty = gla_init_state(B, H, HKV, F, D, 8, device="cpu", dtype=torch.float64)
    y_window, _ = gla_window_parallel(*params, valid, empty, options.branches)
    y_window = y_window * valid[:, None, :, None]
    torch.testing.assert_close(y, y_window, **TIGHT)
    assert not torch.isfinite(state["cache_score"]).any()


def test_float32_inputs_give_float32_outputs_and_state():
    params, valid = inputs(6, dtype=torch.float32)
    y, state = chunk_sparse_cache(*params, make_options(), valid=valid, output_final_state=True)
    assert y.dtype == torch.float32 and state["S"].dtype == torch.float32


def test_options_refuse_an_empty_cache():
    with pytest.raises(ValueError, match="slot"):
        make_options(slots=0)


def test_the_last_query_reads_window_and_cache_under_one_normaliser():
    """y_t = (sum_j e^{s_tj - m_t} v_j + phi_q^T S_t) / (sum_j e^{s_tj - m_t} + phi_q^T z_t + eps), j over
    the window and the cached positions, m_t their highest logit, written out for the last token."""
    L, w = 11, 3
    params, _ = inputs(L, seed=9, padded=False)
    fq, fk, log_g, qw, kw, v = (p.detach() for p in params)
    options = make_options(window=w, slots=2, sinks=False)
    y, state = chunk_sparse_cache(fq, fk, log_g, qw, kw, v, options, output_final_state=True)
    decay_to_end = (log_g.flip(2).cumsum(2).flip(2) - log_g).exp()  # the gate from each token to the last
    S = (fk * decay_to_end).transpose(-1, -2) @ v.repeat_interleave(H // HKV, 1)
    z = (fk * decay_to_end).sum(2)
    for b in range(B):
        for h in range(H):
            kv = h // (H // HKV)
            positions = list(range(L - w, L)) + state["cache_pos"][b, kv].tolist()
            assert min(positions) >= 0 and len(set(positions)) == w + 2
            logits = (kw[b, kv, positions] @ qw[b, h, -1]) * 0.6
            weights = (logits - logits.max()).exp()
            num = weights @ v[b, kv, positions] + fq[b, h, -1] @ S[b, h]
            den = weights.sum() + fq[b, h, -1] @ z[b, h] + options.branches.eps
            torch.testing.assert_close(y[b, h, -1], num / den, **TIGHT)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_parallel_form_on_cuda_equals_the_cpu_in_values_and_gradients():
    """The form training runs on a GPU (PyTorch ops only) against the same call on the CPU, float32, a
    length of several query blocks with the slots overflowing."""
    params, valid = inputs(300, seed=4, dtype=torch.float32)
    options = {device: make_options(window=32, slots=8, chunk=64, dtype=torch.float32, device=device)
               for device in ("cpu", "cuda")}
    y_cpu, state_cpu = chunk_sparse_cache(*params, options["cpu"], valid=valid, output_final_state=True)
    on_gpu = [t.detach().cuda().requires_grad_() for t in params]
    y_gpu, state_gpu = chunk_sparse_cache(*on_gpu, options["cuda"], valid=valid.cuda(), output_final_state=True)
    torch.testing.assert_close(y_gpu.cpu(), y_cpu, atol=1e-4, rtol=1e-4)
    weights = torch.randn_like(y_cpu)
    grads_cpu = torch.autograd.grad((y_cpu * weights).sum(), params)
    grads_gpu = torch.autograd.grad((y_gpu * weights.cuda()).sum(), on_gpu)
    for a, b in zip(grads_gpu, grads_cpu, strict=True):
        torch.testing.assert_close(a.cpu(), b, atol=1e-3, rtol=1e-3)
    for name, t in state_cpu.items():
        if t.is_floating_point():
            torch.testing.assert_close(state_gpu[name].cpu(), t, atol=1e-4, rtol=1e-4, msg=name)
        else:
            assert torch.equal(state_gpu[name].cpu(), t), name
