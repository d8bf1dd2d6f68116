"""The chunked form's kernel (`ops.still.chunk_triton`) equals the reference op
(`still_parallel(fresh=True, keep_state=False)`, float64) in y, and `chunk_still` runs it for fresh
calls without gradients (y and the state after against `still_parallel`), leaving continued calls and
calls wanting gradients to the other implementations.

Without a GPU it runs in Triton's interpreter, in a worker subprocess (interpreted.py), one test a case."""

import pytest
import torch
from interpreted import cases
from test_lizard_triton import HAS_TRITON

from linearize.ops.gla_window.testing import within_tolerance
from linearize.ops.still.testing import StillCase, compare_chunk_kernel

bf16 = torch.bfloat16


def tiles(C, BN=None, BF=16):
    """`chunk_launch`'s keys with C queries a block (several blocks on short inputs), BN keys a step."""
    return {"C": C, "BN": BN or C, "BF": BF, "num_warps": 4, "num_stages": 2}


# (case, tiles or None for `chunk_launch`'s). Several blocks, C not dividing L, salient slots that
# overflow and evict, left padding (row 1), GQA and MHA, gate on and off, each routing rule.
INTERPRETER_CASES = {
    "L100-gqa-gate-c16": (StillCase(L=100), tiles(16)),
    "L100-gqa-gate-bf16": (StillCase(L=100, dtype=bf16), None),
    "L130-mha-nogate-d64-c32": (StillCase(L=130, HKV=4, D=64, F=64, gate=False), tiles(32, 16, 32)),
    "L70-random-pad10-c16": (StillCase(L=70, routing="random", pad=10), tiles(16)),
    "L40-recency-c16": (StillCase(L=40, routing="recency"), tiles(16)),
    "L100-window8-c32-bf16": (StillCase(L=100, window=8, chunk=4, per_chunk=1, slots=5, dtype=bf16), tiles(32)),
    "L50-no-slots-c16": (StillCase(L=50, per_chunk=0, slots=0), tiles(16)),
    "L3-nopad": (StillCase(L=3, pad=0), None),
    "L90-d128-f64": (StillCase(L=90, H=2, HKV=1, D=128, F=64), None),
    # Gemma's head dim: 16-query blocks, 16-bit only.
    "L40-d256-f256-bf16": (StillCase(L=40, H=2, HKV=1, D=256, F=256, dtype=bf16), None),
}
GPU_CASES = {
    **INTERPRETER_CASES,
    "L600-w128-c64-bf16": (StillCase(L=600, D=64, F=64, window=128, chunk=64, per_chunk=12, slots=96, dtype=bf16),
                           None),
    "L1100-w128-c64-slots768": (StillCase(L=1100, H=8, HKV=2, D=64, F=64, window=128, chunk=64, per_chunk=48,
                                          slots=768, pad=37), None),
    "L300-d128-bf16": (StillCase(L=300, H=4, HKV=1, D=128, F=128, window=64, chunk=64, per_chunk=8, slots=64,
                                 dtype=bf16), None),
    "L700-d128-f64-bf16": (StillCase(L=700, H=8, HKV=2, D=128, F=64, window=128, chunk=64, per_chunk=16, slots=128,
                                     dtype=bf16), None),
    "L500-d256-f256-bf16": (StillCase(L=500, H=4, HKV=1, D=256, F=256, window=128, chunk=64, per_chunk=8, slots=128,
                                      dtype=bf16), None),
}
FAST_CASES = ("L100-gqa-gate-c16",)


def _check(case: StillCase, out: dict):
    assert out["path"] == "kernel", out["path"]
    assert within_tolerance(case, out["errors"]), out["errors"]
    assert out["ran"] == ["triton-chunked"] and out["dtype"] == str(case.dtype), out
    assert out["dispatched"] < (2e-2 if case.dtype == bf16 else 1e-5), out
    # The routing and the state run in float32 PyTorch either way: the same state, up to rounding.
    assert out["state_names"] and out["state_exact"] and out["state"] < 1e-5, out


@pytest.mark.parametrize("name", cases(INTERPRETER_CASES, FAST_CASES))
def test_interpreter(name, interpreter):
    code = ("from linearize.ops.still.testing import compare_chunk_kernel\n"
            "from test_still_chunk_triton import INTERPRETER_CASES\n"
            f"case, launch = INTERPRETER_CASES[{name!r}]\n"
            "result = compare_chunk_kernel(case, 'cpu', launch=launch)")
    _check(INTERPRETER_CASES[name][0], interpreter.run(code, f"still chunk kernel {name}"))


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs CUDA and triton")
@pytest.mark.parametrize("name", GPU_CASES)
def test_gpu(name):
    case, launch = GPU_CASES[name]
    _check(case, compare_chunk_kernel(case, "cuda", launch=launch))


def test_the_chunked_kernel_takes_fresh_calls_without_gradients_only(monkeypatch):
    """A continued call, or one wanting gradients, goes on to the next implementation, saying why."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    pytest.importorskip("triton")
    from linearize.ops import still as dispatch
    from linearize.ops.still.testing import FeatureMap, _options, make_inputs, naive_init

    case = StillCase(L=8)
    (q, k, v, _, _, gate), valid, _ = make_inputs(case, "cpu")
    phi = FeatureMap(case.D, case.F, 0)

    def call(fresh, grad=False):
        return dispatch._Call(q.detach().requires_grad_(grad), k, v, valid, gate, naive_init(case, "cpu"), phi, phi,
                              _options(case), start=0, fresh=fresh, caching=False, dtype=None)

    assert dispatch._chunk_kernel_supported(call(True)) is None
    assert dispatch._chunk_kernel_supported(call(False)) == "a continued call: the chunked form starts from an empty state"
    assert dispatch._chunk_kernel_supported(call(True, grad=True)) == (
        "gradients wanted: only the fresh pass's kernels have a backward")
    assert [i.name for i in dispatch.CHUNK.implementations][:3] == ["triton-chunked", "triton", "triton-differentiable"]


def test_on_a_gpu_the_chunked_kernel_waits_for_its_switch(monkeypatch):
    """Checked in the interpreter only, the kernel takes no prefill on a CUDA device unless
    LINEARIZE_STILL_CHUNK_KERNEL=1 (the GPU tests set it); the call goes on to the one-pass kernel."""
    from linearize.ops import still as dispatch

    monkeypatch.delenv(dispatch.CHUNK_KERNEL_ON_GPU, raising=False)
    monkeypatch.setattr(dispatch, "_fresh_only", lambda call: None)
    monkeypatch.setattr(dispatch, "_kernels_without_gradients", lambda call: None)
    on_gpu = type("Call", (), {"q": type("Q", (), {"is_cuda": True})()})()
    assert dispatch._chunk_kernel_supported(on_gpu) == (
        "not yet checked compiled on a GPU (set LINEARIZE_STILL_CHUNK_KERNEL=1 to use it)")
    monkeypatch.setenv(dispatch.CHUNK_KERNEL_ON_GPU, "1")
    assert dispatch._chunk_kernel_supported(on_gpu) is None
