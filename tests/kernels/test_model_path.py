"""A linearized model takes the fused kernel path where it applies, with the same results as the PyTorch ops."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from attention_kernel_check import check, check_padded
from test_lizard_triton import HAS_TRITON

TESTS = Path(__file__).resolve().parents[1]

_SCRIPT = ("import json, attention_kernel_check as c; "
           "print(json.dumps({'plain': c.check('cpu'), 'padded': c.check_padded('cpu')}))")


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
def test_model_through_the_interpreted_kernel_equals_the_pytorch_ops():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(TESTS), *sys.path])}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=900,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    errors, padded = results["plain"], results["padded"]
    # Two layers: the uncached forward and both cached prefills take the kernel, the decode steps don't.
    assert errors.pop("fused_calls") == 6
    assert max(errors.values()) < 1e-4, errors
    # Left padding: the uncached forward and the first prefill take the kernel.
    assert padded.pop("fused_calls") == 4
    assert max(padded.values()) < 1e-4, padded


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs CUDA and triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_through_the_kernel_on_cuda_equals_the_pytorch_ops(dtype):
    errors = check("cuda", dtype, length=300)
    assert errors.pop("fused_calls") == 6
    padded = check_padded("cuda", dtype, length=300, pad=37)
    assert padded.pop("fused_calls") == 4
    errors |= {f"padded {name}": value for name, value in padded.items()}
    assert max(errors.values()) < (1e-4 if dtype == torch.float32 else 2e-2), errors
