"""A prefill continuing from a carried state through the kernel equals the reference op."""

import pytest
import torch
from continued_check import check
from interpreted import cases
from test_lizard_triton import HAS_TRITON

CASES = {
    "scalar-w32": {},
    "vector-w64-longer-than-call": {"gate": "vector", "window": 64},  # w - 1 > the call: old keys stay
    "bf16-nosinks": {"dtype": "torch.bfloat16", "sinks": 0},
    "shared-scalar-w32": {"shared": True},
    "shared-vector-w64-longer-than-call": {"gate": "vector", "window": 64, "shared": True},
    "bf16-shared": {"dtype": "torch.bfloat16", "shared": True},
}
TOLERANCE = {"torch.bfloat16": 2e-2}
FAST_CASES = ("scalar-w32",)


def _assert_close(name, errors):
    tol = TOLERANCE.get(CASES[name].get("dtype"), 1e-4)
    assert max(errors.values()) < tol, (name, errors)


@pytest.mark.parametrize("name", cases(CASES, FAST_CASES))
def test_continued_prefill_in_the_interpreter(name, interpreter):
    code = ("import torch\nfrom continued_check import check\nfrom test_continued import CASES\n"
            f"result = check('cpu', **{{k: eval(v) if k == 'dtype' else v for k, v in CASES[{name!r}].items()}})")
    _assert_close(name, interpreter.run(code, f"continued {name}"))


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs CUDA and triton")
@pytest.mark.parametrize("name", CASES)
def test_continued_prefill_on_cuda(name):
    case = {k: eval(v) if k == "dtype" else v for k, v in CASES[name].items()}
    _assert_close(name, check("cuda", first=300, then=700, **case))


_ROW_BLOCKS_SCRIPT = """
import torch
from linearize.ops.gla_window.testing import Case, make_inputs
from linearize.ops.gla_window import GlaWindowOptions
from linearize.ops.gla_window.triton import Config, lizard_attention_head
case = Case(L=70, gate="vector", F=64, D=64)
(fq, fk, log_g, qw, kw, v, sinks, alpha), _ = make_inputs(case, "cpu")
g = torch.Generator().manual_seed(1)
carried = torch.randn(2, 4, 64, 64, generator=g), torch.rand(2, 4, 64, generator=g)
options = GlaWindowOptions(window=32, scale=0.125, sinks=sinks, alpha=alpha)
runs = [lizard_attention_head(fq, fk, log_g, qw, kw, v, options, head=31, carried=carried,
                              config=Config(chunk=32, split=True, state_block_k=rows))
        for rows in (64, 16)]
whole, blocks = ([y, *parts, *end] for y, parts, end in runs)
result = [((a - b).norm() / a.norm()).item() for a, b in zip(whole, blocks)]
"""


@pytest.mark.interpreter
def test_state_row_blocks_continue_a_carried_state_as_one_block_does(interpreter):
    """The state passes split by feature rows start from the carried rows and return them at the end."""
    assert max(interpreter.run(_ROW_BLOCKS_SCRIPT, "state row blocks")) < 1e-6
