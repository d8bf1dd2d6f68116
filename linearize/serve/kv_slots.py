"""A batched decode cache for softmax models and hybrids: one row per running request, every row stepped at once.

A softmax layer's decode state is its keys and values, which grow by one position a token, at a different
length in every request; a linearized layer's is a state of one fixed shape. `BatchedKVCache` keeps each
layer's own kind of rows in preallocated buffers, and each row's length both on the device (`lengths`,
which the step reads) and on the host (`host_lengths`, so that no step reads a number back from the device):

- a full-attention layer: keys and values [rows, KV heads, capacity, head dim], a row's position p at p;
- a sliding-window layer: the same, capped at the window W, a ring: position p at p mod W. Below W
  positions the ring has not wrapped and holds every position at its own index;
- a linearized layer of a hybrid: its state's tensors [rows, ...] (`state_rows.StateRowsLayer`).

    kv = BatchedKVCache(model)
    kv.load_row(row, prefill_cache, length)   # a batch-1 prefill (a DynamicCache) into row `row`
    logits = kv.step(model, tokens)           # tokens [n, 1] for rows 0..n-1: logits [n, 1, vocab]
    kv.clear_row(row)                         # or move_row(src, dst), to keep the rows in use at the front

A step calls the HF model directly. Each softmax layer's `update` writes the row's new key and value at
that row's own length (in its ring, for a sliding layer) and hands the attention the buffers cut to the
step's view, 1 + the longest row's length (at most W, for a sliding layer), so the cost of a step grows
with the longest running request, not with the capacity. The attention masks come ready made, 4D boolean
([n, 1, 1, view], which HF passes on as they are): a row sees the indices up to its new token's
position, which in a full layer are its positions so far and in a wrapped ring its last W positions
(softmax attention does not depend on the order of its keys: RoPE put the positions into them). Models
whose decoder takes one mask per layer type (Gemma 2 and 3, Qwen2 and 3) get a dict of them; the others
(Llama, Mistral, Phi-3, OLMo-2) one mask, the sliding one where their config's window applies to every
layer. A linearized layer steps its rows' states in place and reads no mask (`StateRowsLayer`).

During a step the model's attention runs `rows_attention`, registered with HF's `AttentionInterface`:
HF's own SDPA path copies the KV heads up to the query heads whenever it is given a mask (at the
Llama-3-8B shape, 4x the cache read a step). With one query token a row, the query heads sharing a
KV head fold into the query-length axis instead, so SDPA reads each cached key once. The scaling and
Gemma 2's logit soft-capping come from the layer, as HF's own attention takes them.

A sliding layer of a prefill keeps only its last window - 1 tokens (HF's `DynamicSlidingWindowLayer`):
`load_row` puts them in their ring's places, and the one left is the next token's.

The buffers grow by reallocation and copy, one tensor at a time: the rows straight to the limit given
(`set_limits`: what the engine's admission allowed), the capacity by doubling (a ring's up to W), and
neither beyond its limit. Rows that hold no request (`clear_row`) keep length 0 and, if stepped, see their position 0 only
(never an all-masked row, which SDPA would turn into NaN); their tokens mean nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin

from ..architectures import FULL, SLIDING, layer_types, sliding_window_of
from ..attention import LinearizedAttention
from .state_rows import StateRowsLayer

# A layer's kind of rows beside FULL and SLIDING (softmax): a linearized attention's state.
LINEAR = "linear"

# Decoders that take {"full_attention": mask, "sliding_attention": mask} (`causal_mask_mapping` in their
# modeling files), and those that take one mask for all layers. Other families: by whether their config
# lists layer types, HF's convention for the first kind.
MASK_PER_LAYER_TYPE = frozenset({"gemma2", "gemma3_text", "qwen2", "qwen3"})
ONE_MASK = frozenset({"llama", "mistral", "phi3", "olmo2"})


def masks_per_layer_type(config) -> bool:
    model_type = config.model_type.removeprefix("linearized_")
    if model_type in MASK_PER_LAYER_TYPE:
        return True
    if model_type in ONE_MASK:
        return False
    return getattr(config, "layer_types", None) is not None


def layer_kinds(model) -> list[str]:
    """Each decoder layer's kind of rows: LINEAR for a linearized attention, else its softmax type, FULL or
    SLIDING."""
    linear = {m.layer_idx for m in model.modules() if isinstance(m, LinearizedAttention)}
    return [LINEAR if i in linear else kind for i, kind in enumerate(layer_types(model.config))]


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


def kv_bytes_per_token(config, dtype: torch.dtype, layers: int | None = None) -> int:
    """Bytes of keys and values per token over `layers` softmax layers (None: every layer of the model)."""
    _, kv_heads, head_dim = _head_dims(config)
    layers = config.num_hidden_layers if layers is None else layers
    return 2 * layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def step_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Bytes per cached token that one layer's attention may work in during a step, beside the cache
    (SDPA's math path, on a device without a fused kernel for the shape, copies the cut keys and values)."""
    _, kv_heads, head_dim = _head_dims(config)
    return 2 * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


