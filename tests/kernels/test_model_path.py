"""A linearized model takes the fused kernel path where it applies, with the same results as the PyTorch ops."""

import pytest
import torch
from attention_kernel_check import check, check_padded, check_stage1
from interpreted import interpreted
from test_lizard_triton import HAS_TRITON

# Kernel passes with 2 layers: the uncached forward and the first prefill, plus (Lizard only) the
# continued prefill; and the 3 single-token steps on the step kernels.
CALLS = {"lizard": 6, "liger": 4, "lizard-shared": 6}
STEP_CALLS = 2 * 3
_SCRIPT = ("import json, attention_kernel_check as c; "
           "print(json.dumps({m: {'plain': c.check('cpu', method=m), 'padded': c.check_padded('cpu', method=m), "
           "'static': c.check_static_decode('cpu', method=m)} for m in ('lizard', 'liger', 'lizard-shared')}))")


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
def test_model_through_the_interpreted_kernel_equals_the_pytorch_ops():
    for method, results in interpreted(_SCRIPT).items():
        plain, padded, static = results["plain"], results["padded"], results["static"]
        # greedy_decode on a frozen cache: 5 steps after the prefill, 2 layers each, through the step kernels
        assert static == {"same_tokens": True, "step_calls": 2 * 5}, (method, static)
        assert plain.pop("kernel_calls") == CALLS[method], method
        assert padded.pop("kernel_calls") == 4, method  # uncached forward and first prefill
        assert plain.pop("step_calls") == padded.pop("step_calls") == STEP_CALLS, method
        assert max(plain.values()) < 1e-4 and max(padded.values()) < 1e-4, (method, plain, padded)


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
def test_stage1_through_the_interpreted_kernels_skips_the_frozen_gradients():
    """Stage 1 trains only the new modules: the kernels give their gradients as the PyTorch ops do, and
    launch none of the passes that only the frozen q, k and v's gradients need."""
    for method in ("lizard", "lizard-shared"):
        errors = interpreted(f"import json, attention_kernel_check as c; "
                             f"print(json.dumps(c.check_stage1('cpu', method={method!r})))")
        assert errors.pop("kernel_calls") == 2 and errors.pop("frozen_input_launches") == 0, (method, errors)
        assert max(errors.values()) < 1e-4, (method, errors)


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
def test_bf16_model_steps_through_the_interpreted_kernels():
    """A bf16 model's decode steps hand the step kernels bf16 window q, k, v, sinks and alpha, and take
    y back in bf16, with no casts around them."""
    errors = interpreted("import json, torch, attention_kernel_check as c; "
                         "print(json.dumps(c.check('cpu', torch.bfloat16, method='lizard-shared')))")
    assert errors.pop("kernel_calls") == CALLS["lizard-shared"] and errors.pop("step_calls") == STEP_CALLS
    assert max(errors.values()) < 2e-2, errors


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs CUDA and triton")
@pytest.mark.parametrize("method", ["lizard", "liger", "lizard-shared"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_through_the_kernel_on_cuda_equals_the_pytorch_ops(method, dtype):
    errors = check("cuda", dtype, length=300, method=method)
    assert errors.pop("kernel_calls") == CALLS[method] and errors.pop("step_calls") == STEP_CALLS
    padded = check_padded("cuda", dtype, length=300, pad=37, method=method)
    assert padded.pop("kernel_calls") == 4 and padded.pop("step_calls") == STEP_CALLS
    errors |= {f"padded {name}": value for name, value in padded.items()}
    assert max(errors.values()) < (1e-4 if dtype == torch.float32 else 2e-2), errors


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs CUDA and triton")
@pytest.mark.parametrize("method", ["lizard", "lizard-shared"])
def test_stage1_through_the_kernels_on_cuda_skips_the_frozen_gradients(method):
    errors = check_stage1("cuda", method=method, length=300)
    assert errors.pop("kernel_calls") == 2 and errors.pop("frozen_input_launches") == 0, errors
    assert max(errors.values()) < 1e-4, errors
