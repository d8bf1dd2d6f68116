"""The fused Lizard kernels equal the reference op, in the output and the gradients of every input.

Reference: `gla_window_parallel` in float64 on the same (rounded) inputs, empty state, all tokens valid,
beta = 1, normalize=True, shared=False (`linearize.ops.gla_window.testing.compare`). Relative Frobenius error
below 1e-4 (float32) / 1e-2 (bfloat16), or within 4x of the reference op run in float32 where the case
itself is ill-conditioned (at L = 1 d phi vanishes up to eps and float32 cancels).

On a GPU: `pytest -m gpu tests/kernels`. Without one, the same kernels run in Triton's interpreter
(numpy on CPU) in a worker subprocess (interpreted.py), so TRITON_INTERPRET=1 never leaks into this
process; those tests need triton installed and skip otherwise. Each case is its own test.
"""

import importlib.util
import subprocess
import sys

import pytest
import torch
from interpreted import cases

from linearize.ops.gla_window.testing import CHECK_CASES, Case, compare, compare_forward, within_tolerance

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
bf16 = torch.bfloat16

INTERPRETER_CASES = {
    "L100-gqa-w32-sinks4": Case(L=100),
    "L1": Case(L=1),
    "L63-w64-bf16": Case(L=63, window=64, dtype=bf16),
    "L257-w64-nosinks-mha": Case(L=257, window=64, sinks=0, HKV=4),
    "L100-strong-decay": Case(L=100, gate_bias=-4.0),
    "L37-vector-nosinks": Case(L=37, gate="vector", sinks=0),
    "L20-vector-w64-bf16": Case(L=20, gate="vector", window=64, dtype=bf16),
    "fallback-F48": Case(L=50, F=48),
    "split-L100-gqa-w32-sinks4": Case(L=100, split=True),
    "split-L37-vector-nosinks": Case(L=37, gate="vector", sinks=0, split=True),
    "one-pass-L63-w64-bf16": Case(L=63, window=64, dtype=bf16, split=False),
    "unnormalised-L100-nosinks": Case(L=100, sinks=0, normalize=False),
    "shared-L100-gqa-w32-sinks4": Case(L=100, shared=True),
    "shared-split-L63-nosinks-bf16": Case(L=63, sinks=0, dtype=bf16, shared=True, split=True),
    "shared-split-L100-F128-D64": Case(L=100, F=128, D=64, shared=True, split=True),  # more features than head dims
    "shared-one-pass-L37-vector": Case(L=37, gate="vector", shared=True, split=False),
    "frozen-shared-L100-gqa-w32-sinks4": Case(L=100, shared=True, frozen=True),
    "frozen-L63-w64-bf16": Case(L=63, window=64, dtype=bf16, frozen=True),
    "split-rows16-L100-gqa-w32-sinks4": Case(L=100, split=True, state_block_k=16, state_block_v=32),
    # Each backward pass on blocks of its own size: the window passes' row blocks differ in count.
    "split-own-blocks-L100-gqa-w32-sinks4": Case(L=100, split=True, dstate_block_k=32, dv_block_v=32,
                                                 window_dq_block=16, window_dkv_block=32),
    # The split backward's per-pass dq, dk and dv kernels (else the fused chunk kernel, where it applies).
    "split-unfused-L100-gqa-w32-sinks4": Case(L=100, split=True, fused_backward=False),
    "split-L1": Case(L=1, split=True),
    "split-F16-D32-L33": Case(L=33, F=16, D=32, split=True),  # the smallest tiles tl.dot takes
    "shared-split-unfused-L63-nosinks-bf16": Case(L=63, sinks=0, dtype=bf16, shared=True, split=True,
                                                  fused_backward=False),
    "dy-transposed-L100-gqa-w32-sinks4": Case(L=100, dy_transposed=True),
    "dy-transposed-split-L63-w64-bf16": Case(L=63, window=64, dtype=bf16, split=True, dy_transposed=True),
    # The launch order with the chunks on grid axis 0 and the heads last (Config.chunks_first).
    "chunks-first-split-L100-gqa-w32-sinks4": Case(L=100, split=True, chunks_first=True),
    "chunks-first-shared-split-L63-vector-bf16": Case(L=63, gate="vector", dtype=bf16, shared=True, split=True,
                                                      chunks_first=True),
    "chunks-first-one-pass-L100-w64": Case(L=100, window=64, split=False, chunks_first=True),
    # The forward's tiles through tensor descriptors (Config.tma; the interpreter copies them as TMA does).
    "tma-split-L100-gqa-w32-sinks4": Case(L=100, split=True, tma=True),
    "tma-one-pass-L63-w64-bf16": Case(L=63, window=64, dtype=bf16, split=False, tma=True),
    "tma-shared-split-L37-vector-F128-D64": Case(L=37, gate="vector", F=128, D=64, shared=True, split=True, tma=True),
    "tma-split-rows16-L100": Case(L=100, split=True, state_block_k=16, state_block_v=32, tma=True),
}
SLOW_INTERPRETER_CASES = {
    "L257-vector-w64": Case(L=257, gate="vector", window=64),
    "L257-w32-nosinks-bf16": Case(L=257, sinks=0, dtype=bf16),
    "L300-w256-sinks8-F128": Case(L=300, window=256, sinks=8, F=128, D=128),
    "L100-vector-bf16": Case(L=100, gate="vector", dtype=bf16),
    "L63-vector-strong-decay": Case(L=63, gate="vector", gate_bias=-4.0),
    "split-L300-w256-sinks8-F128": Case(L=300, window=256, sinks=8, F=128, D=128, split=True),
    "split-L100-strong-decay": Case(L=100, gate_bias=-4.0, split=True),
    "split-unfused-L300-w256-sinks8-F128": Case(L=300, window=256, sinks=8, F=128, D=128, split=True,
                                                fused_backward=False),
    "split-unnormalised-L100-bf16": Case(L=100, dtype=bf16, sinks=0, normalize=False, split=True),
    "split-rows32-L37-vector-nosinks": Case(L=37, gate="vector", sinks=0, split=True, state_block_k=32),
    "unnormalised-one-pass-L63-bf16": Case(L=63, window=64, dtype=bf16, sinks=0, normalize=False, split=False),
}
# Inference forwards (no gradients: the forward kernel's variant that saves nothing for a backward),
# checked by `compare_forward`, the output alone.
INFERENCE_CASES = {
    "split-L100-gqa-w32-sinks4-bf16": Case(L=100, dtype=bf16),
    "one-pass-L63-w64": Case(L=63, window=64),
    "shared-L100-gqa-w32-sinks4": Case(L=100, shared=True),
    "unnormalised-L100-nosinks-bf16": Case(L=100, sinks=0, normalize=False, dtype=bf16),
    "vector-L37-nosinks": Case(L=37, gate="vector", sinks=0),
    "chunks-first-shared-L100-gqa-w32-sinks4-bf16": Case(L=100, shared=True, dtype=bf16, chunks_first=True),
    "tma-L129-w64-bf16": Case(L=129, window=64, dtype=bf16, tma=True),
    "tma-unnormalised-L65-F128-nosinks": Case(L=65, F=128, D=128, sinks=0, normalize=False, split=True, tma=True),
}
GPU_CASES = {**INTERPRETER_CASES, **SLOW_INTERPRETER_CASES, **{f"check{i}": c for i, c in enumerate(CHECK_CASES)}}

