"""The STILL kernels equal the reference op (`still_parallel(fresh=True, keep_state=False)`), in the
output and the gradients of q, k, v, both feature maps' outputs and the gate; and a STILL model run
through them gives the PyTorch path's (backend "torch") logits, gradients, cached state and greedy
tokens. A call continuing a filled state through them equals `still_parallel(fresh=False)` (y and the
state after); a fresh call split into kernel blocks equals one pass; a tiny model's prompt prefilled
in pieces gives the one call's logits.

Without a GPU they run in Triton's interpreter, in a worker subprocess (interpreted.py), one test a case."""

import pytest
import torch
from attention_kernel_check import check_still
from interpreted import cases
from test_lizard_triton import HAS_TRITON

from linearize.ops.gla_window.testing import within_tolerance
from linearize.ops.still.testing import StillCase, compare_continued, compare_still

bf16 = torch.bfloat16

# Several 64-token tiles, salient slots that overflow, left padding, GQA and MHA, each routing rule.
INTERPRETER_CASES = {
    "L100-gqa-gate": StillCase(L=100),
    "L100-gqa-gate-bf16": StillCase(L=100, dtype=bf16),
    "L130-mha-nogate-d64": StillCase(L=130, HKV=4, D=64, F=64, gate=False),
    "L70-random-pad10": StillCase(L=70, routing="random", pad=10),
    "L40-recency": StillCase(L=40, routing="recency"),
    "L3-nopad": StillCase(L=3, pad=0),
    # Gemma's head dim: 16 x 16 tiles, 16-bit only.
    "L40-d256-f256-bf16": StillCase(L=40, H=2, HKV=1, D=256, F=256, dtype=bf16),
}
GPU_CASES = {
    **INTERPRETER_CASES,
    "L600-w128-c64-bf16": StillCase(L=600, D=64, F=64, window=128, chunk=64, per_chunk=12, slots=96, dtype=bf16),
    "L1100-w128-c64-slots768": StillCase(L=1100, H=8, HKV=2, D=64, F=64, window=128, chunk=64, per_chunk=48,
                                         slots=768, pad=37),
    "L300-d128-bf16": StillCase(L=300, H=4, HKV=1, D=128, F=128, window=64, chunk=64, per_chunk=8, slots=64,
                                dtype=bf16),
    # The wide forward tiles (`forward_launch`): 16-bit, head dim 128, 64 features (L300-d128-bf16: 128).
    "L700-d128-f64-bf16": StillCase(L=700, H=8, HKV=2, D=128, F=64, window=128, chunk=64, per_chunk=16, slots=128,
                                    dtype=bf16),
    "L500-d256-f256-bf16": StillCase(L=500, H=4, HKV=1, D=256, F=256, window=128, chunk=64, per_chunk=8, slots=128,
                                     dtype=bf16),
}

FAST_CASES = ("L100-gqa-gate",)

# A fresh call over `prefix` tokens fills the state, the case's L tokens continue it. Slots overflow
# in both calls (evictions inside the continued one) unless said otherwise; row 1 is left-padded.
CONTINUED_CASES = {
    "L100-after50-gqa-gate": StillCase(L=100, prefix=50),
    "L100-after50-gqa-gate-bf16": StillCase(L=100, prefix=50, dtype=bf16),
    "L130-after40-mha-nogate-d64": StillCase(L=130, prefix=40, HKV=4, D=64, F=64, gate=False),
    "L70-after5-pad12": StillCase(L=70, prefix=5, pad=12),  # padding on both sides of the cut
    "L30-after20-slots64": StillCase(L=30, prefix=20, slots=64),  # the slots hold every pick: no eviction
    "L70-after33-random-pad10": StillCase(L=70, prefix=33, routing="random", pad=10),
    "L40-after17-recency-nogate": StillCase(L=40, prefix=17, routing="recency", gate=False),
    "L3-after9-nopad": StillCase(L=3, prefix=9, pad=0),
    "L40-after20-d256-f256-bf16": StillCase(L=40, prefix=20, H=2, HKV=1, D=256, F=256, dtype=bf16),
}
FAST_CONTINUED = ("L100-after50-gqa-gate",)