class _RowsLayer(CacheLayerMixin):
    """One softmax layer's buffers (a ring of `window` positions, for a sliding layer); its `update`
    writes through the owning `BatchedKVCache`."""

    def __init__(self, owner: BatchedKVCache, window: int | None):
        super().__init__()
        self.owner, self.window, self.is_sliding = owner, window, window is not None
        self.shape: tuple[int, int, torch.dtype] | None = None  # KV heads, head dim, dtype: from the first load

    @property
    def ready(self) -> bool:
        return self.shape is not None

    def size(self, capacity: int) -> int:
        """The positions this layer's buffers hold at `capacity`."""
        return capacity if self.window is None else min(capacity, self.window)

    def slots(self, positions: torch.Tensor) -> torch.Tensor:
        """Where `positions` sit in the buffers."""
        return positions if self.window is None else positions % self.window

    def check_source(self, source) -> None:
        if getattr(source, "keys", None) is None or source.keys.shape[0] != 1:
            raise ValueError("load_row needs a batch-1 prefilled cache of the same model, layer for layer")

    def learn_shapes(self, source) -> None:
        if self.shape is None:
            self.shape = (source.keys.shape[1], source.keys.shape[3], source.keys.dtype)

    def reallocate(self, rows: int, capacity: int) -> int:
        """New buffers [rows, KV heads, size, head dim], what fits of the old ones copied in, one tensor
        at a time (so the copy needs one old tensor beside the new buffers, not all of them); returns their
        bytes. A ring shrinks below its window only where no row has wrapped (capacity > every length)."""
        kv_heads, head_dim, dtype = self.shape
        size = self.size(capacity)
        nbytes = 0
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = torch.zeros(rows, kv_heads, size, head_dim, dtype=dtype, device=self.owner.device)
            if old is not None:
                r, c = min(rows, old.shape[0]), min(size, old.shape[2])
                new[:r, :, :c].copy_(old[:r, :, :c])
            setattr(self, name, None)
            del old
            setattr(self, name, new)
            nbytes += new.nbytes
        self.is_initialized = True
        return nbytes

    def load(self, row: int, source, length: int) -> None:
        kept = source.keys.shape[-2]
        if kept > length or (kept < length and not self.is_sliding):
            raise ValueError(f"a prefill of {length} tokens holds {kept} in a "
                             f"{'sliding' if self.is_sliding else 'full'} attention layer")
        slots = self.slots(torch.arange(length - kept, length, device=self.keys.device))
        self.keys[row].index_copy_(1, slots, source.keys[0].to(self.keys.device))
        self.values[row].index_copy_(1, slots, source.values[0].to(self.values.device))

    def move(self, source: int, target: int, length: int) -> None:
        n = self.size(length)  # a ring that has wrapped: all of it
        self.keys[target, :, :n].copy_(self.keys[source, :, :n])
        self.values[target, :, :n].copy_(self.values[source, :, :n])

    def drop(self) -> None:
        self.keys = self.values = None
        self.is_initialized = False

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise RuntimeError("BatchedKVCache allocates its buffers itself (load_row)")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return self.owner._write(self, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.size(self.owner._view), 0

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
    """The decode state of a softmax model's or a hybrid's running requests, one row each in every layer
    (see the module docstring)."""

    def __init__(self, model):
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"BatchedKVCache cannot step this model: {reason}")
        config = model.config
        self.types = layer_types(config)
        self.window = sliding_window_of(config)
        self.per_type = masks_per_layer_type(config)
        self.device = next(model.parameters()).device
        self.kinds = layer_kinds(model)
        super().__init__(layers=[StateRowsLayer(self.device, self.window) if kind == LINEAR
                                 else _RowsLayer(self, self.window if kind == SLIDING else None)
                                 for kind in self.kinds])
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

    @property
    def _ready(self) -> bool:
        """Whether the layers know their shapes (from the first prefill loaded)."""
        return self.layers[0].ready

    def _reallocate(self, rows: int, capacity: int) -> None:
        """New buffers of `rows` rows and `capacity` positions, layer by layer, what fits of the old ones
        copied in (`_RowsLayer.reallocate`, `StateRowsLayer.reallocate`)."""
        nbytes = sum(layer.reallocate(rows, capacity) for layer in self.layers)
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
        if not self._ready or not self.rows:
            return
        used_rows, used_capacity = self._floors()
        rows, capacity = _clamp(self.rows, used_rows, row_limit), _clamp(self.capacity, used_capacity, capacity_limit)
        if (rows, capacity) != (self.rows, self.capacity):
            self._reallocate(rows, capacity)

    def free(self) -> None:
        """Drop the buffers (every row with them)."""
        for layer in self.layers:
            layer.drop()
        self._resize_state(0)
        self.rows = self.capacity = self.nbytes = 0

    # Rows.

    @torch.no_grad()
    def load_row(self, row: int, cache, length: int) -> None:
        """Make row `row` hold a batch-1 prefill of `length` tokens (`cache`: a DynamicCache of the same
        model, whose sliding layers may keep only their last tokens): its next token sits at `length`."""
        sources = list(getattr(cache, "layers", []))
        if len(sources) != len(self.layers):
            raise ValueError("load_row needs a batch-1 prefilled cache of the same model, layer for layer")
        for layer, source in zip(self.layers, sources, strict=True):
            layer.check_source(source)
            layer.learn_shapes(source)
        self._ensure(row + 1, length + 1)
        for layer, source in zip(self.layers, sources, strict=True):
            layer.load(row, source, length)
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
            layer.move(source, target, n)
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
        for layer in self.layers:
            if isinstance(layer, StateRowsLayer):
                layer.begin_step(n, view - 1)
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
        rows, slots = self._index[:n], layer.slots(self.lengths[:n])
        layer.keys[rows, :, slots] = key_states[:, :, 0]
        layer.values[rows, :, slots] = value_states[:, :, 0]
        view = layer.size(self._view)
        return layer.keys[:n, :, :view], layer.values[:n, :, :view]

    def _masks(self, lengths: torch.Tensor, view: int):
        """The step's 4D masks [n, 1, 1, view] (view: at most the window, for a sliding layer's ring): a dict
        by layer type, or the one mask of a single-mask decoder. A row sees the indices up to its new
        token's position: all of a ring that has wrapped."""
        seen = torch.arange(view, device=self.device) <= lengths.view(-1, 1)
        masks = {}
        for kind in dict.fromkeys(self.types):
            size = view if kind == FULL else min(view, self.window)
            masks[kind] = seen[:, :size].view(-1, 1, 1, size)
        return masks if self.per_type else masks[self.types[0]]
