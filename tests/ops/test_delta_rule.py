"""The gated delta-rule op: the chunked form == the token-by-token reference in values and gradients,
step by step == one pass, a constant state, and the backend's choice of implementation."""

import pytest
import torch

from linearize.ops import backend, delta_rule
from linearize.ops.delta_rule import DeltaRuleOptions
from linearize.ops.delta_rule.chunk import delta_rule_chunked
from linearize.ops.delta_rule.naive import delta_rule_recurrent, init_state

B, H, HKV, DK, DV = 2, 4, 2, 8, 6
TIGHT = {"atol": 1e-10, "rtol": 1e-9}


def inputs(L, n_states=H, seed=0, dtype=torch.float64, padded=True):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, L, DK, generator=g, dtype=dtype)
    k = torch.randn(B, HKV, L, DK, generator=g, dtype=dtype)
    v = torch.randn(B, HKV, L, DV, generator=g, dtype=dtype)
    # Decays from strong (a ~ 0.05) to none (a = 1), writes from faint to nearly full.
    log_a = -3 * torch.rand(B, n_states, L, generator=g, dtype=dtype) ** 2
    b = torch.rand(B, n_states, L, generator=g, dtype=dtype).clamp(0.02, 0.98)
    valid = torch.ones(B, L, dtype=torch.bool)
    if padded and L > 3:
        valid[0, :2] = False  # left padding
        valid[1, -1] = False  # right padding
    return [t.requires_grad_() for t in (q, k, v, log_a, b)], valid


def random_state(n_states, seed=1, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return {"S": (0.3 * torch.randn(B, n_states, DK, DV, generator=g, dtype=dtype)).requires_grad_()}


def assert_same_values_and_gradients(first, second, params):
    (y1, s1), (y2, s2) = first, second
    torch.testing.assert_close(y1, y2, **TIGHT)
    torch.testing.assert_close(s1["S"], s2["S"], **TIGHT)
    wy, ws = torch.randn_like(y1), torch.randn_like(s1["S"])
    g1 = torch.autograd.grad((y1 * wy).sum() + (s1["S"] * ws).sum(), params)
    g2 = torch.autograd.grad((y2 * wy).sum() + (s2["S"] * ws).sum(), params)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, **TIGHT)


@pytest.mark.parametrize(("L", "chunk", "n_states", "carried"), [
    (13, 4, H, False),    # a length not a multiple of the chunk, padding both sides
    (13, 4, HKV, True),   # one state per KV head (grouped queries), a carried state
    (5, 8, H, True),      # shorter than one chunk
    (16, 4, H, False),    # whole chunks
])
def test_chunked_equals_recurrent(L, chunk, n_states, carried):
    params, valid = inputs(L, n_states)
    state = random_state(n_states) if carried else init_state(B, n_states, DK, DV, device="cpu", dtype=torch.float64)
    options = DeltaRuleOptions(chunk=chunk, scale=0.7)
    grads_of = params + ([state["S"]] if carried else [])
    assert_same_values_and_gradients(delta_rule_chunked(*params, valid, state, options),
                                     delta_rule_recurrent(*params, valid, state, options), grads_of)


@pytest.mark.slow
@pytest.mark.parametrize("L", [1, 2, 7, 31, 64, 65])
@pytest.mark.parametrize("chunk", [1, 8, 16])
@pytest.mark.parametrize("n_states", [H, HKV])
def test_chunked_equals_recurrent_grid(L, chunk, n_states):
    params, valid = inputs(L, n_states, seed=L)
    state = random_state(n_states)
    options = DeltaRuleOptions(chunk=chunk)
    assert_same_values_and_gradients(delta_rule_chunked(*params, valid, state, options),
                                     delta_rule_recurrent(*params, valid, state, options), params + [state["S"]])


def test_chunked_passes_gradcheck():
    (q, k, v, log_a, b), valid = inputs(6, HKV)
    state = random_state(HKV)
    options = DeltaRuleOptions(chunk=4)

    def pass_over(*tensors):
        y, after = delta_rule_chunked(*tensors[:5], valid, {"S": tensors[5]}, options)
        return y, after["S"]

    assert torch.autograd.gradcheck(pass_over, (q, k, v, log_a, b, state["S"]), fast_mode=True)