# `make test` runs one case per kernel: the one-pass and the split kernels, the shared normaliser, stage
# 1's frozen inputs, tensor descriptors and the PyTorch fallback. The variants that change only how a
# kernel is fed or launched (a vector gate, the split backward unfused, a transposed dy, state row
# blocks, the chunks-first order) run in `make test-all`.
FAST_CASES = ("one-pass-L63-w64-bf16", "split-F16-D32-L33", "shared-split-L63-nosinks-bf16", "frozen-L63-w64-bf16",
              "tma-one-pass-L63-w64-bf16", "fallback-F48")
FAST_INFERENCE_CASES = ("one-pass-L63-w64", "split-L100-gqa-w32-sinks4-bf16")


def _interpret(interpreter, table: str, name: str, how: str = "compare") -> dict:
    """`testing.compare` (or `how`) of the case `name` of this module's `table`, interpreted."""
    code = (f"from linearize.ops.gla_window import testing\nfrom test_lizard_triton import {table}\n"
            f"result = testing.{how}({table}[{name!r}], 'cpu')")
    return interpreter.run(code, f"{table}[{name!r}]")


def _check(case: Case, out: dict):
    assert (out["path"] == "kernel") == (case.F != 48), out["path"]
    assert within_tolerance(case, out["errors"]), out["errors"]


@pytest.mark.parametrize("name", cases(INTERPRETER_CASES, FAST_CASES))
def test_interpreter(name, interpreter):
    _check(INTERPRETER_CASES[name], _interpret(interpreter, "INTERPRETER_CASES", name))