def _check(case: StillCase, out: dict):
    assert out["path"] == "kernel", out["path"]
    assert within_tolerance(case, out["errors"]), out["errors"]


@pytest.mark.parametrize("name", cases(INTERPRETER_CASES, FAST_CASES))
def test_interpreter(name, interpreter):
    code = ("from linearize.ops.still.testing import compare_still\nfrom test_still_triton import INTERPRETER_CASES\n"
            f"result = compare_still(INTERPRETER_CASES[{name!r}], 'cpu')")
    _check(INTERPRETER_CASES[name], interpreter.run(code, f"still {name}"))


def _check_continued(case: StillCase, out: dict):
    assert out["path"] == "kernel" and out["calls"] == 1, out
    assert out["y"] < (1e-2 if case.dtype == bf16 else 1e-5), out
    assert out["dtype"] == str(case.dtype), out
    # The routing and the state run in float32 PyTorch either way: the same state, up to rounding.
    assert out["state_names"] and out["state_exact"] and out["state"] < 1e-6, out


@pytest.mark.parametrize("name", cases(CONTINUED_CASES, FAST_CONTINUED))
def test_continued_call_interpreter(name, interpreter):
    code = ("from linearize.ops.still.testing import compare_continued\n"
            "from test_still_triton import CONTINUED_CASES\n"
            f"result = compare_continued(CONTINUED_CASES[{name!r}], 'cpu')")
    _check_continued(CONTINUED_CASES[name], interpreter.run(code, f"still continued {name}"))


def test_a_continued_call_needing_gradients_takes_the_reference(interpreter):
    """The kernels' continued form has no backward: with a gradient wanted, `still` runs the reference."""
    code = ("from linearize.ops.still.testing import compare_continued\n"
            "from test_still_triton import CONTINUED_CASES\n"
            "result = compare_continued(CONTINUED_CASES['L100-after50-gqa-gate'], 'cpu', requires_grad=True)")
    out = interpreter.run(code, "still continued with gradients")
    assert out["calls"] == 0 and out["differentiable"] and out["y"] < 1e-6, out
    assert out["state_names"] and out["state_exact"] and out["state"] < 1e-6, out


@pytest.mark.interpreter
@pytest.mark.parametrize("rows, columns", [(32, 16), (16, 32)])
def test_the_forward_kernels_tiles_do_not_change_its_values(rows, columns, interpreter):
    """`forward_launch` with more queries a program than keys a step, and fewer: a fresh pass (values and
    gradients) and a continued call equal the reference as with the kernel's own tiles."""
    # The worker serves later cases too: the kernel's own tiles come back whatever happens.
    code = ("import linearize.ops.still.triton as kernels\n"
            "from linearize.ops.still.testing import compare_continued, compare_still\n"
            "from test_still_triton import CONTINUED_CASES, INTERPRETER_CASES\n"
            "own = kernels.forward_launch\n"
            f"kernels.forward_launch = lambda dtype, D, F, device=None, **_: {{'BM': {rows}, 'BN': {columns}, 'num_warps': 4, "
            "'num_stages': 2}\n"
            "try:\n"
            "    result = {'fresh': compare_still(INTERPRETER_CASES['L100-gqa-gate'], 'cpu'),\n"
            "              'continued': compare_continued(CONTINUED_CASES['L100-after50-gqa-gate'], 'cpu')}\n"
            "finally:\n"
            "    kernels.forward_launch = own")
    out = interpreter.run(code, f"still tiles {rows}x{columns}")
    _check(INTERPRETER_CASES["L100-gqa-gate"], out["fresh"])
    _check_continued(CONTINUED_CASES["L100-after50-gqa-gate"], out["continued"])


@pytest.mark.parametrize("name, block", [pytest.param("L130-gqa-gate", 48, marks=pytest.mark.interpreter),
                                         ("L100-mha-nogate-pad10", 64)])
