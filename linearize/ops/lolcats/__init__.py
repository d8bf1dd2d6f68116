"""LoLCATs: softmax over the last w tokens, linear attention before them, in three forms.

The forms (what the attention module calls; the method's options in one `LolcatsOptions`):
  chunk_lolcats     L tokens from an empty state
  continue_lolcats  L tokens continuing a carried state
  lolcats_step      one token after a state
all PyTorch: `chunk.lolcats_chunked` (O(L * w) memory) for passes, `naive.lolcats_step` for a token,
tested against the reference `naive.lolcats_parallel` in values and gradients. There is no Triton
kernel: LoLCATs is a baseline.
"""

from __future__ import annotations

from .chunk import lolcats_chunked
from .naive import init_state, lolcats_step
from .options import LolcatsOptions

__all__ = ["LolcatsOptions", "chunk_lolcats", "continue_lolcats", "init_state", "lolcats_step"]


def chunk_lolcats(q, k, v, valid, phi_q, phi_k, options: LolcatsOptions):
    """(y, state after) over the first L tokens: q [B,H,L,d], k, v [B,H_kv,L,d] (RoPE'd), valid [B, L],
    phi_q, phi_k the feature maps."""
    B, H, _, d = q.shape
    state = init_state(B, H, k.shape[1], phi_q.out_dim, d, options.window, device=q.device)
    return lolcats_chunked(q, k, v, valid, state, phi_q, phi_k, options)


def continue_lolcats(q, k, v, valid, state, phi_q, phi_k, options: LolcatsOptions):
    """(y, state after) over L tokens continuing `state`."""
    return lolcats_chunked(q, k, v, valid, state, phi_q, phi_k, options)
