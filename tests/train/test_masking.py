"""`unpadded_attention`: no attention mask for packed training batches, even where HF would build one."""

import pytest
import torch
from tiny_models import TINY_OPTIONS, tiny_teacher
from transformers import masking_utils

from linearize.attention.base import LinearizedAttention
from linearize.convert import convert
from linearize.train.losses import stage_loss
from linearize.train.masking import unpadded_attention


def masks_seen(model, monkeypatch) -> list:
    """The attention_mask each linearized layer is called with, over one stage-2 loss."""
    seen = []
    forward = LinearizedAttention.forward

    def recording(self, *args, **kwargs):
        seen.append(kwargs.get("attention_mask"))
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(LinearizedAttention, "forward", recording)
    return seen


@pytest.mark.parametrize("softmax_layers", [None, [1]])
def test_no_mask_is_built_where_hf_would_build_one_and_the_loss_is_unchanged(monkeypatch, softmax_layers):
    """HF builds a full mask when it may not read the padding from the device (a CUDA graph capture):
    forced here. Without masks the linearized layers take the unpadded path and the softmax layer causal
    SDPA, with the same loss."""
    model = convert(tiny_teacher(), "lizard", softmax_layers=softmax_layers, **TINY_OPTIONS["lizard"]).eval()
    ids = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = model(input_ids=ids, labels=ids, use_cache=False).loss
    monkeypatch.setattr(masking_utils, "_ignore_causal_mask_sdpa", lambda *args, **kwargs: False)
    seen = masks_seen(model, monkeypatch)
    with torch.no_grad():
        masked = model(input_ids=ids, labels=ids, use_cache=False).loss
        assert seen and all(mask is not None and mask.dim() == 4 for mask in seen)
        seen.clear()
        unmasked = stage_loss(model, ids, 2)
    assert seen and all(mask is None for mask in seen)
    torch.testing.assert_close(unmasked, plain, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(masked, plain, rtol=1e-5, atol=1e-6)
    assert model.config._attn_implementation == "sdpa"


def test_other_attention_implementations_are_left_alone():
    model = tiny_teacher()
    model.config._attn_implementation = "eager"
    with unpadded_attention(model):
        assert model.config._attn_implementation == "eager"


def test_the_implementation_comes_back_after_an_error():
    model = tiny_teacher()
    with pytest.raises(RuntimeError), unpadded_attention(model):
        assert model.config._attn_implementation != "sdpa"
        raise RuntimeError("interrupted")
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("layers", ["all", "full"])
def test_sliding_window_layers_keep_their_masks_in_training(layers):
    """A Gemma 3 teacher's sliding layers (window 6 here) attend over their window in training as at
    inference: the stage-2 loss is the plainly masked forward's, not full causal attention's, and the
    stage-1 targets of linearized sliding layers are the windowed teacher's."""
    teacher = tiny_teacher("gemma3_text")
    ids = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    model = convert(tiny_teacher("gemma3_text"), "lizard", layers=layers, **TINY_OPTIONS["lizard"]).eval()
    with torch.no_grad():
        plain = model(input_ids=ids, labels=ids, use_cache=False).loss
        torch.testing.assert_close(stage_loss(model, ids, 2), plain, rtol=1e-5, atol=1e-6)
        with unpadded_attention(model):
            assert model.config._attn_implementation == "sdpa"
        for layer in model.modules():
            if isinstance(layer, LinearizedAttention):
                layer.attention_transfer = True
        stage_loss(model, ids, 1)
        targets = []
        hooks = [layer.register_forward_hook(lambda m, a, out: targets.append(out[0]))
                 for layer in model.modules() if isinstance(layer, LinearizedAttention)]
        model(input_ids=ids, use_cache=False)
        for hook in hooks:
            hook.remove()
        teacher_outputs = []
        hooks = [layer.self_attn.register_forward_hook(lambda m, a, out: teacher_outputs.append(out[0]))
                 for i, layer in enumerate(teacher.model.layers)
                 if isinstance(model.model.layers[i].self_attn, LinearizedAttention)]
        teacher(input_ids=ids, use_cache=False)
        for hook in hooks:
            hook.remove()
    assert targets and len(targets) == len(teacher_outputs)
    for target, expected in zip(targets, teacher_outputs, strict=True):
        torch.testing.assert_close(target, expected, rtol=1e-4, atol=1e-5)
