"""The gated delta-rule retrieval memory that a linearized attention may keep beside its own branches
(`memory="delta"` of Lizard and of STILL, docs/methods.md): its parameters, the op's form each call
takes, and its part of the decode state.

    S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T,    o_t = S_t^T q_t
    y_t = y_branches_t + mu_h * o_t

One state per query head, on the teacher's raw (pre-RoPE) q and k, L2-normalised inside the op
(`linearize.ops.delta_rule`): a key that names content wherever it stands. The read-out is signed and
unnormalised, so it joins the method's output as a separate weighted term, never inside a
softmax-style normaliser; at mu = 0 the output is the method's without the memory, exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from ..ops.delta_rule import DeltaRuleOptions, chunk_delta_rule, continue_delta_rule, delta_rule_step
from .base import Pass

# The memory's entry in the attention's state dict (and so in the decode cache): [B, H, d, d] float32.
MEMORY_STATE = "memory_S"


class DeltaMemory:
    """Mixin for a `LinearizedAttention` keeping the delta-rule memory. `add_delta_memory` puts on the
    attention module itself (checkpoints address them by these names):

      memory_write   Linear(hidden, H): the write strength b_t = sigmoid(W_b x_t + c), starting at
                     W_b = 0, c = 0 (b = 1/2: stage 1 learns which tokens to keep). The method lists it
                     LAST among its `input_projections` (it joins the fused decode GEMM there).
      memory_weight  [H]: mu_h, the read-out's weight in the output, from `memory_weight_init`.
      memory_decay   [H], only with a `decay_init` (a method without a scalar gate to decay by, or one
                     that gives the memory its own): the decay a_h = sigmoid(memory_decay_h), constant
                     over tokens, from `decay_init` (near 1).
    """

    memory_write: nn.Linear
    memory_weight: nn.Parameter

    def add_delta_memory(self, hidden_size: int, weight_init: float, decay_init: float | None = None) -> None:
        """The memory's parameters, one per head each; `decay_init` (in (0, 1)) adds `memory_decay`."""
        heads = self.num_heads
        self.memory_write = nn.Linear(hidden_size, heads)
        nn.init.zeros_(self.memory_write.weight)
        nn.init.zeros_(self.memory_write.bias)
        self.memory_weight = nn.Parameter(torch.full((heads,), weight_init))
        if decay_init is not None:
            self.memory_decay = nn.Parameter(torch.full((heads,), math.log(decay_init / (1.0 - decay_init))))

    def memory_head_scalars(self) -> list[nn.Parameter]:
        """The memory's parameters of one number per head (`head_scalars`)."""
        decay = [self.memory_decay] if hasattr(self, "memory_decay") else []
        return [self.memory_weight, self.memory_write.bias, *decay]

    def memory_log_decay(self, batch: int, length: int) -> torch.Tensor:
        """log a_t [B, H, L] from the learned per-head decay (`memory_decay`)."""
        log_a = nn.functional.logsigmoid(self.memory_decay.float())
        return log_a[None, :, None].expand(batch, -1, length)

    def attend_with_memory(self, branches: Callable, q, k, v, log_a, valid, state, call: Pass):
        """(y, new state) of the method's `branches(state without the memory) -> (y, state)` plus the
        memory's mu_h * o_t, on raw q [B, H, L, d], k, v [B, H_kv, L, d]; log_a [B, H, L] the decay.
        The state after the call carries the memory as MEMORY_STATE beside the branches' own entries."""
        memory_state = None if state is None else {"S": state[MEMORY_STATE]}
        rest = None if state is None else {name: t for name, t in state.items() if name != MEMORY_STATE}
        y, new_state = branches(rest)
        o, new_memory = self.memory_pass(q, k, v, log_a, valid, memory_state, call)
        y = y + self.memory_weight.to(o.dtype)[None, :, None, None] * o.to(y.dtype)
        if new_state is None or new_memory is None:
            return y, None
        return y, {**new_state, MEMORY_STATE: new_memory["S"]}

    def memory_pass(self, q, k, v, log_a, valid, state, call: Pass):
        """The memory in the form this call takes: one token after a carried state steps; more tokens
        after one, or a first pass that fills a cache without gradients, continue; any other first pass
        (training, scoring) is a chunked pass from an empty state. (o [B, H, L, d], new state or None)."""
        B, L = q.shape[0], q.shape[2]
        b = torch.sigmoid(self.projected[-1].float()).view(B, L, self.num_heads).transpose(1, 2)
        options = DeltaRuleOptions(chunk=self.cfg.chunk_size, eps=self.cfg.eps)
        padding = None if call.unpadded else valid
        if state is not None and L == 1:
            return delta_rule_step(q, k, v, log_a, b, state, options, valid=valid)
        if state is not None or (call.caching and not torch.is_grad_enabled()):
            return continue_delta_rule(q, k, v, log_a, b, state, options, valid=padding)
        return chunk_delta_rule(q, k, v, log_a, b, options, valid=padding, output_final_state=call.caching)
