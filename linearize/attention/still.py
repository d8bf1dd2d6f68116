"""STILL: Self-Saliency routed softmax budget + NP-Map gated linear state (`linearize.ops.still`), and,
with `memory="delta"`, a gated delta-rule retrieval memory beside them (docs/methods.md)."""

from __future__ import annotations

from torch import nn

from ..config import StillConfig
from ..feature_maps import HedgehogFeatureMap, NormPreservingFeatureMap
from ..ops import still
from .base import LinearizedAttention, Pass, rotate
from .delta_memory import DeltaMemory


class StillAttention(DeltaMemory, LinearizedAttention):
    """With `memory="delta"` the output is y = y_still + mu_h * o_delta (`DeltaMemory`): the memory reads
    the raw (pre-RoPE) q and k, L2-normalised in the op, one state per query head, and writes with
    b_t = sigmoid(W_b x_t + c). STILL's gate is a per-channel gate on the linear numerator, not a
    scalar that could serve as a log-decay, so the memory decays by a learned per-head
    a_h = sigmoid(memory_decay_h), starting at `memory_decay_init` (0.9975, near 1). mu starts at
    `memory_weight_init` (0): the model then gives `memory="np_map"`'s output exactly."""

    def __init__(self, teacher: nn.Module, cfg: StillConfig, model_config):
        super().__init__(teacher, cfg, model_config)
        H, d = self.num_heads, self.head_dim
        self._add_feature_maps(NormPreservingFeatureMap if cfg.feature_map == "npmap" else HedgehogFeatureMap,
                               cfg.feature_dim)
        if cfg.gate:
            self.gate = nn.Linear(model_config.hidden_size, H * d)
            nn.init.zeros_(self.gate.weight)
            nn.init.zeros_(self.gate.bias)
        if cfg.memory == "delta":
            self.add_delta_memory(model_config.hidden_size, cfg.memory_weight_init, decay_init=cfg.memory_decay_init)
        self._param_like(self)
        # The one-token step; `linearize.decode.compile_still_steps` swaps in one compiled function
        # shared by every layer.
        self.decode_step = still.still_step

    def input_projections(self) -> list[nn.Linear]:
        gate = [self.gate] if self.cfg.gate else []
        return gate + ([self.memory_write] if self.cfg.memory == "delta" else [])

    def head_scalars(self) -> list[nn.Parameter]:
        return self.memory_head_scalars() if self.cfg.memory == "delta" else []

    def attend(self, q, k, v, position_embeddings, valid, state, call: Pass):
        if self.cfg.memory == "np_map":
            return self.attend_still(q, k, v, position_embeddings, valid, state, call)
        B, _, L, _ = q.shape

        def branches(still_state):
            return self.attend_still(q, k, v, position_embeddings, valid, still_state, call)

        return self.attend_with_memory(branches, q, k, v, self.memory_log_decay(B, L), valid, state, call)

    def attend_still(self, q, k, v, position_embeddings, valid, state, call: Pass):
        """The routed softmax budget and the linear state: (y, STILL's state after the call or None)."""
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
