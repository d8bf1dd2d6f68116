"""Lizard: gated linear attention (Hedgehog phi, data-dependent gate, no RoPE) + anchor window with sinks,
with `sparse_slots` a cache of the tokens past the window the linear state recalls worst, and, with
`memory="delta"`, a gated delta-rule retrieval memory beside them (docs/methods.md)."""

from __future__ import annotations

import torch
from torch import nn

from ..config import LizardConfig
from ..feature_maps import HedgehogFeatureMap
from ..ops.features import lizard_features
from ..ops.gla_window import GlaWindowOptions, chunk_gla_window, continue_gla_window, gla_window_step
from ..ops.sparse_cache import SparseCacheOptions, chunk_sparse_cache, continue_sparse_cache, sparse_cache_step
from .base import LinearizedAttention, Pass
from .delta_memory import DeltaMemory


class LizardAttention(DeltaMemory, LinearizedAttention):
    native_operands = True

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
        if cfg.memory == "delta":  # without memory_decay_init it decays by the scalar gate: no parameter
            self.add_delta_memory(model_config.hidden_size, cfg.memory_weight_init, decay_init=cfg.memory_decay_init)
        self._param_like(self)

    def input_projections(self) -> list[nn.Linear]:
        gate = [self.gate] if self.cfg.gate != "none" else []
        return gate + ([self.memory_write] if self.cfg.memory == "delta" else [])

    def head_scalars(self) -> list[nn.Parameter]:
        gate_bias = [self.gate.bias] if self.cfg.gate == "scalar" else []
        memory = self.memory_head_scalars() if self.cfg.memory == "delta" else []
        return [self.alpha, self.sinks, *gate_bias, *memory]

    def log_gate(self, B: int, L: int, device: torch.device) -> torch.Tensor:
        """log gamma as [B, H, L, 1] (scalar gate) or [B, H, L, F] (vector gate), from this call's gate
        logits (`projected`)."""
        if self.cfg.gate == "none":
            return torch.zeros(B, self.num_heads, L, 1, device=device)
        logits = self.projected[0].float().view(B, L, self.num_heads, -1).transpose(1, 2)
        log_g = nn.functional.logsigmoid(logits)
        return log_g if self.cfg.gate_temperature == 1.0 else log_g / self.cfg.gate_temperature

    def branch_inputs(self, q, k, position_embeddings, dtype):
        """(phi_q(q), phi_k(k) for every query head, the window's q and k), in `dtype` (the projections')
        where the features kernel runs (`ops.features`)."""
        rope = position_embeddings if self.cfg.rope_in_window else None
        out = lizard_features(q, k, self.feature_map_q.weight, self.feature_map_k.weight, rope, dtype)
        if rope is not None:
            self.keep_rotated(*out[2:])
        return out

    def op_options(self) -> GlaWindowOptions:
        cfg = self.cfg
        return GlaWindowOptions(window=cfg.window, scale=self.scaling, alpha=self.alpha,
                                sinks=self.sinks if cfg.num_sinks else None, eps=cfg.eps,
                                shared=cfg.combine == "shared", chunk=cfg.chunk_size)

    def attend(self, q, k, v, position_embeddings, valid, state, call: Pass):
        fq, fk, qw, kw = self.branch_inputs(q, k, position_embeddings, call.dtype)
        log_g = self.log_gate(q.shape[0], q.shape[2], q.device)

        def branches(branch_state):
            if self.cfg.sparse_slots:
                options = SparseCacheOptions(self.op_options(), self.cfg.sparse_slots)
                return sparse_cache_pass(fq, fk, log_g, qw, kw, v, valid, branch_state, options, call)
            return gla_window_pass(fq, fk, log_g, qw, kw, v, valid, branch_state, self.op_options(), call)

        if self.cfg.memory == "gla":
            return branches(state)
        # The memory reads the raw (pre-RoPE) q and k, as the linear branch does; the Hedgehog features,
        # all positive, would make every two keys overlap and each write disturb the others. Its decay is
        # its own learned per-head one where it has one (the gate's temperature does not touch it), else
        # the scalar gate's (none without a gate).
        if self.cfg.memory_decay_init is not None:
            log_a = self.memory_log_decay(q.shape[0], q.shape[2])
        else:
            log_a = log_g[..., 0]
        return self.attend_with_memory(branches, q, k, v, log_a, valid, state, call)


def gla_window_pass(fq, fk, log_g, qw, kw, v, valid, state, options: GlaWindowOptions, call: Pass):
    """The gated-linear-plus-window op (Lizard's, Liger's) in the form this call takes: one token after a
    carried state steps; more tokens after one, or a first pass that fills a cache without gradients,
    continue (the kernel's continued form then returns the state it leaves); any other first pass
    (training, scoring) is a chunked pass from an empty state."""
    if state is not None and fq.shape[2] == 1:
        return gla_window_step(fq, fk, log_g, qw, kw, v, state, options, valid=valid, dtype=call.dtype,
                               in_place=call.frozen)
    padding = None if call.unpadded else valid
    if state is not None or (call.caching and not torch.is_grad_enabled()):
        return continue_gla_window(fq, fk, log_g, qw, kw, v, options, state=state, valid=padding, dtype=call.dtype)
    return chunk_gla_window(fq, fk, log_g, qw, kw, v, options, valid=padding, dtype=call.dtype,
                            output_final_state=call.caching)


def sparse_cache_pass(fq, fk, log_g, qw, kw, v, valid, state, options: SparseCacheOptions, call: Pass):
    """The op with the sparse cache in the form this call takes, as `gla_window_pass` picks them."""
    if state is not None and fq.shape[2] == 1:
        return sparse_cache_step(fq, fk, log_g, qw, kw, v, state, options, valid=valid)
    padding = None if call.unpadded else valid
    if state is not None or (call.caching and not torch.is_grad_enabled()):
        return continue_sparse_cache(fq, fk, log_g, qw, kw, v, options, state=state, valid=padding)
    return chunk_sparse_cache(fq, fk, log_g, qw, kw, v, options, valid=padding, output_final_state=call.caching)
