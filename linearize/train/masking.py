"""Training batches are packed, never padded: HF need not build an attention mask for them.

HF skips the causal mask for SDPA when it can read the batch's padding from the device, but not while
a CUDA graph is being captured (no device reads there). It then builds a full [B, 1, L, L] mask: the
softmax layers take SDPA's slower masked path, and the linearized layers, handed a mask, read it back
to find the padding, which the capture refuses. `unpadded_attention` tells HF the answer instead.

Not for a teacher with sliding-window layers (Gemma 2 and 3, Mistral with a window): without a mask,
SDPA runs them as full causal attention, so its softmax layers would train, and its stage-1 targets be
computed, over the whole sequence instead of the window. Those models keep HF's masks.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from transformers import AttentionInterface, AttentionMaskInterface

from ..architectures import sliding_window_of

UNPADDED = "linearize_unpadded_sdpa"


def _no_mask(**_) -> None:
    return None


AttentionInterface.register(UNPADDED, AttentionInterface._global_mapping["sdpa"])
AttentionMaskInterface.register(UNPADDED, _no_mask)


@contextmanager
def unpadded_attention(model) -> Iterator[None]:
    """Within it, `model` (on SDPA) runs without attention masks: its softmax layers as causal SDPA,
    its linearized layers as unpadded. Only for batches with no padding and no attention mask given.
    Other attention implementations, and models with sliding-window layers, are left as they are."""
    config = model.config
    before = config._attn_implementation
    if before != "sdpa" or sliding_window_of(config) is not None:
        yield
        return
    config._attn_implementation = UNPADDED
    try:
        yield
    finally:
        config._attn_implementation = before
