"""The shared shell of every linearized attention: the teacher's projections, padding, cache, stage 1.

A subclass adds its small new modules and implements `attend(q, k, v, rope, valid, state, call)` on
float32 [B, H, L, d] queries and [B, H_kv, L, d] keys/values (in the projections' dtype where it sets
`native_operands`), returning (y, new_state); `call` (a `Pass`) holds what the call knows beyond its
tensors, and `attend` picks its op's form from it once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..architectures import architecture_of, sliding_window_of
from ..cache import claim_cache_layer
from ..ops.common import repeat_kv
from ..ops.features.naive import rotate
from .far_mass import far_mass, far_position_weights, weighted_mse


def token_validity(attention_mask, batch: int, length: int, device) -> torch.Tensor:
    """[B, L] bool, False for padding, read off whatever mask HF built for this layer.

    A 4D mask's last L columns are the current tokens, and each of them sees itself unless it is padding
    (left or right), in a causal mask and a sliding-window one alike: the diagonal of that block is the
    validity. Always contiguous: HF hands some calls a mask expanded over the batch, others not, and a compiled
    consumer (STILL's decode step) would recompile on the stride, inside a CUDA graph's capture too.
    """
    if attention_mask is None:
        return torch.ones(batch, length, dtype=torch.bool, device=device)
    if attention_mask.dim() == 2:
        return attention_mask[:, -length:].to(device=device, dtype=torch.bool)
    if attention_mask.dim() == 4:
        own = torch.diagonal(attention_mask[:, 0, -length:, -length:], dim1=-2, dim2=-1)
        keep = own if own.dtype == torch.bool else own == 0
        return keep.to(device).expand(batch, length).contiguous()
    raise TypeError(f"unsupported attention mask of shape {tuple(attention_mask.shape)}")


@dataclass(frozen=True)
class Pass:
    """What one call of a linearized attention knows beyond its tensors, found once in `forward`.

    start     tokens of the sequence before this call (the cache's count; 0 without a cache)
    caching   a cache will store the state after the call
    unpadded  every token is valid (no attention mask, or a cache that holds one unpadded sequence),
              known without reading the validity back from the device
    frozen    the cache keeps fixed-shape tensors, so a decode step may write its state in place
    dtype     the projections' output dtype (bf16 under autocast), in which the kernels take operands
    """

    start: int = 0
    caching: bool = False
    unpadded: bool = False
    frozen: bool = False
    dtype: torch.dtype = torch.float32


class LinearizedAttention(nn.Module):
    """Drop-in replacement for the attention module of any `linearize.architectures` teacher (same call
    signature), forming q, k and v as the teacher does: its projections, q/k norms and query scaling."""

    # True: `attend` takes q, k, v as the projections give them (bf16 under autocast) and casts what
    # its own PyTorch path needs; its kernels then read them without a float32 copy in between.
    native_operands = False

    def __init__(self, teacher: nn.Module, cfg, model_config):
        super().__init__()
        self.cfg = cfg
        self.layer_idx = teacher.layer_idx
        self.head_dim = teacher.head_dim
        self.num_heads = model_config.num_attention_heads
        self.num_kv_heads = model_config.num_key_value_heads
        arch = architecture_of(model_config)
        self.scaling = teacher.scaling
        # Gemma 2 caps the teacher's logits at +-softcap (tanh); the stage-1 target keeps that.
        self.softcap = getattr(teacher, "attn_logit_softcapping", None)
        # The teacher's sliding window, where it has sliding layers: this layer's cache sizes the masks
        # HF builds off it for them (`cache.LinearizeCacheLayer.mask_window`).
        self.mask_window = sliding_window_of(model_config)
        if arch.fused_qkv:
            self.q_proj, self.k_proj, self.v_proj = split_linear(
                teacher.qkv_proj, [self.num_heads * self.head_dim] + [self.num_kv_heads * self.head_dim] * 2)
        else:
            self.q_proj, self.k_proj, self.v_proj = teacher.q_proj, teacher.k_proj, teacher.v_proj
        self.o_proj = teacher.o_proj
        self.qk_norm = arch.qk_norm
        if arch.qk_norm != "none":
            self.q_norm, self.k_norm = teacher.q_norm, teacher.k_norm
        # Stage 1: return the teacher's softmax output (so the next layer sees teacher hidden states)
        # and keep the MSE of our own output against it: the first of each step (`stage_loss` clears it).
        self.attention_transfer = False
        self.transfer_loss: torch.Tensor | None = None
        # Stage 1: DistillConfig.far_weight (`train.student.prepare_stage` sets it). Above 0, each position's
        # squared error is weighted by how much of the teacher's attention lies beyond `softmax_reach`
        # (`far_mass`); 0: every position counts alike, `mse_loss` itself.
        self.far_weight = 0.0
        # Stage 1: q and k with RoPE as `attend` computed them for its own use (`keep_rotated`); the
        # target starts from them instead of rotating again (~10 kernels a layer and step).
        self.rotated: tuple[torch.Tensor, torch.Tensor] | None = None
        # q, k, v (and `input_projections`) as one GEMM while decoding (`linearize.fused_projections`);
        # None: separate GEMMs. `projected`: this call's outputs of the `input_projections`, in order.
        self.fused_qkv = None
        self.projected: tuple[torch.Tensor, ...] = ()

    def new_parameters(self) -> list[nn.Parameter]:
        """Parameters this method adds on top of the teacher's projections."""
        inherited = {id(p) for m in self.teacher_modules() for p in m.parameters()}
        return [p for p in self.parameters() if id(p) not in inherited]

    def teacher_modules(self) -> list[nn.Module]:
        """The teacher's modules this attention keeps: projections and, where it has them, q/k norms."""
        norms = [self.q_norm, self.k_norm] if self.qk_norm != "none" else []
        return [self.q_proj, self.k_proj, self.v_proj, self.o_proj, *norms]

    def input_projections(self) -> list[nn.Linear]:
        """The method's own Linear layers on the attention input (a gate's): computed beside q, k and v,
        from the same input, in the same precision (bf16 under autocast, as a bf16 model decodes), and
        fused into their GEMM while decoding. `attend` finds their outputs in `self.projected`."""
        return []

    def head_scalars(self) -> list[nn.Parameter]:
        """New parameters with a few numbers per head (mixing weights, sinks, gate biases): see
        `DistillConfig.head_lr_scale`."""
        return []

    def _add_feature_maps(self, feature_map_class, feature_dim: int | None) -> None:
        """Separate q and k maps; f defaults to head_dim / 2, so phi has head_dim features."""
        f = feature_dim or self.head_dim // 2
        self.feature_map_q = feature_map_class(self.num_heads, self.head_dim, f)
        self.feature_map_k = feature_map_class(self.num_heads, self.head_dim, f)
        self.features = 2 * f

    def _param_like(self, module: nn.Module) -> nn.Module:
        weight = self.q_proj.weight
        return module.to(device=weight.device, dtype=weight.dtype)

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, **kwargs):
        B, L, _ = hidden_states.shape
        shape = (B, L, -1, self.head_dim)
        device_type = hidden_states.device.type
        autocast = torch.is_autocast_enabled(device_type)
        # Under autocast each projection would cast the (float32) hidden states again: cast them once.
        x = hidden_states.to(torch.get_autocast_dtype(device_type)) if autocast else hidden_states
        extra = self.input_projections()
        if self.fused_qkv is not None:
            *projected, fused = self.fused_qkv.split(x, 3)
            extra = extra[len(fused):]  # those the fused GEMM left out (another dtype) follow its own
        else:
            projected, fused = (self.q_proj(x), self.k_proj(x), self.v_proj(x)), ()
        # Under autocast a Linear casts for itself; else an odd dtype (a gate kept in float32) gets its own.
        self.projected = fused + tuple(m(x if autocast else x.to(m.weight.dtype)) for m in extra)
        if self.qk_norm == "projection":
            projected = (self.q_norm(projected[0]), self.k_norm(projected[1]), projected[2])
        q, k, v = (t.view(shape).transpose(1, 2) for t in projected)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        cache = (claim_cache_layer(past_key_values, self.layer_idx, self.mask_window)
                 if past_key_values is not None else None)
        # A cache of unpadded sequences makes every token valid, whatever the mask (which may be sized
        # for other layers' keys: `linearize.serve.state_rows`).
        unpadded = cache is not None and cache.unpadded
        valid = token_validity(None if unpadded else attention_mask, B, L, hidden_states.device)
        # A layer that has seen no token holds no sequence's state (a fixed-shape cache reset for a new
        # sequence keeps its tensors): the call takes the fresh path.
        state = cache.state if cache is not None and cache.seen else None
        call = Pass(start=cache.seen if cache is not None else 0, caching=cache is not None,
                    unpadded=attention_mask is None or unpadded,
                    frozen=cache is not None and cache.frozen, dtype=q.dtype)
        # The attention math runs in float32 even under autocast: cumulative log decays and exp-weights
        # lose too much in bf16.
        operands = (q, k, v) if self.native_operands else (q.float(), k.float(), v.float())
        with torch.autocast(device_type=device_type, enabled=False):
            y, new_state = self.attend(*operands, position_embeddings, valid, state, call)
        self.projected = ()  # held past the call, a STILL gate's [B, L, H d] would outlive its use
        if cache is not None:
            cache.store(new_state, L)
        y = y.transpose(1, 2).reshape(B, L, -1)
        # Under autocast o_proj casts y itself; a cast to the float32 residual dtype first would be undone.
        out = self.o_proj(y if autocast else y.to(hidden_states.dtype))

        if self.attention_transfer:
            with torch.no_grad():
                q, k = self.teacher_query_keys(q, k, v.dtype, position_embeddings)
                target = self.softmax_attention(q, k, v, attention_mask)
                weights = self.far_position_weights(q, k, attention_mask) if self.far_weight else None
            # In the outputs' dtype: mse_loss squares and sums in float32 either way (its gradient too);
            # float32 copies of both [B, L, hidden] outputs cost ~4% of a bf16 stage-1 step. The value
            # itself is then rounded to bf16 (~0.2%).
            loss = nn.functional.mse_loss(out, target) if weights is None else weighted_mse(out, target, weights)
            # Activation checkpointing runs this forward again in the backward: a loss kept from that
            # run would hold the recomputed activations of every layer until the next step (at the 8B
            # shape, ~2 GiB a layer). The recomputation must still form it: its saved tensors are the
            # ones the backward asks for.
            if self.transfer_loss is None:
                self.transfer_loss = loss
            return target, None
        return out, None

    def keep_rotated(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`attend` passes its RoPE'd q [B, H, L, d] and k [B, H_kv, L, d] through here: in stage 1 the
        target reuses them. Rotated in float32 (the PyTorch ops on float32 operands, or the features
        kernel), as HF's teacher rotates its bf16 projections against float32 cos and sin."""
        if self.attention_transfer:
            self.rotated = (q, k)
        return q, k

    def teacher_query_keys(self, q, k, dtype: torch.dtype, position_embeddings) -> tuple[torch.Tensor, torch.Tensor]:
        """The teacher's q and k with RoPE, in `dtype` (the values'): those `attend` kept (`keep_rotated`),
        else rotated here from the projections."""
        if self.rotated is not None:
            q, k = (t.to(dtype) for t in self.rotated)
            self.rotated = None
            return q, k
        return rotate(q, k, position_embeddings)

    def softmax_reach(self) -> int:
        """How many of the most recent keys (the query's own among them) this method attends with exact
        softmax: its window (`cfg.window`; STILL's recent slots, not its salient ones, which hold no fixed
        positions). 0 for a method without a window: every key then counts as far, so `far_weight`
        weights all positions alike."""
        return getattr(self.cfg, "window", 0)

    def far_position_weights(self, q, k, attention_mask) -> torch.Tensor:
        """[B, L] stage-1 loss weights (`far_position_weights`) from the teacher's rotated q and k: its
        attention mass beyond `softmax_reach`, averaged over heads."""
        L = q.shape[2]
        allowed = None
        if attention_mask is not None:
            mask = attention_mask[..., -L:].to(q.device)
            allowed = mask if mask.dtype == torch.bool else mask == 0
        far = far_mass(q, k, scale=self.scaling, reach=self.softmax_reach(), softcap=self.softcap, allowed=allowed)
        return far_position_weights(far, self.far_weight)

    def softmax_attention(self, q, k, v, attention_mask) -> torch.Tensor:
        """The teacher's own attention output, from its rotated q and k (`teacher_query_keys`) and v."""
        B, _, L, _ = q.shape
        if self.softcap is not None:
            y = softcapped_attention(q, k, v, attention_mask, self.scaling, self.softcap)
        elif attention_mask is None:
            # As HF's SDPA attention runs the teacher without a mask: the KV heads shared in the kernel,
            # not repeated in memory first (two [B, H, L, d] copies a layer).
            y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scaling,
                                                           enable_gqa=self.num_heads != self.num_kv_heads)
        else:
            n_rep = self.num_heads // self.num_kv_heads
            k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
            mask = attention_mask[..., -L:]
            # Rows of padding see no key: NaN.
            y = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.device), scale=self.scaling)
            y = y.nan_to_num(0.0)
        return self.o_proj(y.transpose(1, 2).reshape(B, L, -1))

    def attend(self, q, k, v, position_embeddings, valid, state, call: Pass):
        raise NotImplementedError


