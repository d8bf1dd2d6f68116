"""Liger-GLA: softmax-over-head-dim phi, pooled-key gate, unnormalised GLA mixed with a RoPE SWA.

Liger adds no parameters: everything it learns goes through LoRA on the teacher's projections.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import LigerConfig
from ..feature_maps import SoftmaxFeatureMap
from ..ops.common import repeat_kv
from ..ops.gla_window import GlaWindowOptions
from .base import LinearizedAttention, Pass, rotate
from .lizard import gla_window_pass


class LigerAttention(LinearizedAttention):
    def __init__(self, teacher: nn.Module, cfg: LigerConfig, model_config):
        super().__init__(teacher, cfg, model_config)
        self.feature_map = SoftmaxFeatureMap(self.head_dim)

    def attend(self, q, k, v, position_embeddings, valid, state, call: Pass):
        cfg = self.cfg
        n_rep = self.num_heads // self.num_kv_heads
        # Gate: mean-pool of each KV head's key over the head dim, shared by its query heads.
        log_g = repeat_kv(nn.functional.logsigmoid(k.mean(-1, keepdim=True)) / cfg.gate_normalizer, n_rep)
        fq, fk = self.feature_map(q), self.feature_map(repeat_kv(k, n_rep))
        qw, kw = self.keep_rotated(*rotate(q, k, position_embeddings))
        mix = torch.full((self.num_heads,), cfg.mix, device=q.device)
        # No sinks; the window's weight is `mix`, the unnormalised linear part's 1 - mix (which no kernel
        # continues: a pass after a state goes through the PyTorch form).
        options = GlaWindowOptions(window=cfg.window, scale=self.scaling, alpha=mix, beta=1.0 - cfg.mix,
                                   normalize=False, chunk=cfg.chunk_size)
        return gla_window_pass(fq, fk, log_g, qw, kw, v, valid, state, options, call)
