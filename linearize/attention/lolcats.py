"""LoLCATs: RoPE, Hedgehog phi, softmax on the last w tokens and linear attention before them."""

from __future__ import annotations

import torch
from torch import nn

from ..config import LolcatsConfig
from ..feature_maps import HedgehogFeatureMap
from ..ops.lolcats import LolcatsOptions, chunk_lolcats, continue_lolcats, lolcats_step
from .base import LinearizedAttention, Pass, rotate


class LolcatsAttention(LinearizedAttention):
    def __init__(self, teacher: nn.Module, cfg: LolcatsConfig, model_config):
        super().__init__(teacher, cfg, model_config)
        H = self.num_heads
        self._add_feature_maps(HedgehogFeatureMap, cfg.feature_dim)
        self.window_factors = nn.Parameter(torch.full((H,), cfg.window_factor_init))
        self._param_like(self)

    def head_scalars(self) -> list[nn.Parameter]:
        return [self.window_factors]

    def attend(self, q, k, v, position_embeddings, valid, state, call: Pass):
        cfg = self.cfg
        q, k = self.keep_rotated(*rotate(q, k, position_embeddings))
        options = LolcatsOptions(window=cfg.window, scale=self.scaling,
                                 factor=torch.sigmoid(self.window_factors.float()), eps=cfg.eps)
        phi_q, phi_k = self.feature_map_q, self.feature_map_k
        if state is None:
            return chunk_lolcats(q, k, v, valid, phi_q, phi_k, options)
        if q.shape[2] == 1:
            return lolcats_step(q, k, v, valid, state, phi_q, phi_k, options)
        return continue_lolcats(q, k, v, valid, state, phi_q, phi_k, options)
