"""A batched KV cache for softmax models: one row per running request, every row stepped at once.

A softmax model's decode state is its keys and values, which grow by one position a token, at a different
length in every request. `BatchedKVCache` keeps them per layer in preallocated buffers
[rows, KV heads, capacity, head dim], and each row's length both on the device (`lengths`, which the step
reads) and on the host (`host_lengths`, so that no step reads a number back from the device):

    kv = BatchedKVCache(model)
    kv.load_row(row, prefill_cache, length)   # a batch-1 prefill (a DynamicCache) into row `row`
    logits = kv.step(model, tokens)           # tokens [n, 1] for rows 0..n-1: logits [n, 1, vocab]
    kv.clear_row(row)                         # or move_row(src, dst), to keep the rows in use at the front

A step calls the HF model directly. Each layer's `update` writes the row's new key and value at that row's
own length and hands the attention the buffers cut to `view` = 1 + the longest row's length, so the cost
of a step grows with the longest running request, not with the capacity. The attention masks come ready
made, 4D boolean ([n, 1, 1, view], which HF passes on as they are): a row sees its positions up to and
including the new token's, and a sliding-window layer only the last `window` of them. Models whose
decoder takes one mask per layer type (Gemma 2 and 3, Qwen2 and 3) get a dict of them; the others
(Llama, Mistral, Phi-3, OLMo-2) one mask, the sliding one where their config's window applies to every
layer.

During a step the model's attention runs `rows_attention`, registered with HF's `AttentionInterface`:
HF's own SDPA path copies the KV heads up to the query heads whenever it is given a mask (at the
Llama-3-8B shape, 4x the cache read a step). With one query token a row, the query heads sharing a
KV head fold into the query-length axis instead, so SDPA reads each cached key once. The scaling and
Gemma 2's logit soft-capping come from the layer, as HF's own attention takes them.

A sliding layer of a prefill keeps only its last window - 1 tokens (HF's `DynamicSlidingWindowLayer`):
`load_row` puts them at their true positions, and the positions before them, which no sliding mask
reaches, keep whatever they held. Every layer has the full capacity, sliding or not.

The buffers grow by reallocation and copy, one tensor at a time: the rows straight to the limit given
(`set_limits`: what the engine's admission allowed), the capacity by doubling, and neither beyond its
limit. Rows that hold no request (`clear_row`) keep length 0 and, if stepped, see their position 0 only
(never an all-masked row, which SDPA would turn into NaN); their tokens mean nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin

from ..architectures import FULL, SLIDING, layer_types, sliding_window_of

# Decoders that take {"full_attention": mask, "sliding_attention": mask} (`causal_mask_mapping` in their
# modeling files), and those that take one mask for all layers. Other families: by whether their config
# lists layer types, HF's convention for the first kind.
MASK_PER_LAYER_TYPE = frozenset({"gemma2", "gemma3_text", "qwen2", "qwen3"})
ONE_MASK = frozenset({"llama", "mistral", "phi3", "olmo2"})


def masks_per_layer_type(config) -> bool:
    model_type = config.model_type
    if model_type in MASK_PER_LAYER_TYPE:
        return True
    if model_type in ONE_MASK:
        return False
    return getattr(config, "layer_types", None) is not None


def unsupported_reason(model) -> str | None:
    """Why `BatchedKVCache` cannot step this model; None if it can."""
    config = model.config
    if not masks_per_layer_type(config) and len(set(layer_types(config))) > 1:
        return "its layers mix full and sliding attention but its decoder takes a single mask"
    return None


def rows_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None, **kwargs):
    """A decode step's attention over the rows' cached keys, for HF's attention modules: `query` [n, heads,
    1, head dim], `key`/`value` [n, KV heads, view, head dim], `attention_mask` boolean [n, 1, 1, view]
    (True: attend). Returns ([n, 1, heads, head dim], None), as HF's attention functions do."""
    n, heads, q_len, head_dim = query.shape
    kv_heads = key.shape[1]
    # HF's grouping: query head h reads KV head h // (heads / KV heads).
    grouped = query.reshape(n, kv_heads, heads // kv_heads * q_len, head_dim)
    if softcap is None:
        out = F.scaled_dot_product_attention(grouped, key, value, attn_mask=attention_mask, scale=scaling)
    else:
        scores = torch.matmul(grouped, key.transpose(-1, -2)) * (scaling if scaling is not None else head_dim ** -0.5)
        scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~attention_mask, float("-inf"))
        out = torch.matmul(scores.softmax(-1, dtype=torch.float32).to(value.dtype), value)
    return out.reshape(n, heads, q_len, head_dim).transpose(1, 2).contiguous(), None


ROWS_ATTENTION = "linearize_kv_rows"
AttentionInterface.register(ROWS_ATTENTION, rows_attention)


