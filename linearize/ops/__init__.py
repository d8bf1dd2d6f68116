"""Attention math as plain functions on tensors, one folder per operation (as fla lays them out).

    gla_window/   gated linear attention + sliding softmax window (Lizard, Liger)
    features/     Lizard's Hedgehog feature maps and window RoPE in one pass
    still/        STILL's routed softmax budget + gated linear state
    lolcats/      LoLCATs' sliding window + linear attention

Each folder has `naive.py`, the obviously-correct reference (any length, an optional carried state),
its faster forms (`chunk.py` in PyTorch, `triton.py` kernels, a decode step), and in `__init__.py`
the one entry that picks the form: the attention modules call only that. `backend.py` holds the
switch between the Triton kernels and the PyTorch forms. Shapes: queries/features [B, H, L, *],
keys/values [B, H_kv, L, d] (GQA), validity [B, L] (False for padding). States are dicts of
fixed-shape tensors, stored as they are in the cache.
"""
