"""Liger-GLA: softmax-over-head-dim phi, pooled-key gate, unnormalised GLA mixed with a RoPE SWA.

Liger adds no parameters: everything it learns goes through LoRA on the teacher's projections.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import LigerConfig
from ..feature_maps import SoftmaxFeatureMap
from ..ops.common import repeat_kv
from ..ops.gla_window_chunked import gla_window_call
from . import fused
from .base import LinearizedAttention, rotate


class LigerAttention(LinearizedAttention):
    def __init__(self, teacher: nn.Module, cfg: LigerConfig, model_config):
        super().__init__(teacher, cfg, model_config)
        self.feature_map = SoftmaxFeatureMap(self.head_dim)

    def attend(self, q, k, v, position_embeddings, valid, state, start):
        cfg = self.cfg
        n_rep = self.num_heads // self.num_kv_heads
        # Gate: mean-pool of each KV head's key over the head dim, shared by its query heads.
        log_g = repeat_kv(nn.functional.logsigmoid(k.mean(-1, keepdim=True)) / cfg.gate_normalizer, n_rep)
        fq, fk = self.feature_map(q), self.feature_map(repeat_kv(k, n_rep))
        qw, kw = self.keep_rotated(*rotate(q, k, position_embeddings))
        mix = torch.full((self.num_heads,), cfg.mix, device=q.device)
        options = {"window": cfg.window, "scale": self.scaling, "sinks": None, "alpha": mix}
        # The kernel's linear part is unnormalised here; its weight 1 - mix goes into the queries.
        out = fused.run(fq, fk, log_g, qw, kw, v, valid, state=state, start=start, caching=self.caching,
                        unpadded=self.unpadded, in_place=self.frozen_cache, dtype=self.projection_dtype,
                        can_continue=False, query_scale=1.0 - cfg.mix, normalize=False, **options)
        if out is not None:
            return out
        return gla_window_call(fq, fk, log_g, qw, kw, v, valid, state, chunk=cfg.chunk_size, beta=1.0 - cfg.mix,
                               normalize=False, shared=False, **options)
