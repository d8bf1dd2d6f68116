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
    assert counter.casts == [(torch.float32, torch.bfloat16)] * 2, counter.casts
