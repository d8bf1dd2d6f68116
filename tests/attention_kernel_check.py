"""Lizard, Liger and STILL inside a model, fused kernel path vs the PyTorch ops: logits, gradients, decoding.

`check(device, ...)`, `check_padded(device, ...)` and `check_still(device, ...)` return how often a
kernel path ran and the worst relative errors; tests call them on CUDA directly and on CPU in a subprocess with TRITON_INTERPRET=1
(so the interpreter never leaks into the test process).
"""

import copy
import dataclasses
from contextlib import contextmanager

import torch
from tiny_models import perturb_new_parameters, tiny_teacher
from transformers import DynamicCache

import linearize
from linearize.ops import backend, features
from linearize.ops import gla_window as kernels

# name: (method, options); "lizard-shared" is the variant with RoPE in the window and one shared normaliser.
STUDENTS = {"lizard": ("lizard", {"window": 8, "num_sinks": 2}), "liger": ("liger", {"window": 8}),
            "lizard-shared": ("lizard", {"window": 8, "num_sinks": 2, "rope_in_window": True, "combine": "shared",
                                         "feature_dim": 16})}


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# lizard-shared's 32 features need a head dim of 32 for its bf16 passes to take the kernels on a GPU
# (`lizard_triton.miscompiled_on_gpu`): 4 heads of 32.
TEACHERS = {"lizard-shared": {"hidden_size": 128}}


def _student(method, device, dtype):
    model = tiny_teacher(**TEACHERS.get(method, {}))
    name, options = STUDENTS[method]
    linearize.convert(model, name, **options)
    perturb_new_parameters(model)
    return model.to(device=device, dtype=dtype)


@contextmanager
def counting_kernel_calls(calls: list, steps: list, layout_reads: list | None = None,
                          feature_passes: list | None = None):
    """Count the passes that take a kernel path (a first pass, or a continued prefill), the decode
    steps that run on the step kernels and the padding layouts read back from the device; list the
    lengths of the passes whose features come from the features kernel ("grad" for one with
    gradients)."""
    feature_passes = [] if feature_passes is None else feature_passes

    def count(form, impl, call):
        if impl.startswith("triton"):
            if form == "gla_window_step":
                steps.append(1)
            elif form == "lizard_features":
                feature_passes.append("grad" if impl == "triton-differentiable" else call.q.shape[2])
            else:
                calls.append(1)

    layout = kernels.row_layout
    forms = {(kernels, "CHUNK"): kernels.CHUNK, (kernels, "CONTINUE"): kernels.CONTINUE, (kernels, "STEP"): kernels.STEP,
             (features, "FEATURES"): features.FEATURES}
    kernels.row_layout = lambda *a: (layout_reads.append(1) if layout_reads is not None else None) or layout(*a)
    for (module, name), form in forms.items():
        setattr(module, name, counted(form, count))
    try:
        yield
    finally:
        kernels.row_layout = layout
        for (module, name), form in forms.items():
            setattr(module, name, form)


def counted(form: backend.Form, count) -> backend.Form:
    """`form` calling `count(form name, implementation name, call)` before each implementation runs."""
    def run(impl):
        return lambda call: count(form.name, impl.name, call) or impl.run(call)

    return backend.Form(form.name, tuple(dataclasses.replace(impl, run=run(impl)) for impl in form.implementations))


def _run(model, ids, kernels_on: bool):
    backend.set_backend("auto" if kernels_on else "torch")
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
    """The kernel path against the PyTorch ops: relative errors of the logits, gradients and cached
    pass (and the counts of kernel passes and steps).

    In float32, "grads" is the worst parameter's error between the two paths. In 16 bits both paths
    round, and the gradients of a head's few scalars (gate bias, alpha, sinks) are sums over every
    token whose terms cancel (by 10-100x), which magnifies that rounding. So each path is measured
    against float32 PyTorch ops on the same rounded weights. "grads" is then how far the kernel's
    error exceeds four times the PyTorch path's own, at the worst parameter. "all grads" is the
    kernel's error over all gradients together.
    """
    model = _student(method, device, dtype)
    ids = torch.randint(3, 128, (2, length), generator=torch.Generator().manual_seed(0)).to(device)
    calls, steps, layout_reads, feature_passes = [], [], [], []
    with counting_kernel_calls(calls, steps, layout_reads, feature_passes):
        on = _run(model, ids, kernels_on=True)
    off = _run(model, ids, kernels_on=False)
    assert len(on[1]) == len(off[1])
    # No attention mask: every pass knows its rows are unpadded without a device read (a host sync).
    assert not layout_reads, f"{len(layout_reads)} padding layouts read back from the device"
    # Lizard takes its features from one kernel too: every step, and the training pass and prefills
    # where the dims fit its tensor-core tiles (F >= 16). Liger's feature map has no weights.
    lizard = method.startswith("lizard")
    blocks = lizard and model.model.layers[0].self_attn.features >= 32
    layers = len(model.model.layers)
    assert feature_passes.count(1) == (len(steps) if lizard else 0), (feature_passes, len(steps))
    assert feature_passes.count("grad") == (layers if blocks else 0), feature_passes
    assert sum(n != "grad" and n > 1 for n in feature_passes) == (2 * layers if blocks else 0)
    errors = {"kernel_calls": len(calls), "step_calls": len(steps), "logits": _rel(on[0], off[0]),
              "cached": _rel(on[2], off[2])}
    if dtype == torch.float32:
        return errors | {"grads": max(_rel(a, b) for a, b in zip(on[1], off[1]))}
    reference = _run(copy.deepcopy(model).float(), ids, kernels_on=False)[1]
    excess = [_rel(k, r) - 4 * _rel(p, r) for k, p, r in zip(on[1], off[1], reference)]
    return errors | {"grads": max(0.0, *excess),
                     "all grads": _rel(torch.cat([g.flatten() for g in on[1]]),
                                       torch.cat([g.flatten() for g in reference]))}


