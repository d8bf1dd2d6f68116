"""The features kernel equals `HedgehogFeatureMap` and `rotate`: phi(q), phi(k) per query head, the window's q, k."""

import pytest
import torch
from interpreted import cases
from test_lizard_triton import HAS_TRITON

from linearize.attention.base import rotate
from linearize.feature_maps import HedgehogFeatureMap
from linearize.ops.common import repeat_kv

CASES = {
    "step-gqa-rope": {"L": 1},
    "step-mha-one-position-bf16-weights": {"L": 1, "HKV": 4, "cos_batch": 1, "weight_dtype": torch.bfloat16},
    "step-no-rope-F8": {"L": 1, "F": 8, "rope": False},
    "prefill-L37-gqa-rope-projection-strides": {"L": 37},
    "prefill-L150-gqa-rope-three-blocks": {"L": 150},
    "prefill-L16-gqa4-D64-F32-one-position": {"L": 16, "H": 8, "HKV": 2, "D": 64, "F": 32, "cos_batch": 1},
    "prefill-L50-no-rope-bf16-weights": {"L": 50, "rope": False, "weight_dtype": torch.bfloat16},
    "prefill-L37-bf16-in-and-out": {"L": 37, "dtype": torch.bfloat16},
    "prefill-L20-no-rope-bf16-in-and-out": {"L": 20, "rope": False, "dtype": torch.bfloat16},
    "step-bf16-in-float32-out": {"L": 1, "dtype": torch.bfloat16, "out_dtype": torch.float32},
    "prefill-L70-bf16-in-weights-and-out": {"L": 70, "dtype": torch.bfloat16, "weight_dtype": torch.bfloat16},
}


