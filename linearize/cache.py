"""A cache layer holding a linearized attention's fixed-size state, inside any HF `Cache`.

transformers 5.17 ships `LinearAttentionLayer` (recurrent states only) and
`LinearAttentionAndSlidingWindowAttentionLayer` (states plus a sliding KV window). We don't use them
because (1) a causal LM made only of `LinearAttentionLayer`s cannot build its attention mask
(`Cache.get_mask_sizes` needs an attention layer), and (2) the sliding layer keeps keys and values
only, while left padding needs per-slot validity and STILL needs per-slot scores, routing flags and
salient slots. So each method keeps a dict of fixed-shape tensors here, and this layer answers the
cache API (sequence length, mask sizes, beam reordering) for it.

HF builds the cache (`DynamicCache(config=...)`) from the teacher's config before any layer runs;
each linearized layer claims its own slot on first use (`claim_cache_layer`), while softmax layers of
a hybrid keep HF's `DynamicLayer`. So `generate`, user-made `DynamicCache`s and beam search all work.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


def compact(t: torch.Tensor) -> torch.Tensor:
    """`t`, or a copy of it when it is a view into a larger storage."""
    return t.clone() if t.untyped_storage().nbytes() > t.numel() * t.element_size() else t


class LinearizeCacheLayer(CacheLayerMixin):
    # Sized masks cover only the current tokens: the layer reads their validity off the mask's
    # last row and keeps the validity of older tokens in its own state.
    is_sliding = True
    is_compileable = False
    supports_early_init = False

    def __init__(self, mask_window: int | None = None, **kwargs):
        super().__init__()
        # HF sizes a mask off the first cache layer of its type: this one too, so where the teacher has
        # sliding-window layers (`mask_window`, their window) this layer answers as HF's sliding layer
        # would, and a mask made off it fits a softmax sliding layer of a hybrid as well. The
        # linearized layers read only the mask's last columns, the current tokens.
        self.mask_window = mask_window
        self.state: dict[str, torch.Tensor] | None = None
        self.seen = 0
        self.frozen = False
        # Set on the cache of one sequence that is never padded (`linearize.prefill.StaticPrefill`): every
        # token is valid whatever mask HF builds, so nothing is read back from the device to check it
        # (which a CUDA graph's capture would refuse).
        self.unpadded = False

    def freeze(self) -> None:
        """From now on `store` writes into the current state's tensors (fixed addresses, for CUDA graphs)."""
        if self.state is None:
            raise ValueError("freeze() needs a state: run the prefill first")
        self.frozen = True

    def lazy_initialization(self, *args, **kwargs) -> None:
        return None

    def update(self, *args, **kwargs):
        raise TypeError("a linearized attention layer stores its state with `store`, not key/value `update`")

    def store(self, state: dict[str, torch.Tensor], new_tokens: int) -> None:
        if self.frozen:
            for name, tensor in self.state.items():
                if state[name].shape != tensor.shape:
                    raise ValueError(f"a frozen cache layer cannot change shape ({name}: {tuple(tensor.shape)} -> "
                                     f"{tuple(state[name].shape)})")
                if state[name] is not tensor:  # the step kernels write a frozen state in place
                    tensor.copy_(state[name])
        else:
            # A window slice of a prefill chunk's keys/values is a view that would keep the whole chunk alive.
            self.state = {name: compact(t) for name, t in state.items()}
        self.seen += new_tokens
        self.is_initialized = True

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self.mask_window is None:
            return query_length, self.seen
        kept = min(self.seen, self.mask_window - 1)  # the keys HF's sliding layer keeps
        return kept + query_length, self.seen - kept

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def nbytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in (self.state or {}).values())

    def _map(self, fn) -> None:
        self.frozen = False  # new tensors: whatever captured the old addresses no longer applies
        if self.state is not None:
            self.state = {name: fn(t) for name, t in self.state.items()}

    def reset(self) -> None:
        self.state = None
        self.seen = 0
        self.frozen = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map(lambda t: t[indices])

    def offload(self) -> None:
        self._map(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self) -> None:
        return None

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a linear-attention state cannot be rolled back (no assisted/speculative decoding)")


def claim_cache_layer(cache: Cache, layer_idx: int, mask_window: int | None = None) -> LinearizeCacheLayer:
    """This layer's `LinearizeCacheLayer` in `cache`, replacing the empty placeholder HF put there
    (`mask_window`: see `LinearizeCacheLayer`)."""
    layers = cache.layers
    if layer_idx < len(layers) and isinstance(layers[layer_idx], LinearizeCacheLayer):
        return layers[layer_idx]
    if layer_idx < len(layers):
        if layers[layer_idx].get_seq_length() > 0:
            raise ValueError(f"cache layer {layer_idx} already holds softmax keys/values; use a fresh cache")
    else:
        while len(layers) < layer_idx:
            layers.append(cache.layer_class_to_replicate())
        layers.append(None)
    layers[layer_idx] = LinearizeCacheLayer(mask_window)
    return layers[layer_idx]


def compact_softmax_layers(cache: Cache) -> None:
    """Copy out the keys and values that HF's softmax cache layers hold as views of larger tensors.

    HF's sliding-window layer keeps its last window - 1 tokens as a slice of the whole call's keys, so
    after a prefill call of 16K tokens all 16K tokens' keys stay allocated until the next call replaces
    them, and a decode's first step carries them (a constant-memory decode would look as if it grew with
    the prompt). Call it after a prefill; full layers' keys are whole tensors and stay as they are."""
    for layer in cache.layers:
        if not isinstance(layer, LinearizeCacheLayer) and getattr(layer, "keys", None) is not None:
            layer.keys, layer.values = compact(layer.keys), compact(layer.values)


def cache_nbytes(cache: Cache) -> int:
    """Bytes held by a cache: linearized states plus any softmax keys/values of hybrid layers, counted as
    the memory their tensors keep allocated (a view keeps its whole storage)."""
    total = 0
    for layer in cache.layers:
        if isinstance(layer, LinearizeCacheLayer):
            total += layer.nbytes()
        elif getattr(layer, "keys", None) is not None:
            total += layer.keys.untyped_storage().nbytes() + layer.values.untyped_storage().nbytes()
    return total
