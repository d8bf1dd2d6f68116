"""STILL: Self-Saliency routed softmax budget + NP-Map gated linear state (see ops/still.py)."""

from __future__ import annotations

import os

import torch
from torch import nn

from .. import kernels
from ..config import StillConfig
from ..feature_maps import HedgehogFeatureMap, NormPreservingFeatureMap
from ..ops import still
from ..ops.common import repeat_kv
from .base import LinearizedAttention, rotate
from .fused import kernels_enabled

MAX_PARALLEL = 2048  # tokens per parallel call


def still_kernel_enabled() -> bool:
    """A fresh pass (training, scoring, a prompt's prefill) runs through the STILL kernels, unless
    LINEARIZE_STILL_KERNEL=0 or LINEARIZE_KERNELS=0 (A/B timings, debugging)."""
    return os.environ.get("LINEARIZE_STILL_KERNEL") != "0" and kernels_enabled()


class StillAttention(LinearizedAttention):
    def __init__(self, teacher: nn.Module, cfg: StillConfig, model_config):
        super().__init__(teacher, cfg, model_config)
        H, d = self.num_heads, self.head_dim
        self._add_feature_maps(NormPreservingFeatureMap if cfg.feature_map == "npmap" else HedgehogFeatureMap,
                               cfg.feature_dim)
        if cfg.gate:
            self.gate = nn.Linear(model_config.hidden_size, H * d)
            nn.init.zeros_(self.gate.weight)
            nn.init.zeros_(self.gate.bias)
        self._param_like(self)
        # The one-token step; `linearize.decode.compile_attention_steps` swaps in one compiled function
        # shared by every layer.
        self.decode_step = still.still_step

    def input_projections(self) -> list[nn.Linear]:
        return [self.gate] if self.cfg.gate else []

    def attend(self, q, k, v, position_embeddings, valid, state, start):
        cfg = self.cfg
        B, H, L, d = q.shape
        q, k = self.keep_rotated(*rotate(q, k, position_embeddings))
        gate = None
        if cfg.gate:
            gate = self.projected[0].float().sigmoid().view(B, L, H, d).transpose(1, 2)
        options = cfg.op_options(self.scaling)
        fresh = state is None
        if fresh:
            state = still.init_state(B, H, self.num_kv_heads, self.features, d, cfg.window, cfg.slots, device=q.device)
        elif L == 1:
            return self.decode_step(q, k, v, valid, gate, state, self.feature_map_q, self.feature_map_k, **options)
        if fresh and still_kernel_enabled() and not kernels.still_unsupported(q, k, self.features):
            return self._fresh_pass_through_kernels(q, k, v, valid, gate, state, start, options)
        # The parallel form holds [L, K + W + L] scores per head: long inputs go through it in blocks,
        # each continuing from the state the previous one left (the same results, bounded memory).
        outputs = []
        for lo in range(0, L, MAX_PARALLEL):
            part = slice(lo, lo + MAX_PARALLEL)
            y, state = still.still_parallel(q[:, :, part], k[:, :, part], v[:, :, part], valid[:, part],
                                            None if gate is None else gate[:, :, part], state, self.feature_map_q,
                                            self.feature_map_k, **options, start=start + lo,
                                            fresh=fresh and lo == 0, keep_state=self.caching or lo + MAX_PARALLEL < L)
            outputs.append(y)
        return torch.cat(outputs, 2), state

    def _fresh_pass_through_kernels(self, q, k, v, valid, gate, state, start, options):
        """The routing in PyTorch (`still.fresh_routing`), the attention in one fused pass over the whole
        input, its GEMMs in the projections' dtype; and the state after it when caching (a prompt's
        prefill: no [L, L] scores, so no blocks of MAX_PARALLEL tokens either)."""
        fq = self.feature_map_q(q)
        fk = self.feature_map_k(repeat_kv(k, self.num_heads // self.num_kv_heads))
        with torch.no_grad():
            fold, next_state = still.fresh_routing(q, k, v, valid, state, start=start, **options,
                                                   fk=fk.detach() if self.caching else None)
        dtype = self.projection_dtype
        y = kernels.still_attention(q.to(dtype), k.to(dtype), v.to(dtype), fq, fk, gate, fold, valid,
                                    scale=self.scaling, eps=self.cfg.eps)
        return y, next_state