def test_recurrence_writes_and_recalls_one_key():
    """A full write (b -> 1, no decay) then a query on the same key reads the value back exactly; a
    second write to the same key replaces it rather than adding to it."""
    key = torch.nn.functional.normalize(torch.randn(1, 1, 1, DK, dtype=torch.float64), dim=-1)
    first, second = torch.randn(1, 1, 1, DV, dtype=torch.float64), torch.randn(1, 1, 1, DV, dtype=torch.float64)
    state = init_state(1, 1, DK, DV, device="cpu", dtype=torch.float64)
    ones, zeros = torch.ones(1, 1, 1, dtype=torch.float64), torch.zeros(1, 1, 1, dtype=torch.float64)
    options = DeltaRuleOptions(eps=0.0)
    _, state = delta_rule_recurrent(key, key, first, zeros, ones, None, state, options)
    o, state = delta_rule_recurrent(key, key, second, zeros, ones, None, state, options)
    torch.testing.assert_close(o, second)


def test_padding_leaves_the_state_unchanged_and_reads_zeros():
    (q, k, v, log_a, b), valid = inputs(6, padded=False)
    valid[:, 2:4] = False
    state = random_state(H)
    o, after = delta_rule_chunked(q, k, v, log_a, b, valid, state, DeltaRuleOptions(chunk=4))
    assert (o[:, :, 2:4] == 0).all()
    keep = [0, 1, 4, 5]
    o_kept, after_kept = delta_rule_recurrent(q[:, :, keep], k[:, :, keep], v[:, :, keep], log_a[:, :, keep],
                                              b[:, :, keep], None, state, DeltaRuleOptions())
    torch.testing.assert_close(o[:, :, keep], o_kept, **TIGHT)
    torch.testing.assert_close(after["S"], after_kept["S"], **TIGHT)


def test_steps_equal_one_pass_and_the_state_keeps_its_size():
    L = 9
    (q, k, v, log_a, b), valid = inputs(L, HKV)
    options = DeltaRuleOptions(chunk=4)
    y_full, s_full = delta_rule.chunk_delta_rule(q, k, v, log_a, b, options, valid=valid, output_final_state=True)
    y_head, state = delta_rule.chunk_delta_rule(q[:, :, :3], k[:, :, :3], v[:, :, :3], log_a[:, :, :3], b[:, :, :3],
                                                options, valid=valid[:, :3], output_final_state=True)
    shape = state["S"].shape
    ys = [y_head]
    for t in range(3, L):
        y, state = delta_rule.delta_rule_step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1],
                                              log_a[:, :, t:t + 1], b[:, :, t:t + 1], state, options,
                                              valid=valid[:, t:t + 1])
        assert state["S"].shape == shape == (B, HKV, DK, DV)
        ys.append(y)
    torch.testing.assert_close(torch.cat(ys, 2), y_full, **TIGHT)
    torch.testing.assert_close(state["S"], s_full["S"], **TIGHT)


def test_continue_equals_one_pass():
    (q, k, v, log_a, b), valid = inputs(11)
    options = DeltaRuleOptions(chunk=4)
    y_full, s_full = delta_rule.continue_delta_rule(q, k, v, log_a, b, None, options, valid=valid)
    y1, s1 = delta_rule.continue_delta_rule(*(t[:, :, :5] for t in (q, k, v, log_a, b)), None, options,
                                            valid=valid[:, :5])
    y2, s2 = delta_rule.continue_delta_rule(*(t[:, :, 5:] for t in (q, k, v, log_a, b)), s1, options,
                                            valid=valid[:, 5:])
    torch.testing.assert_close(torch.cat([y1, y2], 2), y_full, **TIGHT)
    torch.testing.assert_close(s2["S"], s_full["S"], **TIGHT)


