"""Lizard and Liger inside a model, fused kernel path vs the PyTorch ops: logits, gradients, decoding.

`check(device, ...)` and `check_padded(device, ...)` return how often a kernel path ran and the worst
relative errors; tests call them on CUDA directly and on CPU in a subprocess with TRITON_INTERPRET=1
(so the interpreter never leaks into the test process).
"""

import os
from contextlib import contextmanager

import torch
from tiny_models import perturb_new_parameters, tiny_teacher
from transformers import DynamicCache

import linearize
from linearize import kernels

# name: (method, options); "lizard-shared" is the variant with RoPE in the window and one shared normaliser.
STUDENTS = {"lizard": ("lizard", {"window": 8, "num_sinks": 2}), "liger": ("liger", {"window": 8}),
            "lizard-shared": ("lizard", {"window": 8, "num_sinks": 2, "rope_in_window": True, "combine": "shared"})}


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _student(method, device, dtype):
    model = tiny_teacher()
    name, options = STUDENTS[method]
    linearize.convert(model, name, **options)
    perturb_new_parameters(model)
    return model.to(device=device, dtype=dtype)


@contextmanager
def counting_kernel_calls(calls: list, steps: list):
    """Count the passes that take a kernel path (a first pass, or a continued prefill) and the decode
    steps that run on the step kernels."""
    first_pass, continued, step = kernels.lizard_attention, kernels.lizard_attention_continued, kernels.lizard_step
    kernels.lizard_attention = lambda *a, **k: calls.append(1) or first_pass(*a, **k)
    kernels.lizard_attention_continued = lambda *a, **k: calls.append(1) or continued(*a, **k)

    def counted_step(*a, **k):
        out = step(*a, **k)
        steps.extend([1] if out is not None else [])
        return out

    kernels.lizard_step = counted_step
    try:
        yield
    finally:
        kernels.lizard_attention, kernels.lizard_attention_continued, kernels.lizard_step = first_pass, continued, step


def _run(model, ids, kernels_on: bool):
    os.environ["LINEARIZE_KERNELS"] = "1" if kernels_on else "0"
    model.zero_grad()
    logits = model(ids, use_cache=False).logits
    logits.float().square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        cut = ids.shape[1] // 3  # a first prefill, a second one continuing the cache, then single steps
        first = model(ids[:, :cut], past_key_values=cache).logits
        second = model(ids[:, cut:-3], past_key_values=cache).logits
        steps = [model(ids[:, t : t + 1], past_key_values=cache).logits for t in range(ids.shape[1] - 3, ids.shape[1])]
    return logits.detach(), grads, torch.cat([first, second, *steps], 1)


def check(device: str, dtype=torch.float32, length: int = 37, method: str = "lizard") -> dict:
    model = _student(method, device, dtype)
    ids = torch.randint(3, 128, (2, length), generator=torch.Generator().manual_seed(0)).to(device)
    calls, steps = [], []
    with counting_kernel_calls(calls, steps):
        on = _run(model, ids, kernels_on=True)
    off = _run(model, ids, kernels_on=False)
    assert len(on[1]) == len(off[1])
    return {"kernel_calls": len(calls), "step_calls": len(steps), "logits": _rel(on[0], off[0]),
            "grads": max(_rel(a, b) for a, b in zip(on[1], off[1])), "cached": _rel(on[2], off[2])}


def check_padded(device: str, dtype=torch.float32, length: int = 37, pad: int = 5, method: str = "lizard") -> dict:
    """A left-padded batch (row 1 starts with `pad` padding tokens), uncached and cached, at the real tokens."""
    model = _student(method, device, dtype)
    ids = torch.randint(3, 128, (2, length), generator=torch.Generator().manual_seed(0)).to(device)
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0

    def run(kernels_on: bool):
        os.environ["LINEARIZE_KERNELS"] = "1" if kernels_on else "0"
        with torch.no_grad():
            full = model(ids, attention_mask=mask, use_cache=False).logits
            cache = DynamicCache(config=model.config)
            first = model(ids[:, :-3], attention_mask=mask[:, :-3], past_key_values=cache).logits
            steps = [model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], past_key_values=cache).logits
                     for t in range(length - 3, length)]
        return full, torch.cat([first, *steps], 1)

    calls, steps = [], []
    with counting_kernel_calls(calls, steps):
        on = run(kernels_on=True)
    off = run(kernels_on=False)
    real = mask.bool()
    return {"kernel_calls": len(calls), "step_calls": len(steps), "logits": _rel(on[0][real], off[0][real]),
            "cached": _rel(on[1][real], off[1][real])}


def check_static_decode(device: str, method: str = "lizard", steps: int = 6) -> dict:
    """`greedy_decode` (frozen cache, eager steps) with the step kernels vs the PyTorch ops: same tokens?"""
    from linearize.decode import greedy_decode

    model = _student(method, device, torch.float32)
    ids = torch.randint(3, 128, (2, 11), generator=torch.Generator().manual_seed(0)).to(device)
    tokens = {}
    for kernels_on in (True, False):
        os.environ["LINEARIZE_KERNELS"] = "1" if kernels_on else "0"
        calls, step_calls = [], []
        with counting_kernel_calls(calls, step_calls):
            tokens[kernels_on] = greedy_decode(model, ids, steps, cuda_graph=False)
        if kernels_on:
            counted = len(step_calls)
    return {"same_tokens": torch.equal(tokens[True], tokens[False]), "step_calls": counted}

