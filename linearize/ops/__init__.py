"""Attention math as plain functions on tensors.

Each method has a naive parallel form (any length, with an optional carried state, O(L^2) memory:
the obviously-correct reference) and a recurrent one-token step that carries constant-size state.
Shapes: queries/features [B, H, L, *], keys/values [B, H_kv, L, d] (GQA), validity [B, L] (False
for padding). States are dicts of fixed-shape tensors, stored as-is in the cache.
"""
