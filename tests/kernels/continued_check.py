"""`lizard_attention_continued` against `gla_window_parallel` continuing from the same state.

`check(device, **case)` returns the relative errors of the output and of every new-state entry;
tests run it on CUDA directly and on CPU in a subprocess with TRITON_INTERPRET=1.
"""

import torch

from linearize.ops.gla_window import GlaWindowOptions, unsupported_reason
from linearize.ops.gla_window import naive as gla_window
from linearize.ops.gla_window.continued import lizard_attention_continued
from linearize.ops.gla_window.testing import Case, make_inputs


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12)).item()


def check(device: str, first: int = 37, then: int = 50, **case) -> dict:
    case = Case(L=first + then, **case)
    (fq, fk, log_g, qw, kw, v, sinks, alpha), _ = make_inputs(case, device)
    sinks = sinks if case.sinks else None
    opts = GlaWindowOptions(window=case.window, scale=case.D**-0.5, sinks=sinks, alpha=alpha, shared=case.shared)
    head, tail = slice(0, first), slice(first, None)
    valid = torch.ones(case.B, first, dtype=torch.bool, device=device)
    valid[1, :3] = False  # left padding in the earlier call: the carried window must mask it
    empty = gla_window.init_state(case.B, case.H, case.HKV, case.F, case.D, case.window, device=device)
    parts = [t.float() for t in (fq, fk, log_g, qw, kw, v)]
    _, state = gla_window.gla_window_parallel(*(t[:, :, head] for t in parts), valid, empty, opts)
    rest = [t[:, :, tail] for t in (fq, fk, log_g, qw, kw, v)]
    assert unsupported_reason(*rest, window=case.window, sinks=sinks) is None
    y, new_state = lizard_attention_continued(*rest, state, opts)
    all_valid = torch.ones(case.B, then, dtype=torch.bool, device=device)
    y_ref, ref_state = gla_window.gla_window_parallel(*(t[:, :, tail] for t in parts), all_valid, state, opts)
    errors = {"y": _rel(y, y_ref)}
    errors |= {name: _rel(new_state[name].float(), ref_state[name].float()) for name in ("S", "z", "win_k", "win_v")}
    errors["win_valid"] = float(not torch.equal(new_state["win_valid"], ref_state["win_valid"]))
    return errors
