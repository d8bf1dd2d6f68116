"""The decode-step kernels equal `naive.gla_window_recurrent_step`: output and every entry of the new state."""

import pytest
import torch
from interpreted import cases
from test_lizard_triton import HAS_TRITON

from linearize.ops.gla_window import GlaWindowOptions
from linearize.ops.gla_window.naive import gla_window_recurrent_step

CASES = {
    "gqa-sinks": {},
    "vector-gate-nosinks": {"vector": True, "M": 0},
    "unnormalised-w33-mha": {"normalize": False, "beta": 0.5, "window": 33, "H": 2, "HKV": 2},
    "w2-F32-D64": {"B": 2, "window": 2, "M": 4, "F": 32, "D": 64},
    "all-padding-window": {"fresh": True},
    "shared-gqa-sinks": {"shared": True},
    "shared-vector-nosinks-empty-window": {"shared": True, "vector": True, "M": 0, "fresh": True},
    "in-place-gqa-sinks": {"in_place": True},
    "in-place-shared-vector-w2": {"in_place": True, "shared": True, "vector": True, "window": 2},
    # A bf16 model's step: window q, k, v, sinks and alpha in bf16 (converted by the kernels), y out in bf16.
    "bf16-operands-gqa-sinks": {"low": torch.bfloat16},
    "bf16-operands-shared-in-place": {"low": torch.bfloat16, "shared": True, "in_place": True},
}


def make_case(device, B=3, H=4, HKV=2, F=16, D=16, window=8, M=2, vector=False, normalize=True, beta=1.0,
              shared=False, fresh=False, seed=0):
    """Random inputs and state; row 1 is a padding token. `fresh`: an empty window (nothing valid yet)."""
    g = torch.Generator(device=device).manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g, device=device)
    log_g = torch.nn.functional.logsigmoid(r(B, H, 1, F if vector else 1) + 2)
    valid = (torch.arange(B, device=device) != 1)[:, None]
    win_valid = torch.rand(B, window - 1, generator=g, device=device) > (2 if fresh else 0.3)
    state = {"S": r(B, H, F, D), "z": r(B, H, F).abs(), "win_k": r(B, HKV, window - 1, D),
             "win_v": r(B, HKV, window - 1, D), "win_valid": win_valid}
    options = GlaWindowOptions(window=window, scale=D**-0.5, sinks=r(H, M) if M else None, alpha=r(H), beta=beta,
                               normalize=normalize, shared=shared)
    inputs = (r(B, H, 1, F).softmax(-1), r(B, H, 1, F).softmax(-1), log_g, r(B, H, 1, D), r(B, HKV, 1, D),
              r(B, HKV, 1, D), valid, state)
    return inputs, options


def errors(device, in_place=False, low=None, **case) -> dict:
    """Max abs errors against the reference step; `in_place`: the kernels write over the input state.
    `low`: qw, kw, v, sinks and alpha go in rounded to that dtype (the reference takes the rounded
    values in float32) and y comes out in it (compared with the reference's y rounded the same way)."""
    from linearize.ops.gla_window.step_triton import lizard_decode_step

    inputs, options = make_case(device, **case)
    given = inputs[-1]
    kernel_inputs, kernel_options = list(inputs), options
    if low is not None:
        kernel_inputs[3:6] = (t.to(low) for t in inputs[3:6])
        kernel_options = options.head_scalars_in(low)
        inputs = [t.float() if i in (3, 4, 5) else t for i, t in enumerate(kernel_inputs)]
        options = kernel_options.head_scalars_in(torch.float32)
    y_ref, state_ref = gla_window_recurrent_step(*inputs, options)
    y, state = lizard_decode_step(*kernel_inputs, kernel_options, in_place=in_place, out_dtype=low or torch.float32)
    assert all((state[name] is given[name]) == in_place for name in given)
    assert y.dtype == (low or torch.float32)
    out = {"y": (y.float() - y_ref.to(y.dtype).float()).abs().max().item()}
    for name, ref in state_ref.items():
        assert state[name].shape == ref.shape and state[name].dtype == ref.dtype, name
        out[name] = (state[name].float() - ref.float()).abs().max().item()
    return out


# Between them: a scalar and a vector gate, the shared normaliser, unnormalised, in place, bf16 operands.
FAST_CASES = ("gqa-sinks", "shared-vector-nosinks-empty-window", "unnormalised-w33-mha", "bf16-operands-shared-in-place")


@pytest.mark.parametrize("name", cases(CASES, FAST_CASES))
def test_interpreted_step_kernels_equal_the_reference_step(name, interpreter):
    errs = interpreter.case("test_decode_step", name)
    assert max(errs.values()) < 1e-5, errs


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs CUDA and triton")
@pytest.mark.parametrize("name", list(CASES))
def test_step_kernels_on_cuda_equal_the_reference_step(name):
    errs = errors("cuda", **CASES[name])
    assert max(errs.values()) < 1e-5, errs