@pytest.mark.slow
@pytest.mark.parametrize("name", cases(SLOW_INTERPRETER_CASES))
def test_interpreter_slow(name, interpreter):
    _check(SLOW_INTERPRETER_CASES[name], _interpret(interpreter, "SLOW_INTERPRETER_CASES", name))


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs CUDA and triton")
@pytest.mark.parametrize("name", GPU_CASES)
def test_gpu(name):
    _check(GPU_CASES[name], compare(GPU_CASES[name], "cuda"))


@pytest.mark.parametrize("name", cases(INFERENCE_CASES, FAST_INFERENCE_CASES))
def test_inference_forward_interpreter(name, interpreter):
    _check(INFERENCE_CASES[name], _interpret(interpreter, "INFERENCE_CASES", name, "compare_forward"))


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs CUDA and triton")
@pytest.mark.parametrize("name", INFERENCE_CASES)
def test_inference_forward_gpu(name):
    _check(INFERENCE_CASES[name], compare_forward(INFERENCE_CASES[name], "cuda"))


_GATE_GRAD_SCRIPT = """
import torch
from linearize.ops.gla_window.triton import scalar_gate_grad
result = []
for NB, B, H, L in [(1, 2, 3, 5), (4, 2, 1, 2049), (1, 1, 1, 1)]:  # 2049: three blocks, the last partial
    da = torch.randn(NB, B, H, L, generator=torch.Generator().manual_seed(L))
    reference = da.sum(0).flip(-1).cumsum(-1).flip(-1)
    result.append(((scalar_gate_grad(da) - reference).abs().max() / reference.abs().max()).item())
"""


def test_scalar_gate_grad_kernel_is_the_reverse_cumsum_of_the_summed_shares(interpreter):
    assert max(interpreter.run(_GATE_GRAD_SCRIPT, "scalar_gate_grad")) < 1e-6


def test_cpu_falls_back_to_the_chunked_op():
    case = Case(L=45, window=8)
    out = compare(case, "cpu")
    assert out["path"] != "kernel"
    assert within_tolerance(case, out["errors"]), out["errors"]


def test_works_without_triton():
    """Importing and calling needs neither triton nor a GPU (CI may have neither)."""
    code = """
import sys
sys.modules["triton"] = None  # any `import triton` now fails
import torch
from linearize.ops.backend import kernels_available
from linearize.ops.gla_window import GlaWindowOptions, chunk_gla_window
assert not kernels_available()
fq = torch.rand(1, 2, 5, 4)
y, _ = chunk_gla_window(fq, fq, torch.zeros(1, 2, 5, 1), *torch.randn(3, 1, 2, 5, 8),
                        GlaWindowOptions(window=2, scale=0.3, alpha=torch.ones(2)))
assert y.shape == (1, 2, 5, 8) and torch.isfinite(y).all()
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]


@needs_triton
def test_config_refuses_block_sizes_the_kernels_cannot_take():
    from linearize.ops.gla_window.triton import Config

    for dtype in (torch.float32, bf16):
        Config.default(dtype)
    for bad in ({"chunk": 48}, {"state_block_k": 8}, {"state_block_v": 96}, {"dv_block_v": 96}, {"window_dkv_block": 8},
                {"dstate_block_k": 24}, {"warps": 3}, {"stages": 0}, {"state_warps": 6}, {"state_stages": 0},
                {"forward_stages": 0}, {"forward_registers": 16}, {"forward_registers": 256}):
        with pytest.raises(ValueError, match="Config"):
            Config(**{"chunk": 64, **bad})


@needs_triton
def test_shapes_the_gpu_build_gets_wrong_are_named():
    from linearize.ops.gla_window.triton import miscompiled_on_gpu

    assert miscompiled_on_gpu(32, 16, bf16) and miscompiled_on_gpu(64, 16, torch.float16)
    assert not any(miscompiled_on_gpu(F, D, dtype) for F, D, dtype in
                   ((16, 16, bf16), (32, 32, bf16), (128, 64, bf16), (32, 16, torch.float32)))


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs CUDA and triton")
def test_gpu_falls_back_where_its_build_is_wrong():
    """bf16, 32 features, head dim 16: the PyTorch op, not the kernel (which read out of range there)."""
    case = Case(L=300, window=8, sinks=2, dtype=bf16, F=32, D=16)
    out = compare(case)
    assert out["path"].startswith("head dim 16 under 32 features"), out["path"]
    assert within_tolerance(case, out["errors"]), out["errors"]