def _head_dims(config) -> tuple[int, int, int]:
    """(query heads, KV heads, head dim) from the config."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return heads, kv_heads, head_dim


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Bytes of keys and values per token over all layers (each at full capacity, sliding or not)."""
    _, kv_heads, head_dim = _head_dims(config)
    return 2 * config.num_hidden_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def step_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Bytes per cached token that one layer's attention may work in during a step, beside the cache
    (SDPA's math path, on a device without a fused kernel for the shape, copies the cut keys and values)."""
    _, kv_heads, head_dim = _head_dims(config)
    return 2 * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


class _RowsLayer(CacheLayerMixin):
    """One layer's buffers; its `update` writes through the owning `BatchedKVCache`."""

    def __init__(self, owner: BatchedKVCache, sliding: bool):
        super().__init__()
        self.owner, self.is_sliding = owner, sliding

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise RuntimeError("BatchedKVCache allocates its buffers itself (load_row)")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return self.owner._write(self, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner._view, 0

    def get_seq_length(self) -> int:
        return max(self.owner.host_lengths, default=0)

    def get_max_length(self) -> int:
        return -1


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _clamp(value: int, low: int, high: int | None) -> int:
    """`value` within [low, high], `low` winning (a limit never takes what is in use)."""
    return max(low, value if high is None else min(value, high))


class BatchedKVCache(Cache):
    """The keys and values of a softmax model's running requests, one row each (see the module docstring)."""

    def __init__(self, model):
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"BatchedKVCache cannot step this model: {reason}")
        config = model.config
        self.types = layer_types(config)
        self.window = sliding_window_of(config)
        self.per_type = masks_per_layer_type(config)
        self.device = next(model.parameters()).device
        super().__init__(layers=[_RowsLayer(self, t == SLIDING) for t in self.types])
        self.shapes: list[tuple[int, int]] | None = None  # (KV heads, head dim) per layer, from the first prefill
        self.kv_dtype: torch.dtype | None = None
        self.rows = self.capacity = 0
        self.limits: tuple[int | None, int | None] = (None, None)
        self.nbytes = 0
        self._view = 0
        self._resize_state(0)

    # Bookkeeping.

    def set_limits(self, rows: int | None, capacity: int | None) -> None:
        """The most rows and positions the buffers may grow to (None: no limit)."""
        self.limits = (rows, capacity)

    def _resize_state(self, rows: int) -> None:
        keep = min(rows, self.rows)
        lengths = torch.zeros(rows, dtype=torch.long, device=self.device)
        active = torch.zeros(rows, dtype=torch.long, device=self.device)
        if keep:
            lengths[:keep] = self.lengths[:keep]
            active[:keep] = self._active[:keep]
        self.lengths, self._active = lengths, active
        old_lengths, old_used = getattr(self, "host_lengths", []), getattr(self, "used", [])
        self.host_lengths = (old_lengths[:keep] + [0] * rows)[:rows]
        self.used = (old_used[:keep] + [False] * rows)[:rows]
        self._index = torch.arange(rows, device=self.device)

    def _floors(self) -> tuple[int, int]:
        """The fewest rows and positions that keep every loaded row whole (and let it take one more token)."""
        rows = max((i + 1 for i, used in enumerate(self.used) if used), default=0)
        return rows, max(self.host_lengths, default=0) + 1

    def _reallocate(self, rows: int, capacity: int) -> None:
        """New buffers [rows, KV heads, capacity, head dim], what fits of the old ones copied in, one
        tensor at a time (so the copy needs one old tensor beside the new buffers, not all of them)."""
        nbytes = 0
        for layer, (kv_heads, head_dim) in zip(self.layers, self.shapes, strict=True):
            for name in ("keys", "values"):
                old = getattr(layer, name)
                new = torch.zeros(rows, kv_heads, capacity, head_dim, dtype=self.kv_dtype, device=self.device)
                if old is not None:
                    r, c = min(rows, old.shape[0]), min(capacity, old.shape[2])
                    new[:r, :, :c].copy_(old[:r, :, :c])
                setattr(layer, name, None)
                del old
                setattr(layer, name, new)
                nbytes += new.nbytes
            layer.is_initialized = True
        self._resize_state(rows)
        self.rows, self.capacity, self.nbytes = rows, capacity, nbytes

    def _ensure(self, rows_needed: int, capacity_needed: int) -> None:
        """Grow the buffers, if they are short of `rows_needed` rows or `capacity_needed` positions: rows to
        the row limit, capacity by doubling, neither beyond its limit (nor below what is in use)."""
        if rows_needed <= self.rows and capacity_needed <= self.capacity:
            return
        row_limit, capacity_limit = self.limits
        rows, capacity = self.rows, self.capacity
        if rows_needed > rows:
            rows = max(rows_needed, row_limit if row_limit is not None else 2 * rows)
        if capacity_needed > capacity:
            capacity = max(_next_power_of_two(capacity_needed), 2 * capacity, 16)
        used_rows, used_capacity = self._floors()
        self._reallocate(_clamp(rows, max(rows_needed, used_rows), row_limit),
                         _clamp(capacity, max(capacity_needed, used_capacity), capacity_limit))

    def fit(self) -> None:
        """Shrink the buffers to the limits where they have outgrown them (requests that needed them have
        left), keeping what is in use."""
        row_limit, capacity_limit = self.limits
        if self.shapes is None or not self.rows:
            return
        used_rows, used_capacity = self._floors()
        rows, capacity = _clamp(self.rows, used_rows, row_limit), _clamp(self.capacity, used_capacity, capacity_limit)
        if (rows, capacity) != (self.rows, self.capacity):
            self._reallocate(rows, capacity)

    def free(self) -> None:
        """Drop the buffers (every row with them)."""
        for layer in self.layers:
            layer.keys = layer.values = None
            layer.is_initialized = False
        self._resize_state(0)
        self.rows = self.capacity = self.nbytes = 0

    # Rows.

    @torch.no_grad()
    def load_row(self, row: int, cache, length: int) -> None:
        """Make row `row` hold a batch-1 prefill of `length` tokens (`cache`: a DynamicCache of the same
        model, whose sliding layers may keep only their last tokens): its next token sits at `length`."""
        sources = list(getattr(cache, "layers", []))
        if len(sources) != len(self.layers) or any(s.keys is None or s.keys.shape[0] != 1 for s in sources):
            raise ValueError("load_row needs a batch-1 prefilled cache of the same model, layer for layer")
        if self.shapes is None:
            self.shapes = [(s.keys.shape[1], s.keys.shape[3]) for s in sources]
            self.kv_dtype = sources[0].keys.dtype
        self._ensure(row + 1, length + 1)
        for layer, source in zip(self.layers, sources, strict=True):
            kept = source.keys.shape[-2]
            if kept > length or (kept < length and not layer.is_sliding):
                raise ValueError(f"a prefill of {length} tokens holds {kept} in a "
                                 f"{'sliding' if layer.is_sliding else 'full'} attention layer")
            layer.keys[row, :, length - kept:length].copy_(source.keys[0])
            layer.values[row, :, length - kept:length].copy_(source.values[0])
        self.lengths[row] = length
        self._active[row] = 1
        self.host_lengths[row], self.used[row] = length, True

    def clear_row(self, row: int) -> None:
        """Row `row` holds no request any more: length 0, and steps leave its length there."""
        self.lengths[row] = 0
        self._active[row] = 0
        self.host_lengths[row], self.used[row] = 0, False

    @torch.no_grad()
    def move_row(self, source: int, target: int) -> None:
        """Row `source`'s request into row `target` (whose own is dropped); `source` is cleared."""
        n = self.host_lengths[source]
        for layer in self.layers:
            layer.keys[target, :, :n].copy_(layer.keys[source, :, :n])
            layer.values[target, :, :n].copy_(layer.values[source, :, :n])
        self.lengths[target] = self.lengths[source]
        self._active[target] = self._active[source]
        self.host_lengths[target], self.used[target] = n, self.used[source]
        self.clear_row(source)

    # The step.

    @torch.no_grad()
    def step(self, model, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token to each of rows 0..n-1 (`tokens` [n, 1]); returns the logits [n, 1, vocab]. Rows
        in use move one position on; the others stay at length 0."""
        n = tokens.shape[0]
        if not 0 < n <= self.rows:
            raise ValueError(f"a step takes 1 to {self.rows} rows (those allocated), got {n}")
        view = 1 + max(self.host_lengths[:n])
        self._ensure(n, view)
        self._view = view
        lengths = self.lengths[:n]
        config = model.config
        implementation = config._attn_implementation
        config._attn_implementation = ROWS_ATTENTION
        try:
            out = model(input_ids=tokens, past_key_values=self, attention_mask=self._masks(lengths, view),
                        position_ids=lengths.view(-1, 1), use_cache=True, logits_to_keep=1)
        finally:
            config._attn_implementation = implementation
        lengths += self._active[:n]
        for i in range(n):
            if self.used[i]:
                self.host_lengths[i] += 1
        return out.logits

    def _write(self, layer: _RowsLayer, key_states: torch.Tensor, value_states: torch.Tensor):
        """A layer's new keys and values ([n, KV heads, 1, head dim]) at each row's own length; returns its
        buffers cut to the step's view."""
        n = key_states.shape[0]
        if key_states.shape[2] != 1:
            raise ValueError("BatchedKVCache steps one token per row; prefill on a DynamicCache, then load_row")
        rows, positions = self._index[:n], self.lengths[:n]
        layer.keys[rows, :, positions] = key_states[:, :, 0]
        layer.values[rows, :, positions] = value_states[:, :, 0]
        return layer.keys[:n, :, :self._view], layer.values[:n, :, :self._view]

    def _masks(self, lengths: torch.Tensor, view: int):
        """The step's 4D masks [n, 1, 1, view]: a dict by layer type, or the one mask of a single-mask decoder."""
        positions = torch.arange(view, device=self.device)
        last = lengths.view(-1, 1)  # each row's new token
        full = positions <= last
        masks = {}
        for kind in dict.fromkeys(self.types):
            mask = full if kind == FULL else full & (positions > last - self.window)
            masks[kind] = mask.view(-1, 1, 1, view)
        return masks if self.per_type else masks[self.types[0]]
