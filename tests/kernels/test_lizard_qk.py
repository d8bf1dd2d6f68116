"""Lizard's op from the model's q and k (the Hedgehog features formed inside the kernels) equals the
Hedgehog maps followed by the reference op, in the output and the gradients of q, k, both weights, the
gate, v, the sinks and alpha (`linearize.kernels.qk_check`; tolerances as in test_lizard_triton)."""

import importlib.util
import json

import pytest
import torch
from interpreted import interpreted as run_interpreted

from linearize.kernels.check import Case, within_tolerance
from linearize.kernels.qk_check import compare_qk, compare_qk_forward

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
needs_gpu = pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs CUDA and triton")
bf16 = torch.bfloat16

CASES = {
    "L100-gqa-w32-sinks4": Case(L=100),
    "L1": Case(L=1),
    "L63-w64-bf16": Case(L=63, window=64, dtype=bf16),
    "L257-w64-nosinks-mha": Case(L=257, window=64, sinks=0, HKV=4),
    "L37-vector-nosinks": Case(L=37, gate="vector", sinks=0),
    "shared-L100-gqa-w32-sinks4": Case(L=100, shared=True),
    "frozen-L63-w64-bf16": Case(L=63, window=64, dtype=bf16, frozen=True),
    "unnormalised-L100-nosinks-bf16": Case(L=100, sinks=0, normalize=False, dtype=bf16),
    "tma-L100-F128-D64": Case(L=100, F=128, D=64, tma=True),
    "pointer-loads-chunks-last-L65-bf16": Case(L=65, dtype=bf16, tma=False, chunks_first=False),
    "F32-D16-L33": Case(L=33, F=32, D=16),  # the smallest tiles tl.dot takes
    "fallback-F48": Case(L=50, F=48),  # 24 Hedgehog features a half: the PyTorch maps and lizard_attention
}
INFERENCE_CASES = {
    "L100-gqa-w32-sinks4-bf16": Case(L=100, dtype=bf16),
    "tma-L129-w64-F128-D128-bf16": Case(L=129, window=64, F=128, D=128, dtype=bf16, tma=True),
    "shared-L63-vector": Case(L=63, gate="vector", shared=True),
}
GPU_CASES = CASES | {"L1000-w128-F128-D128-bf16": Case(L=1000, dtype=bf16, window=128, F=128, D=128),
                     "shared-L1000-w256-F128-D64-bf16": Case(L=1000, dtype=bf16, window=256, F=128, D=64, shared=True)}

_SCRIPT = """
import json, sys, torch
from linearize.kernels import qk_check
from linearize.kernels.check import Case
cases = [eval(c, {"Case": Case, "torch": torch}) for c in json.loads(sys.argv[1])]
print(json.dumps([getattr(qk_check, sys.argv[2])(c, "cpu") for c in cases]))
"""


def _interpret(cases: dict, how: str) -> dict:
    return dict(zip(cases, run_interpreted(_SCRIPT, json.dumps([repr(c) for c in cases.values()]), how)))


@pytest.fixture(scope="module")
def interpreted():
    return _interpret(CASES, "compare_qk")


@pytest.fixture(scope="module")
def interpreted_inference():
    return _interpret(INFERENCE_CASES, "compare_qk_forward")


def _check(case: Case, out: dict):
    assert (out["path"] == "kernel") == (case.F != 48), out["path"]
    assert within_tolerance(case, out["errors"]), out["errors"]


@needs_triton
@pytest.mark.parametrize("name", CASES)
def test_interpreter(name, interpreted):
    _check(CASES[name], interpreted[name])


@needs_triton
@pytest.mark.parametrize("name", INFERENCE_CASES)
def test_inference_forward_interpreter(name, interpreted_inference):
    case = INFERENCE_CASES[name]
    assert within_tolerance(case, interpreted_inference[name]["errors"])


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("name", GPU_CASES)
def test_gpu(name):
    _check(GPU_CASES[name], compare_qk(GPU_CASES[name]))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("name", INFERENCE_CASES)
def test_inference_forward_gpu(name):
    case = INFERENCE_CASES[name]
    assert within_tolerance(case, compare_qk_forward(case)["errors"])


def test_cpu_falls_back_to_the_feature_maps_and_the_chunked_op():
    out = compare_qk(Case(L=40, window=16), "cpu")
    assert out["path"] != "kernel"
    assert within_tolerance(Case(L=40), out["errors"]), out["errors"]
