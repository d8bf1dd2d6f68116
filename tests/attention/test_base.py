"""`LinearizedAttention.forward` under autocast: each activation is cast to the autocast dtype once."""

import pytest
import torch
from tiny_models import METHODS, TINY, TINY_OPTIONS, tiny_teacher
from torch.utils._python_dispatch import TorchDispatchMode

from linearize.convert import convert


class ActivationCasts(TorchDispatchMode):
    """Counts dtype casts of [B, L, hidden] tensors."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.casts = shape, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and tuple(args[0].shape) == self.shape and "dtype" in kwargs:
            self.casts.append((args[0].dtype, kwargs["dtype"]))
        return func(*args, **kwargs)


@pytest.mark.parametrize("method", METHODS)
def test_the_hidden_states_are_cast_once_and_the_output_not_round_tripped(method):
    """Before: q, k and v each cast the float32 hidden states, and y went to float32 before o_proj
    cast it back. Now: one cast in (the hidden states) and at most one for y (float32 from the
    PyTorch ops; none where a kernel gives it in bf16)."""
    model = convert(tiny_teacher(), method, **TINY_OPTIONS[method])
    attention = model.model.layers[0].self_attn
    B, L = 2, 12
    hidden = torch.randn(B, L, TINY["hidden_size"])
    position_embeddings = model.model.rotary_emb(hidden, torch.arange(L)[None])
    counter = ActivationCasts((B, L, TINY["hidden_size"]))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), counter:
        out, _ = attention(hidden, position_embeddings=position_embeddings, attention_mask=None)
    assert out.dtype == torch.bfloat16
    # STILL's gate logits are [B, L, H * d], the hidden size here: bf16 like q, k and v, then float32
    # for its sigmoid.
    gate = [(torch.bfloat16, torch.float32)] if method == "still" else []
    assert sorted(counter.casts, key=str) == sorted([(torch.float32, torch.bfloat16)] * 2 + gate, key=str), counter.casts


STUDENTS = {**{method: (method, TINY_OPTIONS[method]) for method in METHODS},
            "lizard-rope-in-window": ("lizard", {**TINY_OPTIONS["lizard"], "rope_in_window": True})}


@pytest.mark.parametrize("student", STUDENTS)
def test_the_stage1_target_is_the_teachers_attention_output(student):
    """In stage 1 a layer returns the teacher's softmax attention output, whether `attend` left its
    rotated q and k for it (Liger, LoLCATs, STILL, Lizard with RoPE in the window) or not; and its
    transfer loss is the MSE of its own output against that."""
    method, options = STUDENTS[student]
    teacher = tiny_teacher()
    B, L = 2, 12
    hidden = torch.randn(B, L, TINY["hidden_size"])
    position_embeddings = teacher.model.rotary_emb(hidden, torch.arange(L)[None])
    with torch.no_grad():
        expected, _ = teacher.model.layers[0].self_attn(hidden, position_embeddings=position_embeddings,
                                                        attention_mask=None)
    attention = convert(teacher, method, **options).model.layers[0].self_attn
    attention.attention_transfer = True
    with torch.no_grad():
        target, _ = attention(hidden, position_embeddings=position_embeddings, attention_mask=None)
    torch.testing.assert_close(target, expected, rtol=1e-5, atol=1e-6)
    assert attention.rotated is None
    attention.attention_transfer = False
    with torch.no_grad():
        own, _ = attention(hidden, position_embeddings=position_embeddings, attention_mask=None)
    torch.testing.assert_close(attention.transfer_loss, torch.nn.functional.mse_loss(own, expected))


@pytest.mark.parametrize("method", ["lizard", "still"])
def test_the_gate_projection_is_not_held_past_the_call(method):
    """`projected` (the gates' outputs, [B, L, H d] for STILL) is for `attend` alone: a layer that kept it
    would hold one per layer until its next call."""
    model = convert(tiny_teacher(), method, **TINY_OPTIONS[method])
    attention = model.model.layers[0].self_attn
    assert attention.input_projections()
    hidden = torch.randn(2, 12, TINY["hidden_size"])
    position_embeddings = model.model.rotary_emb(hidden, torch.arange(12)[None])
    with torch.no_grad():
        attention(hidden, position_embeddings=position_embeddings, attention_mask=None)
    assert attention.projected == ()