def test_float32_inputs_give_float32_outputs_and_state():
    (q, k, v, log_a, b), valid = inputs(5, dtype=torch.float32)
    y, state = delta_rule.chunk_delta_rule(q, k, v, log_a, b, DeltaRuleOptions(), valid=valid, output_final_state=True)
    assert y.dtype == state["S"].dtype == torch.float32
    y, state = delta_rule.delta_rule_step(q[:, :, :1], k[:, :, :1], v[:, :, :1], log_a[:, :, :1], b[:, :, :1],
                                          state, DeltaRuleOptions())
    assert y.dtype == state["S"].dtype == torch.float32


def test_the_registry_runs_torch_on_cpu_and_says_why():
    (q, k, v, log_a, b), _ = inputs(5)
    with backend.recording() as ran:
        delta_rule.chunk_delta_rule(q, k, v, log_a, b, DeltaRuleOptions())
        delta_rule.delta_rule_step(q[:, :, :1], k[:, :, :1], v[:, :, :1], log_a[:, :, :1], b[:, :, :1], None,
                                   DeltaRuleOptions())
    assert ran == [("chunk_delta_rule", "torch"), ("delta_rule_step", "torch")]
    call = delta_rule._Call(q, k, v, log_a, b, DeltaRuleOptions())
    assert delta_rule.CHUNK.reasons(call)["fla"] is not None
    assert delta_rule._fla_supports(call) == "fla's kernels take CUDA tensors"


def test_mismatched_heads_are_refused():
    (q, k, v, log_a, b), _ = inputs(3)
    with pytest.raises(ValueError, match="multiple of the keys"):
        delta_rule.chunk_delta_rule(q, k, v, log_a[:, :1], b[:, :1], DeltaRuleOptions())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not delta_rule.fla_importable(), reason="needs CUDA and fla")
@pytest.mark.parametrize("n_states", [H, HKV])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fla_kernels_match_the_reference(n_states, dtype):
    L = 100
    params, valid = inputs(L, n_states, dtype=torch.float32)
    state = random_state(n_states, dtype=torch.float32)
    options = DeltaRuleOptions(scale=0.5)
    y_ref, s_ref = delta_rule_recurrent(*params, valid, state, options)
    cuda = [t.detach().cuda().to(dtype).requires_grad_() for t in params[:3]] + \
        [t.detach().cuda().requires_grad_() for t in params[3:]]
    cuda_state = {"S": state["S"].detach().cuda()}
    tol = {"atol": 3e-2, "rtol": 3e-2} if dtype == torch.bfloat16 else {"atol": 2e-3, "rtol": 2e-3}
    with torch.no_grad(), backend.recording() as ran:
        y, s = delta_rule.continue_delta_rule(*cuda, cuda_state, options, valid=valid.cuda())
        y_step, s_step = delta_rule.delta_rule_step(*(t[:, :, :1] for t in cuda), cuda_state, options,
                                                    valid=valid[:, :1].cuda())
    assert ran == [("continue_delta_rule", "fla"), ("delta_rule_step", "fla")]
    torch.testing.assert_close(y.float().cpu(), y_ref.detach(), **tol)
    torch.testing.assert_close(s["S"].float().cpu(), s_ref["S"].detach(), **tol)
    y1, s1 = delta_rule_recurrent(*(t[:, :, :1] for t in params), valid[:, :1], state, options)
    torch.testing.assert_close(y_step.float().cpu(), y1.detach(), **tol)
    torch.testing.assert_close(s_step["S"].float().cpu(), s1["S"].detach(), **tol)
    # Gradients through the chunked kernel, from an empty state.
    empty = init_state(B, n_states, DK, DV, device="cpu")
    y_ref, _ = delta_rule_recurrent(*params, valid, empty, options)
    w = torch.randn_like(y_ref)
    grads_ref = torch.autograd.grad((y_ref * w).sum(), params)
    with backend.recording() as ran:
        y, _ = delta_rule.chunk_delta_rule(*cuda, options, valid=valid.cuda())
    refused = delta_rule.fla_backward_refused()
    assert ran == [("chunk_delta_rule", "torch" if refused else "fla")]
    grads = torch.autograd.grad((y.float() * w.cuda()).sum(), cuda)
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g.float().cpu(), g_ref, atol=10 * tol["atol"], rtol=10 * tol["rtol"])
