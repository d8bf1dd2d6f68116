"""Lizard: gated linear attention (Hedgehog phi, data-dependent gate, no RoPE) + anchor window with sinks."""

from __future__ import annotations

import torch
from torch import nn

from .. import kernels
from ..config import LizardConfig
from ..feature_maps import HedgehogFeatureMap
from ..ops import gla_window
from ..ops.common import repeat_kv
from ..ops.gla_window_chunked import gla_window_chunked
from . import fused
from .base import LinearizedAttention, rotate


class LizardAttention(LinearizedAttention):
    def __init__(self, teacher: nn.Module, cfg: LizardConfig, model_config):
        super().__init__(teacher, cfg, model_config)
        H = self.num_heads
        self._add_feature_maps(HedgehogFeatureMap, cfg.feature_dim)
        if cfg.gate != "none":
            self.gate = nn.Linear(model_config.hidden_size, H if cfg.gate == "scalar" else H * self.features)
            nn.init.zeros_(self.gate.weight)
            nn.init.constant_(self.gate.bias, cfg.gate_bias_init)
        self.sinks = nn.Parameter(torch.zeros(H, cfg.num_sinks))
        self.alpha = nn.Parameter(torch.full((H,), cfg.alpha_init))
        self._param_like(self)

    def log_gate(self, x: torch.Tensor) -> torch.Tensor:
        """log gamma as [B, H, L, 1] (scalar gate) or [B, H, L, F] (vector gate)."""
        B, L, _ = x.shape
        if self.cfg.gate == "none":
            return x.new_zeros(B, self.num_heads, L, 1, dtype=torch.float32)
        logits = self.gate(x.to(self.gate.weight.dtype)).float().view(B, L, self.num_heads, -1).transpose(1, 2)
        return nn.functional.logsigmoid(logits) / self.cfg.gate_temperature

    def attend(self, x, q, k, v, position_embeddings, valid, state, start):
        cfg = self.cfg
        n_rep = self.num_heads // self.num_kv_heads
        fq = self.feature_map_q(q)
        fk = self.feature_map_k(repeat_kv(k, n_rep))
        qw, kw = rotate(q, k, position_embeddings) if cfg.rope_in_window else (q, k)
        log_g = self.log_gate(x)
        sinks = self.sinks.float() if cfg.num_sinks else None
        if cfg.combine == "alpha" and fused.kernel_applies(fq, fk, log_g, qw, kw, v, window=cfg.window, sinks=sinks,
                                                           valid=valid, start=start, can_continue=True):
            return self._fused(fq, fk, log_g, qw, kw, v, sinks, valid, state if start else None)
        options = {"window": cfg.window, "scale": self.scaling, "sinks": sinks, "alpha": self.alpha.float(),
                   "beta": 1.0, "normalize": True, "shared": cfg.combine == "shared", "eps": cfg.eps}
        if state is None:
            state = gla_window.init_state(q.shape[0], self.num_heads, self.num_kv_heads, self.features, self.head_dim,
                                          cfg.window, device=q.device)
        elif q.shape[2] == 1:
            return gla_window.gla_window_step(fq, fk, log_g, qw, kw, v, valid, state, **options)
        return gla_window_chunked(fq, fk, log_g, qw, kw, v, valid, state, **options, chunk=cfg.chunk_size)

    def _fused(self, fq, fk, log_g, qw, kw, v, sinks, valid, carried):
        # bf16 operands under autocast (the projections' dtype), float32 state inside the kernel.
        dt = self.projection_dtype
        operands = (fq.to(dt), fk.to(dt), log_g, qw.to(dt), kw.to(dt), v.to(dt))
        options = {"window": self.cfg.window, "scale": self.scaling, "sinks": sinks, "alpha": self.alpha.float(),
                   "eps": self.cfg.eps}
        if carried is not None:
            y, new_state = kernels.lizard_attention_continued(*operands, carried, **options)
            return y.float(), new_state
        return fused.first_pass(operands, valid, caching=self.caching, state_inputs=(fk, log_g, kw, v), **options)
