"""A linearized model takes the fused kernel path where it applies, with the same results as the PyTorch ops."""

import pytest
import torch
from attention_kernel_check import check, check_padded, check_stage1
from interpreted import cases
from test_lizard_triton import HAS_TRITON

# Kernel passes with 2 layers: the uncached forward and the first prefill, plus (Lizard only) the
# continued prefill; and the 3 single-token steps on the step kernels.
CALLS = {"lizard": 6, "liger": 4, "lizard-shared": 6}
STEP_CALLS = 2 * 3
# method-form: a training pass, cached prefills and steps (plain); the same on a left-padded batch
# (padded); greedy_decode on a frozen cache (static).
MODEL_CASES = {f"{method}-{form}": (method, form) for method in CALLS for form in ("plain", "padded", "static")}
# Whole models through the interpreted kernels run in `make test-all`; `make test` covers each kernel
# against its op's reference (test_lizard_triton, test_continued, test_decode_step).
FAST_MODEL_CASES = ()
STAGE1_METHODS = ("lizard", "lizard-shared")
FAST_STAGE1 = ()  # the frozen-input kernel case (test_lizard_triton) is in `make test`


@pytest.mark.parametrize("name", cases(MODEL_CASES, FAST_MODEL_CASES))
def test_model_through_the_interpreted_kernel_equals_the_pytorch_ops(name, interpreter):
    method, form = MODEL_CASES[name]
    call = {"plain": "check", "padded": "check_padded", "static": "check_static_decode"}[form]
    errors = interpreter.run(f"import attention_kernel_check as c\nresult = c.{call}('cpu', method={method!r})", name)
    if form == "static":
        # greedy_decode on a frozen cache: 5 steps after the prefill, 2 layers each, through the step kernels
        assert errors == {"same_tokens": True, "step_calls": 2 * 5}, errors
        return
    # padded: the uncached forward and the first prefill
    assert errors.pop("kernel_calls") == (CALLS[method] if form == "plain" else 4), errors
    assert errors.pop("step_calls") == STEP_CALLS, errors
    assert max(errors.values()) < 1e-4, errors


@pytest.mark.parametrize("method", cases(STAGE1_METHODS, FAST_STAGE1))
def test_stage1_through_the_interpreted_kernels_skips_the_frozen_gradients(method, interpreter):
    """Stage 1 trains only the new modules: the kernels give their gradients as the PyTorch ops do, and
    launch none of the passes that only the frozen q, k and v's gradients need."""
    errors = interpreter.run(f"import attention_kernel_check as c\nresult = c.check_stage1('cpu', method={method!r})",
                             f"stage1 {method}")
    assert errors.pop("kernel_calls") == 2 and errors.pop("frozen_input_launches") == 0, errors
    assert max(errors.values()) < 1e-4, errors


@pytest.mark.interpreter
def test_bf16_model_steps_through_the_interpreted_kernels(interpreter):
    """A bf16 model's decode steps hand the step kernels bf16 window q, k, v, sinks and alpha, and take
    y back in bf16, with no casts around them."""
    errors = interpreter.run("import torch, attention_kernel_check as c\n"
                             "result = c.check('cpu', torch.bfloat16, method='lizard-shared')", "bf16 model")
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
