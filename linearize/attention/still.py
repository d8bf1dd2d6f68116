"""STILL: Self-Saliency routed softmax budget + NP-Map gated linear state (`linearize.ops.still`)."""

from __future__ import annotations

from torch import nn

from ..config import StillConfig
from ..feature_maps import HedgehogFeatureMap, NormPreservingFeatureMap
from ..ops import still
from .base import LinearizedAttention, Pass, rotate


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
        # The one-token step; `linearize.decode.compile_still_steps` swaps in one compiled function
        # shared by every layer.
        self.decode_step = still.still_step

    def input_projections(self) -> list[nn.Linear]:
        return [self.gate] if self.cfg.gate else []

    def attend(self, q, k, v, position_embeddings, valid, state, call: Pass):
        cfg = self.cfg
        B, H, L, d = q.shape
        q, k = self.keep_rotated(*rotate(q, k, position_embeddings))
        gate = None
        if cfg.gate:
            gate = self.projected[0].float().sigmoid().view(B, L, H, d).transpose(1, 2)
        options = still.StillOptions(**cfg.op_options(self.scaling))
        phi_q, phi_k = self.feature_map_q, self.feature_map_k
        if state is None:
            state = still.init_state(B, H, self.num_kv_heads, self.features, d, cfg.window, cfg.slots, device=q.device)
            return still.chunk_still(q, k, v, valid, gate, state, phi_q, phi_k, options, dtype=call.dtype,
                                     output_final_state=call.caching)
        if L == 1:
            return self.decode_step(q, k, v, valid, gate, state, phi_q, phi_k, options)
        return still.continue_still(q, k, v, valid, gate, state, phi_q, phi_k, options, start=call.start,
                                    caching=call.caching, dtype=call.dtype)
