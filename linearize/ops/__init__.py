"""Attention math as plain functions on tensors, one folder per operation (as fla lays them out).

    gla_window/   gated linear attention + sliding softmax window (Lizard, Liger)
    features/     Lizard's Hedgehog feature maps and window RoPE in one pass
    still/        STILL's routed softmax budget + gated linear state
    lolcats/      LoLCATs' sliding window + linear attention
    delta_rule/   a gated delta-rule retrieval memory (fla's kernels on CUDA)
    sparse_cache/ gla_window plus a fixed-size cache of the tokens the linear state recalls worst (LoLA)

Each folder has `naive.py`, the obviously-correct reference (any length, an optional carried state),
its faster implementations (`chunk.py` in PyTorch, `triton.py` kernels, a decode step), and in
`__init__.py` the op's public forms, each with at most 12 parameters and the method's options in one
frozen object:

    gla_window  chunk_gla_window, continue_gla_window, gla_window_step   (GlaWindowOptions)
    still       chunk_still, continue_still, still_step                  (StillOptions)
    lolcats     chunk_lolcats, continue_lolcats, lolcats_step            (LolcatsOptions)
    delta_rule  chunk_delta_rule, continue_delta_rule, delta_rule_step   (DeltaRuleOptions)
    sparse_cache  chunk_sparse_cache, continue_sparse_cache, sparse_cache_step  (SparseCacheOptions)
    features    lizard_features

`chunk_*` is a multi-token pass from an empty state (differentiable), `continue_*` one continuing a
carried state or filling a cache (inference), `*_step` one decode token; the attention modules pick
the form once per call. `backend.py` holds the switch between the Triton kernels and the PyTorch
forms and the registry through which each form picks its implementation (`Form`, `Implementation`). Shapes: queries/features [B, H, L, *],
keys/values [B, H_kv, L, d] (GQA), validity [B, L] (False for padding). States are dicts of
fixed-shape tensors, stored as they are in the cache.
"""