def _inputs(device, seed, L, B, H, HKV, D, F, rope, cos_batch, weight_dtype=torch.float32, dtype=torch.float32):
    """(randn, two feature maps with weights perturbed from the identity, q [B, L, H, D] and k
    [B, L, H_kv, D] as the projections lay them out, (cos, sin) [cos_batch or B, L, D] or None)."""
    g = torch.Generator(device=device).manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g, device=device)
    maps = [HedgehogFeatureMap(H, D, F).to(device) for _ in range(2)]
    for m in maps:
        m.weight.data = (m.weight.data + 0.3 * r(H, D, F)).to(weight_dtype)
    q, k = (2 * r(B, L, n, D).to(dtype) for n in (H, HKV))
    angles = torch.cat([r(cos_batch or B, L, D // 2) * 30] * 2, -1)
    return r, maps, q, k, (angles.cos(), angles.sin()) if rope else None


def errors(device, L, B=2, H=4, HKV=2, D=16, F=16, rope=True, cos_batch=None, weight_dtype=torch.float32,
           dtype=torch.float32, out_dtype=None, block=None, programs=None) -> dict:
    """Max abs errors of the kernel's outputs. q and k are transposed views of [B, L, heads, D], as the
    attention module's projections give them, in `dtype`; the outputs are in `out_dtype` (default
    `dtype`), against the float32 references rounded to it. `cos_batch=1`: one row of positions for the
    whole batch. `block`, `programs`: tokens a block and programs a head of a prefill (None: the defaults)."""
    from linearize.ops.features.triton import lizard_features

    _, maps, q, k, position = _inputs(device, 0, L, B, H, HKV, D, F, rope, cos_batch, weight_dtype, dtype)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    out_dtype = out_dtype or dtype
    fq, fk, qw, kw = lizard_features(q, k, maps[0].weight, maps[1].weight, position, out_dtype, block=block,
                                     programs=programs)
    q, k = q.float(), k.float()
    qw_ref, kw_ref = rotate(q, k, position) if rope else (q, k)
    pairs = {"fq": (fq, maps[0](q)), "fk": (fk, maps[1](repeat_kv(k, H // HKV))), "qw": (qw, qw_ref),
             "kw": (kw, kw_ref)}
    out = {}
    for name, (got, ref) in pairs.items():
        assert got.shape == ref.shape and got.dtype == out_dtype, name
        # Outputs rounded to bf16 (8 significant bits): within half a unit in the last place of the reference.
        half_ulp = torch.ldexp(torch.ones_like(ref), torch.frexp(ref).exponent - 9)
        out[name] = ((got.float() - ref).abs() - (half_ulp if out_dtype == torch.bfloat16 else 0)).max().item()
    return out


FAST_CASES = ("step-gqa-rope", "prefill-L37-gqa-rope-projection-strides")  # one token, a block


@pytest.mark.parametrize("name", cases(CASES, FAST_CASES))
def test_interpreted_features_kernel_equals_the_feature_maps_and_rotation(name, interpreter):
    errs = interpreter.case("test_features", name)
    assert max(errs.values()) < 1e-5, errs


BLOCK_CASES = {name: CASES[name] for name in ("prefill-L37-gqa-rope-projection-strides", "prefill-L150-gqa-rope-three-blocks")}
FAST_BLOCK_CASES = ("prefill-L37-gqa-rope-projection-strides",)


@pytest.mark.parametrize("name", cases(BLOCK_CASES, FAST_BLOCK_CASES))
def test_interpreted_features_kernel_at_another_block_size(name, interpreter):
    """`lizard_features(block=16)` (for A/B timings) changes how many tokens a program takes, not the results."""
    errs = interpreter.case("test_features", name, "BLOCK_CASES", block=16)
    assert max(errs.values()) < 1e-5, errs


PROGRAM_CASES = {name: CASES[name] for name in ("prefill-L150-gqa-rope-three-blocks",
                                                "prefill-L70-bf16-in-weights-and-out")}
FAST_PROGRAM_CASES = ("prefill-L150-gqa-rope-three-blocks",)


@pytest.mark.parametrize("name", cases(PROGRAM_CASES, FAST_PROGRAM_CASES))
@pytest.mark.parametrize("programs", [1, 2])
def test_interpreted_features_kernel_with_programs_walking_several_blocks(name, programs, interpreter):
    """With fewer programs than blocks of 16 tokens, each walks several (at L = 150, 10 or 5) with the
    weights loaded once: the same results."""
    errs = interpreter.case("test_features", name, "PROGRAM_CASES", block=16, programs=programs)
    assert max(errs.values()) < 1e-5, errs


def test_features_programs_per_head_must_be_positive():
    pytest.importorskip("triton")
    from linearize.ops.features.triton import lizard_features

    q, w = torch.randn(1, 2, 32, 16), torch.randn(2, 16, 16)
    with pytest.raises(ValueError, match="programs per head must be >= 1"):
        lizard_features(q, q, w, w, programs=0)


def test_features_block_sizes_are_powers_of_two_from_16():
    pytest.importorskip("triton")
    from linearize.ops.features.triton import TOKENS_PER_PROGRAM, tokens_per_program

    assert tokens_per_program() == TOKENS_PER_PROGRAM and tokens_per_program(16) == 16
    for bad in (24, 8):
        with pytest.raises(ValueError, match="power of two >= 16"):
            tokens_per_program(bad)


def test_gemma_head_dim_256_is_left_to_the_reference(monkeypatch):
    """A [256, 128] weight per map does not fit one program's shared memory (the H200 refused the
    kernel): the dispatch says so and the PyTorch reference answers, with the same features."""
    pytest.importorskip("triton")
    from linearize.ops import backend
    from linearize.ops.features import lizard_features
    from linearize.ops.features.naive import lizard_features_naive
    from linearize.ops.features.triton import features_unsupported

    q, k = torch.randn(1, 4, 16, 256), torch.randn(1, 1, 16, 256)
    w = torch.randn(4, 256, 128) * 0.05
    assert "head dim 256 x feature dim 128" in features_unsupported(q, k, w)
    assert features_unsupported(q[..., :128], k[..., :128], w[:, :128]) is None
    monkeypatch.setattr(backend, "use_kernels", lambda: True)
    with backend.recording() as ran:
        out = lizard_features(q, k, w, w)
    assert ran == [("lizard_features", "torch")]
    for got, expected in zip(out, lizard_features_naive(q, k, w, w, None), strict=True):
        torch.testing.assert_close(got, expected)


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs CUDA and triton")
@pytest.mark.parametrize("name", list(CASES))
def test_features_kernel_on_cuda_equals_the_feature_maps_and_rotation(name):
    errs = errors("cuda", **CASES[name])
    assert max(errs.values()) < 1e-4, errs  # x W on tensor cores (3xTF32): about, not exactly, float32


GRADIENT_CASES = {
    "gqa-rope-L37-inputs-and-weights": {"L": 37},
    "gqa4-rope-L70-weights-only": {"L": 70, "H": 8, "HKV": 2, "wrt": "weights"},
    "mha-no-rope-L20-inputs-only": {"L": 20, "HKV": 4, "rope": False, "wrt": "inputs"},
    "gqa-no-rope-L16-D32-F16-one-position": {"L": 16, "D": 32, "rope": False, "cos_batch": 1},
    # The backward takes x and W a column block at a time (BWD_COLUMNS, 64 as launched): two blocks here,
    # with each column's rotation partner in the other block.
    "gqa-rope-L37-D32-two-column-blocks": {"L": 37, "D": 32, "columns": 16},
}


def gradient_errors(device, L, B=2, H=4, HKV=2, D=16, F=16, rope=True, cos_batch=None, wrt="both",
                    columns=None) -> dict:
    """Max abs errors of `LizardFeaturesFunction`'s outputs and of the gradients it gives q, k and the
    two weights (`wrt`: inputs, weights or both; stage 2 and stage 1 need one each), against autograd
    through the feature maps, repeat_kv and rotate, for random upstream gradients. float32. `columns`:
    the backward's column block (None: as launched)."""
    from linearize.ops.features import triton as features_triton

    launched = features_triton.BWD_COLUMNS
    features_triton.BWD_COLUMNS = columns or launched
    try:
        return _gradient_errors(device, L, B, H, HKV, D, F, rope, cos_batch, wrt)
    finally:  # the interpreter's worker outlives the case
        features_triton.BWD_COLUMNS = launched


def _gradient_errors(device, L, B, H, HKV, D, F, rope, cos_batch, wrt) -> dict:
    from linearize.ops.features.triton import LizardFeaturesFunction

    r, maps, q, k, position = _inputs(device, 1, L, B, H, HKV, D, F, rope, cos_batch)
    for m in maps:
        m.weight.requires_grad_(wrt != "inputs")
    q, k = q.requires_grad_(wrt != "weights"), k.requires_grad_(wrt != "weights")
    cos, sin = position or (None, None)
    qh, kh = q.transpose(1, 2), k.transpose(1, 2)  # as the projections give them
    ours = LizardFeaturesFunction.apply(qh, kh, maps[0].weight, maps[1].weight, cos, sin, torch.float32)
    ref = [maps[0](qh), maps[1](repeat_kv(kh, H // HKV))]
    if rope:
        ref += list(rotate(qh, kh, (cos, sin)))
    upstream = [r(*t.shape) for t in ref]
    leaves = [t for t in (q, k, maps[0].weight, maps[1].weight) if t.requires_grad]
    used = [i for i, t in enumerate(ref) if t.requires_grad]  # rotations carry no weight gradient
    got = torch.autograd.grad([ours[i] for i in used], leaves, [upstream[i] for i in used])
    want = torch.autograd.grad([ref[i] for i in used], leaves, [upstream[i] for i in used])
    out = {f"out{i}": (a - b).abs().max().item() for i, (a, b) in enumerate(zip(ours, ref, strict=True))}
    out.update({f"grad{i}": ((a - b).abs().max() / b.abs().max()).item()
                for i, (a, b) in enumerate(zip(got, want, strict=True))})
    # 1 (an error) where stage 1's rotations, of frozen q and k, would still ask the attention for gradients.
    out["rotations_differentiable"] = float(wrt == "weights" and any(t.requires_grad for t in ours[2:]))
    return out


FAST_GRADIENT_CASES = ("gqa-rope-L37-inputs-and-weights", "gqa-rope-L37-D32-two-column-blocks")


@pytest.mark.parametrize("name", cases(GRADIENT_CASES, FAST_GRADIENT_CASES))
def test_interpreted_features_gradients_equal_autograd_through_the_reference(name, interpreter):
    errs = interpreter.case("test_features", name, "GRADIENT_CASES", "gradient_errors")
    assert max(errs.values()) < 1e-5, errs


# On the GPU also the shapes that train: SmolLM2's heads (9 of 64 dims over 3 KV heads, f = 32) and
# Llama-3-8B's (128 dims, f = 64, 4 query heads per KV head).
GPU_GRADIENT_CASES = GRADIENT_CASES | {
    "smollm2-heads-L300": {"L": 300, "H": 9, "HKV": 3, "D": 64, "F": 32},
    "llama3-8b-heads-L200": {"L": 200, "H": 8, "HKV": 2, "D": 128, "F": 64},
}


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs CUDA and triton")
@pytest.mark.parametrize("name", list(GPU_GRADIENT_CASES))
def test_features_gradients_on_cuda_equal_autograd_through_the_reference(name):
    errs = gradient_errors("cuda", **GPU_GRADIENT_CASES[name])
    assert max(errs.values()) < 1e-4, errs  # 3xTF32 products: about float32