@contextmanager
def counting_launches(names: tuple[str, ...], launches: list):
    """Record each launch of the named Triton kernels of `lizard_triton` (launched as kernel[grid](...))."""
    from linearize.ops.gla_window import triton as lizard_triton

    class Counted:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            launches.append(self.name)
            return self.kernel[grid]

    originals = {name: getattr(lizard_triton, name) for name in names}
    for name, kernel in originals.items():
        setattr(lizard_triton, name, Counted(name, kernel))
    try:
        yield
    finally:
        for name, kernel in originals.items():
            setattr(lizard_triton, name, kernel)


def check_stage1(device: str, method: str = "lizard-shared", length: int = 37) -> dict:
    """Stage 1 (attention transfer, float32) through the kernels vs the PyTorch ops: relative errors of
    the loss and of the new parameters' gradients, the kernel passes, and the launches of the backward
    passes that only q, k and v's gradients need (none: they are frozen in stage 1)."""
    from linearize.train import DistillConfig
    from linearize.train.losses import stage_loss
    from linearize.train.student import prepare_stage

    model = _student(method, device, torch.float32)
    cfg = DistillConfig(model="tiny", method=STUDENTS[method][0], data="default", out="unused")
    model, _ = prepare_stage(model, cfg, 1)
    params = [p for p in model.parameters() if p.requires_grad]
    ids = torch.randint(3, 128, (2, length), generator=torch.Generator().manual_seed(0)).to(device)

    def run(kernels_on: bool) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        backend.set_backend("auto" if kernels_on else "torch")
        model.zero_grad()
        loss = stage_loss(model, ids, 1)
        loss.backward()
        # None where a parameter takes no part (alpha under the shared normaliser), on both paths.
        return loss.detach(), {i: p.grad.clone() for i, p in enumerate(params) if p.grad is not None}

    calls, launches = [], []
    with counting_kernel_calls(calls, []), counting_launches(("_bwd_window_dkv_kernel", "_bwd_dv_kernel"), launches):
        on = run(kernels_on=True)
    off = run(kernels_on=False)
    assert on[1].keys() == off[1].keys()
    return {"kernel_calls": len(calls), "frozen_input_launches": len(launches), "loss": _rel(on[0], off[0]),
            "grads": max(_rel(on[1][i], off[1][i]) for i in on[1])}


def check_padded(device: str, dtype=torch.float32, length: int = 37, pad: int = 5, method: str = "lizard") -> dict:
    """A left-padded batch (row 1 starts with `pad` padding tokens), uncached and cached, at the real tokens."""
    model = _student(method, device, dtype)
    ids = torch.randint(3, 128, (2, length), generator=torch.Generator().manual_seed(0)).to(device)
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0

    def run(kernels_on: bool):
        backend.set_backend("auto" if kernels_on else "torch")
        with torch.no_grad():
            full = model(ids, attention_mask=mask, use_cache=False).logits
            cache = DynamicCache(config=model.config)
            first = model(ids[:, :-3], attention_mask=mask[:, :-3], past_key_values=cache).logits
            steps = [model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], past_key_values=cache).logits
                     for t in range(length - 3, length)]
        return full, torch.cat([first, *steps], 1)

    calls, steps, layout_reads = [], [], []
    with counting_kernel_calls(calls, steps, layout_reads):
        on = run(kernels_on=True)
    off = run(kernels_on=False)
    assert layout_reads, "a padded batch's layout must be read from its mask"
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
        backend.set_backend("auto" if kernels_on else "torch")
        calls, step_calls = [], []
        with counting_kernel_calls(calls, step_calls):
            tokens[kernels_on] = greedy_decode(model, ids, steps, cuda_graph=False)
        if kernels_on:
            counted = len(step_calls)
    return {"same_tokens": torch.equal(tokens[True], tokens[False]), "step_calls": counted}



