"""LoLCATs: softmax over the last w tokens, linear attention before them: the one dispatch point.

Forms: `naive.lolcats_parallel` (the reference), `naive.lolcats_step` (one decode step) and
`chunk.lolcats_chunked` (O(L * w) memory), tested against the reference in values and gradients.
There is no Triton kernel: LoLCATs is a baseline.
"""

from __future__ import annotations

from .chunk import lolcats_chunked
from .naive import init_state, lolcats_step

__all__ = ["init_state", "lolcats"]


def lolcats(q, k, v, valid, state, phi_q, phi_k, **options):
    """(y, new state) over L new tokens continuing `state` (None: an empty one); options are the
    forms' (window, scale, factor, eps)."""
    if state is None:
        B, H, _, d = q.shape
        state = init_state(B, H, k.shape[1], phi_q.out_dim, d, options["window"], device=q.device)
    elif q.shape[2] == 1:
        return lolcats_step(q, k, v, valid, state, phi_q, phi_k, **options)
    return lolcats_chunked(q, k, v, valid, state, phi_q, phi_k, **options)