def test_a_long_fresh_call_in_kernel_blocks_equals_one_pass(name, block, interpreter):
    """KERNEL_BLOCK made tiny (the chunked kernel set aside, which takes fresh calls whole): the first
    block fresh, the others continued, against one `still_parallel` pass and against the one-call
    kernel pass (y and the state after)."""
    case = {"L130-gqa-gate": "StillCase(L=130)", "L100-mha-nogate-pad10": "StillCase(L=100, HKV=4, gate=False, pad=10)"}
    code = ("from linearize.ops.still.testing import StillCase, compare_blocks\n"
            f"result = compare_blocks({case[name]}, {block}, 'cpu')")
    out = interpreter.run(code, f"still blocks {name}")
    L = 130 if name == "L130-gqa-gate" else 100
    assert out["fresh_calls"] == 1 and out["calls"] == -(-L // block) - 1, out
    assert out["y"] < 1e-5 and out["y_old"] < 1e-5 and out["y_scored"] < 1e-5 and not out["scored_state"], out
    assert out["state_names"] and out["state_exact"] and out["state"] < 1e-5 and out["state_old"] < 1e-5, out


@pytest.mark.interpreter
def test_still_model_prefilled_in_pieces_through_the_kernels_gives_one_calls_logits(interpreter):
    """Calls of 7 tokens continuing the cache (row 1's first one all padding), and one call in kernel
    blocks of 16: the logits and the state of one call."""
    out = interpreter.run("import attention_kernel_check as c\nresult = c.check_still_pieces('cpu')",
                          "still model in pieces")
    assert out["piece_calls"] == 10 and out["block_calls"] == 4, out  # two layers: 5 and 2 continued calls each
    assert out["pieces"] < 1e-5 and out["blocked"] < 1e-5, out
    assert out["state_names"] and out["state_exact"] and out["state"] < 1e-5, out


@pytest.mark.interpreter
def test_still_model_through_the_interpreted_kernels_equals_the_pytorch_path(interpreter):
    """Training and scoring passes; then a cached prefill, whose state (slots, window, linear state)
    the routing builds beside the kernel, and greedy decoding from it."""
    out = interpreter.run("import attention_kernel_check as c\nresult = c.check_still('cpu')", "still model")
    # One fresh pass per layer: with gradients the one-pass kernel, without (scoring) the chunked one.
    assert out["calls"] == 2 and out["chunk_calls"] == 2 and out["same_params"], out
    assert out["logits"] < 1e-5 and out["scored"] < 1e-5 and out["grads"] < 1e-4, out
    # Two prefills (a forward, then generate's), two layers, through the chunked kernel.
    assert out["prefill_calls"] == 4 and out["prefill_chunk_calls"] == 4, out
    assert out["state_names"] and out["state_exact"] and out["state"] < 1e-5 and out["prefill_logits"] < 1e-5, out
    assert out["same_tokens"], out


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs CUDA and triton")
@pytest.mark.parametrize("name", GPU_CASES)
def test_gpu(name):
    _check(GPU_CASES[name], compare_still(GPU_CASES[name], "cuda"))


GPU_CONTINUED_CASES = {
    **CONTINUED_CASES,
    "L1100-after900-w128-c64-slots768": StillCase(L=1100, prefix=900, H=8, HKV=2, D=64, F=64, window=128, chunk=64,
                                                  per_chunk=48, slots=768, pad=37),
    "L300-after200-d128-bf16": StillCase(L=300, prefix=200, H=4, HKV=1, D=128, F=128, window=64, chunk=64,
                                         per_chunk=8, slots=64, dtype=bf16),
}


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs CUDA and triton")
@pytest.mark.parametrize("name", GPU_CONTINUED_CASES)
def test_continued_call_gpu(name):
    _check_continued(GPU_CONTINUED_CASES[name], compare_continued(GPU_CONTINUED_CASES[name], "cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs CUDA and triton")
@pytest.mark.parametrize("dtype", [torch.float32, bf16])
def test_still_model_through_the_kernels_on_cuda_equals_the_pytorch_path(dtype):
    """As the interpreter's test, on 300 tokens: several tiles, and slots that overflow. In bf16 both
    paths round differently (the PyTorch path is no reference there): logits and state within 2e-2, and
    the greedy tokens are compared in float32 only (bf16 rounding may flip a near-tie)."""
    out = check_still("cuda", dtype, length=300)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert out["calls"] == 2 and out["chunk_calls"] == 2 and out["same_params"], out
    assert out["prefill_calls"] == 4 and out["prefill_chunk_calls"] == 4, out
    assert out["logits"] < tol and out["scored"] < tol and (dtype == bf16 or out["grads"] < tol), out
    assert out["state_names"] and out["state_exact"] and out["state"] < tol and out["prefill_logits"] < tol, out
    assert out["same_tokens"] or dtype == bf16, out


def test_the_forward_takes_wide_tiles_only_where_they_were_measured_and_fit(monkeypatch):
    """16-bit, head dim 128, at most 128 features, on a GPU with the shared memory they need at that many
    features, and not a gated pass saving the backward's parts (which spills at those tiles): the wide
    tiles; square ones otherwise."""
    from types import SimpleNamespace

    from linearize.ops.still import triton as kernels

    shared = {"memory": 232_448}  # an H100's or H200's opt-in shared memory a block
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(shared_memory_per_block_optin=shared["memory"]))
    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    wide = kernels.WIDE_FORWARD
    assert kernels.forward_launch(bf16, 128, 64, gpu, gate=True) == wide  # a gated prefill
    assert kernels.forward_launch(torch.float16, 128, 32, gpu, save=True) == wide  # a continued call's parts
    square = {"num_warps": 4, "num_stages": 3}
    assert kernels.forward_launch(bf16, 128, 64, gpu, gate=True, save=True) == {"BM": 32, "BN": 32, **square}
    assert kernels.forward_launch(torch.float32, 128, 64, gpu) == {"BM": 16, "BN": 16, **square}
    assert kernels.forward_launch(bf16, 64, 64, gpu) == {"BM": 64, "BN": 64, **square}
    assert kernels.forward_launch(bf16, 128, 128, gpu, gate=True) == wide  # the Llama-3-8B shape's features
    assert kernels.forward_launch(bf16, 128, 256, gpu) == {"BM": 16, "BN": 16, **square}
    assert kernels.forward_launch(bf16, 128, 64, cpu) == {"BM": 32, "BN": 32, **square}
    shared["memory"] = 150_000  # room for the wide tiles at 64 features, not at 128
    assert kernels.forward_launch(bf16, 128, 64, gpu) == wide
    assert kernels.forward_launch(bf16, 128, 128, gpu) == {"BM": 32, "BN": 32, **square}
    shared["memory"] = 101_376  # a consumer GPU's
    assert kernels.forward_launch(bf16, 128, 64, gpu) == {"BM": 32, "BN": 32, **square}


def test_head_dim_256_takes_the_kernels_in_16_bits_only(monkeypatch):
    """Gemma's 256-wide heads: in float32 every kernel spills registers on sm_90, so those calls keep
    the PyTorch form; the reason says so."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from linearize.ops.still.triton import supports

    q, k = torch.zeros(1, 2, 8, 256), torch.zeros(1, 1, 8, 256)
    assert supports(q, k, 256, torch.bfloat16) is None
    assert supports(q.bfloat16(), k.bfloat16(), 256) is None
    assert supports(q, k, 256) == "head dim 256 needs 16-bit operands, not torch.float32"
    assert supports(q[..., :128], k[..., :128], 256) == "feature dim 256 needs 16-bit operands, not torch.float32"
    assert supports(torch.zeros(1, 2, 8, 512), torch.zeros(1, 1, 8, 512), 64, torch.bfloat16) == (
        "head dim 512 not in 16/32/64/128/256")