def check_still(device, dtype=torch.float32, length=45):
    """A STILL model through its kernels against its PyTorch path (relative errors, counts and flags):
    a training pass's logits and gradients, a scoring pass, then a cached prefill's logits and state
    (slots, window and linear state) and greedy tokens decoded from it. Left padding in row 1."""
    from tiny_models import TINY_OPTIONS

    calls, chunk_calls = [], []
    from linearize.ops.still import chunk_triton
    from linearize.ops.still import triton as still_kernels

    counted, chunk_counted = still_kernels.still_attention_triton, chunk_triton.still_chunk_triton
    still_kernels.still_attention_triton = lambda *a, **k: calls.append(1) or counted(*a, **k)
    chunk_triton.still_chunk_triton = lambda *a, **k: chunk_calls.append(1) or chunk_counted(*a, **k)
    try:
        model = tiny_teacher()
        linearize.convert(model, "still", **TINY_OPTIONS["still"])
        perturb_new_parameters(model)
        model.to(device=device, dtype=dtype)
        ids = torch.randint(3, 128, (2, length), generator=torch.Generator().manual_seed(0)).to(device)
        mask = torch.ones_like(ids)
        mask[1, :6] = 0

        def train_pass(on):
            backend.set_backend("auto" if on else "torch")
            model.zero_grad()
            logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
            (logits.float() * torch.linspace(-1, 1, logits.shape[-1], device=device)).sum().backward()
            return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

        def prefill_and_decode(on):
            backend.set_backend("auto" if on else "torch")
            with torch.no_grad():
                first = model(input_ids=ids, attention_mask=mask, use_cache=True)
                tokens = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
            return first.logits, [layer.state for layer in first.past_key_values.layers], tokens

        ref_logits, ref_grads = train_pass(False)
        logits, grads = train_pass(True)
        with torch.no_grad():  # scoring, kernels on: the forward kernel's variant that saves nothing
            scored = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        out = {"calls": len(calls), "chunk_calls": len(chunk_calls), "logits": _rel(logits, ref_logits), "scored": _rel(scored, ref_logits),
               "same_params": sorted(grads) == sorted(ref_grads),
               "grads": max(_rel(grads[n], ref_grads[n]) for n in ref_grads)}
        before = len(calls) + len(chunk_calls)
        ref_first, ref_states, ref_tokens = prefill_and_decode(False)
        first, states, tokens = prefill_and_decode(True)
    finally:
        still_kernels.still_attention_triton = counted
        chunk_triton.still_chunk_triton = chunk_counted
    pairs = [(s[n], r[n]) for s, r in zip(states, ref_states, strict=True) for n in r]
    return out | {"prefill_calls": len(calls) + len(chunk_calls) - before,
                  "prefill_chunk_calls": len(chunk_calls) - out["chunk_calls"], "prefill_logits": _rel(first, ref_first),
                  "state_names": all(sorted(s) == sorted(r) for s, r in zip(states, ref_states, strict=True)),
                  "state": max(_rel(a, b) for a, b in pairs if b.is_floating_point() and b.norm() > 0),
                  "state_exact": all(torch.equal(a, b) for a, b in pairs if not b.is_floating_point()),
                  "same_tokens": torch.equal(tokens, ref_tokens)}


def check_still_pieces(device="cpu", length=40, piece=7, block=16):
    """A tiny STILL model under the default backend, without gradients: one cached call over a
    left-padded prompt against the same prompt in calls of `piece` tokens, each continuing the cache
    (logits, and the state after), and against one call with KERNEL_BLOCK = `block` (the chunked
    kernel set aside, so the fresh call goes in kernel blocks). Relative errors and the kernel calls
    each way ran."""
    from tiny_models import TINY_OPTIONS

    from linearize.ops import still as dispatch
    from linearize.ops.still.testing import counting_parts, state_errors, without_chunk_kernel

    model = tiny_teacher()
    linearize.convert(model, "still", **TINY_OPTIONS["still"])
    perturb_new_parameters(model)
    model.to(device)
    ids = torch.randint(3, 128, (2, length), generator=torch.Generator().manual_seed(0)).to(device)
    mask = torch.ones_like(ids)
    mask[1, :9] = 0  # row 1's first piece is all padding

    def run(step):
        cache = DynamicCache(config=model.config)
        logits = [model(input_ids=ids[:, lo : lo + step], attention_mask=mask[:, : lo + step], past_key_values=cache,
                        use_cache=True).logits for lo in range(0, length, step)]
        return torch.cat(logits, 1), [layer.state for layer in cache.layers]

    calls = []
    kept = dispatch.KERNEL_BLOCK
    with torch.no_grad():
        one, one_states = run(length)
        with counting_parts(calls):
            pieces, states = run(piece)
            piece_calls = len(calls)
            dispatch.KERNEL_BLOCK = block
            try:
                with without_chunk_kernel():
                    blocked, blocked_states = run(length)
            finally:
                dispatch.KERNEL_BLOCK = kept
    pairs = [(s, r) for s, r in zip(states, one_states, strict=True)] + list(zip(blocked_states, one_states,
                                                                                   strict=True))
    errors = [state_errors(s, r) for s, r in pairs]
    return {"piece_calls": piece_calls, "block_calls": len(calls) - piece_calls, "pieces": _rel(pieces, one),
            "blocked": _rel(blocked, one), "state_names": all(e["state_names"] for e in errors),
            "state_exact": all(e["state_exact"] for e in errors), "state": max(e["state"] for e in errors)}
