"""Liger-GLA: softmax-over-head-dim phi, pooled-key gate, unnormalised GLA mixed with a RoPE SWA.

Liger adds no parameters: everything it learns goes through LoRA on the teacher's projections.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import LigerConfig
from ..feature_maps import SoftmaxFeatureMap
from ..ops import gla_window
from ..ops.common import repeat_kv
from ..ops.gla_window_chunked import gla_window_chunked
from . import fused
from .base import LinearizedAttention, rotate


class LigerAttention(LinearizedAttention):
    def __init__(self, teacher: nn.Module, cfg: LigerConfig, model_config):
        super().__init__(teacher, cfg, model_config)
        self.feature_map = SoftmaxFeatureMap(self.head_dim)

    def attend(self, x, q, k, v, position_embeddings, valid, state, start):
        cfg = self.cfg
        n_rep = self.num_heads // self.num_kv_heads
        # Gate: mean-pool of each KV head's key over the head dim, shared by its query heads.
        log_g = repeat_kv(nn.functional.logsigmoid(k.mean(-1, keepdim=True)) / cfg.gate_normalizer, n_rep)
        fq, fk = self.feature_map(q), self.feature_map(repeat_kv(k, n_rep))
        qw, kw = rotate(q, k, position_embeddings)
        mix = torch.full((self.num_heads,), cfg.mix, device=q.device)
        if start == 0 and fused.kernel_applies(fq, fk, log_g, qw, kw, v, window=cfg.window, sinks=None, valid=valid,
                                               start=start, can_continue=False):
            # The kernel's linear part is unnormalised here; its weight 1 - mix goes into the queries.
            dt = self.projection_dtype
            operands = ((fq * (1.0 - cfg.mix)).to(dt), fk.to(dt), log_g, qw.to(dt), kw.to(dt), v.to(dt))
            return fused.first_pass(operands, valid, caching=self.caching, state_inputs=(fk, log_g, kw, v),
                                    window=cfg.window, scale=self.scaling, sinks=None, alpha=mix, normalize=False)
        options = {"window": cfg.window, "scale": self.scaling, "sinks": None, "alpha": mix, "beta": 1.0 - cfg.mix,
                   "normalize": False, "shared": False}
        if state is None:
            state = gla_window.init_state(q.shape[0], self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim,
                                          cfg.window, device=q.device)
        elif q.shape[2] == 1:
            return gla_window.gla_window_step(fq, fk, log_g, qw, kw, v, valid, state, **options)
        return gla_window_chunked(fq, fk, log_g, qw, kw, v, valid, state, **options, chunk=cfg.chunk_size)
