"""Lizard attention inside a model, fused kernel path vs the PyTorch ops: logits, gradients, decoding.

`check(device, dtype)` returns how often the fused path ran and the worst relative errors; tests call it on CUDA directly and on CPU in a
subprocess with TRITON_INTERPRET=1 (so the interpreter never leaks into the test process).
"""

import os

import torch
from tiny_models import perturb_new_parameters, tiny_teacher
from transformers import DynamicCache

import linearize
from linearize.attention.lizard import LizardAttention


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _run(model, ids, kernels: bool):
    os.environ["LINEARIZE_KERNELS"] = "1" if kernels else "0"
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


def check(device: str, dtype=torch.float32, length: int = 37) -> dict:
    model = tiny_teacher()
    linearize.convert(model, "lizard", window=8, num_sinks=2)
    perturb_new_parameters(model)
    model.to(device=device, dtype=dtype)
    ids = torch.randint(3, 128, (2, length), generator=torch.Generator().manual_seed(0)).to(device)
    calls = []
    fused_path = LizardAttention._fused
    LizardAttention._fused = lambda self, *args: calls.append(1) or fused_path(self, *args)
    try:
        fused = _run(model, ids, kernels=True)
    finally:
        LizardAttention._fused = fused_path
    plain = _run(model, ids, kernels=False)
    assert len(fused[1]) == len(plain[1])
    return {"fused_calls": len(calls), "logits": _rel(fused[0], plain[0]),
            "grads": max(_rel(a, b) for a, b in zip(fused[1], plain[1])),
            "cached": _rel(fused[2], plain[2])}


def check_padded(device: str, dtype=torch.float32, length: int = 37, pad: int = 5) -> dict:
    """A left-padded batch (row 1 starts with `pad` padding tokens), uncached and cached, at the real tokens."""
    model = tiny_teacher()
    linearize.convert(model, "lizard", window=8, num_sinks=2)
    perturb_new_parameters(model)
    model.to(device=device, dtype=dtype)
    ids = torch.randint(3, 128, (2, length), generator=torch.Generator().manual_seed(0)).to(device)
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0

    def run(kernels: bool):
        os.environ["LINEARIZE_KERNELS"] = "1" if kernels else "0"
        with torch.no_grad():
            full = model(ids, attention_mask=mask, use_cache=False).logits
            cache = DynamicCache(config=model.config)
            first = model(ids[:, :-3], attention_mask=mask[:, :-3], past_key_values=cache).logits
            steps = [model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], past_key_values=cache).logits
                     for t in range(length - 3, length)]
        return full, torch.cat([first, *steps], 1)

    calls = []
    fused_path = LizardAttention._fused
    LizardAttention._fused = lambda self, *args: calls.append(1) or fused_path(self, *args)
    try:
        fused = run(kernels=True)
    finally:
        LizardAttention._fused = fused_path
    plain = run(kernels=False)
    real = mask.bool()
    return {"fused_calls": len(calls), "logits": _rel(fused[0][real], plain[0][real]),
            "cached": _rel(fused[1][real], plain[1][real])}