def split_linear(fused: nn.Linear, sizes: list[int]) -> tuple[nn.Linear, ...]:
    """Separate Linear layers holding (copies of) consecutive row blocks of `fused`."""
    biases = fused.bias.split(sizes) if fused.bias is not None else [None] * len(sizes)
    parts = []
    for weight, bias in zip(fused.weight.split(sizes), biases, strict=True):
        part = nn.Linear(fused.in_features, weight.shape[0], bias=bias is not None, device=weight.device,
                         dtype=weight.dtype)
        with torch.no_grad():
            part.weight.copy_(weight)
            if bias is not None:
                part.bias.copy_(bias)
        parts.append(part)
    return tuple(parts)


def softcapped_attention(q, k, v, attention_mask, scale: float, softcap: float) -> torch.Tensor:
    """Causal softmax attention over logits capped as Gemma 2 caps them, softcap * tanh(s / softcap):
    [B, H, L, d] queries, [B, H_kv, L, d] keys and values. SDPA has no cap, so this is the eager form."""
    L = q.shape[2]
    n_rep = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    logits = softcap * torch.tanh((q @ k.transpose(-1, -2)) * scale / softcap)
    if attention_mask is None:
        allowed = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
    else:
        mask = attention_mask[..., -L:].to(q.device)
        allowed = mask if mask.dtype == torch.bool else mask == 0
    weights = torch.softmax(logits.float().masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)
    return weights.to(v.dtype) @ v
