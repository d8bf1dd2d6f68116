"""Prefix caching: the prefilled caches of prompt prefixes, kept so that a later prompt that starts with one
of them prefills only the rest.

A snapshot is a copy of a batch-1 prefill's cache after the first n tokens of a prompt, layer by layer,
whatever the model (`take_snapshot`; `restored_cache` builds a prefill cache from it as if it had
prefilled those n tokens):

- a linearized layer: its state, every `LinearizeCacheLayer.state` tensor (recurrent state, window ring,
  validity, scores), of one size whatever n is;
- a sliding-window softmax layer: the keys and values HF's sliding layer keeps (the last window - 1
  positions), at most a window's worth;
- a full softmax layer: the keys and values of all n positions, so its bytes grow with the prefix.

A state cannot be cut back to a shorter prefix, and a sliding layer's keys of the positions before its
window are gone, so a snapshot is kept only at the length it was taken at: the block boundaries
(multiples of `block` tokens) that a prefill call ends on. (A full layer's keys could be cut back, and
shared between the snapshots of one prompt; they are copied whole instead, one code path for every kind
of layer.)

The snapshots hang in a tree of blocks: each node is one more block of tokens, its children keyed by the
next block's tokens (exact keys, so two prefixes never share a node by a hash collision), and a node holds
a snapshot or only leads to deeper ones. A flat map of chained block hashes (vLLM's) finds the longest
cached prefix as well, but the tree also tells how far a prompt follows any cached prompt's tokens past its
last snapshot: there another prompt with the same start went on differently (a shared system prompt, most
often), and the engine ends a prefill call there so that the state at that point is kept too.

Memory, in two tiers, each a least-recently-used order of whole snapshots counted by their bytes (every
tensor of every layer, a full layer's growing with its prefix):

- the device tier, on the model's device, within `budget_bytes`: what a lookup restores from;
- the host tier, in CPU memory, within `host_budget_bytes` (0: none): a snapshot the device tier pushes out
  moves there if it fits (into pinned memory when it came from CUDA, so that the copy back is
  asynchronous), pushing out the host tier's least recently used for good. A lookup whose longest cached
  prefix is on the host moves it back to its device as the most recently used there, which may move
  others to the host (never the one coming back).

A snapshot dropped for good takes with it the nodes that lead to no other one. Token keys are not
counted: a node without a snapshot lives only as long as one below it. On a CPU the host tier is the same
memory: its moves change the accounting alone.
"""

from __future__ import annotations

import collections
import dataclasses

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from ..cache import LinearizeCacheLayer, claim_cache_layer

# The default budget, where none is given: modest next to the model and the decode slots.
DEFAULT_BUDGET_BYTES = {"cuda": 1 << 30, "cpu": 256 << 20}
DEFAULT_BLOCK = 256


@dataclasses.dataclass
class LayerSnapshot:
    """One layer's part of a snapshot: a linearized layer's state tensors (`linear`, with the layer's mask
    window), or a softmax layer's "keys" and "values" [1, KV heads, positions, head dim] (`sliding`: the
    last window - 1 positions of a sliding-window layer; else every position)."""

    tensors: dict[str, torch.Tensor]
    linear: bool = False
    mask_window: int | None = None
    sliding: bool = False

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


@dataclasses.dataclass
class Snapshot:
    """Every layer's cache after the first `tokens` tokens of a prompt, taken on `device` (None: its
    tensors'), where it is restored; `on_host` while its tensors wait in host memory (`to_host`)."""

    tokens: int
    layers: list[LayerSnapshot]
    device: torch.device | None = None
    on_host: bool = dataclasses.field(default=False, init=False)

    def __post_init__(self):
        if self.device is None:
            tensor = next((t for layer in self.layers for t in layer.tensors.values()), None)
            self.device = tensor.device if tensor is not None else torch.device("cpu")

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    def to_host(self) -> None:
        """Move the tensors to CPU memory: pinned ones from a CUDA device, copied asynchronously on its current
        stream, which orders them before any later copy back."""
        pinned = self.device.type == "cuda"
        for layer in self.layers:
            layer.tensors = {name: _to_host(t, pinned) for name, t in layer.tensors.items()}
        self.on_host = True

    def to_device(self) -> None:
        """Move the tensors back to `device` (asynchronously from pinned memory); all or none of them (an
        out-of-memory error leaves the snapshot on the host)."""
        moved = [{name: t.to(self.device, non_blocking=True) for name, t in layer.tensors.items()}
                 for layer in self.layers]
        for layer, tensors in zip(self.layers, moved, strict=True):
            layer.tensors = tensors
        self.on_host = False


def _to_host(tensor: torch.Tensor, pinned: bool) -> torch.Tensor:
    if tensor.device.type == "cpu":
        return tensor
    copy = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pinned)
    return copy.copy_(tensor, non_blocking=pinned)


def _layer_snapshot(layer, tokens: int) -> LayerSnapshot:
    if isinstance(layer, LinearizeCacheLayer) and layer.state is not None:
        return LayerSnapshot({name: t.clone() for name, t in layer.state.items()}, linear=True,
                             mask_window=layer.mask_window)
    if isinstance(layer, DynamicLayer) and layer.is_initialized and layer.keys.shape[0] == 1:
        if layer.get_seq_length() != tokens:
            raise ValueError(f"a prefix snapshot of {tokens} tokens found a softmax layer of {layer.get_seq_length()}")
        # `clone` also compacts a sliding layer's keys, a view of its last prefill call's.
        return LayerSnapshot({"keys": layer.keys.clone(), "values": layer.values.clone()},
                             sliding=isinstance(layer, DynamicSlidingWindowLayer))
    raise ValueError("a prefix snapshot needs a batch-1 prefilled cache: linearized states or HF's dynamic "
                     "key/value layers, every layer filled")


def take_snapshot(cache, tokens: int) -> Snapshot:
    """A copy of `cache` (a batch-1 prefill, of any model the engine serves) after `tokens` tokens: copies,
    because later calls write a linearized state in place and a softmax layer's keys grow."""
    return Snapshot(tokens, [_layer_snapshot(layer, tokens) for layer in cache.layers])


def restore_into_layers(layers: list[LinearizeCacheLayer], snapshot: Snapshot) -> None:
    """Write `snapshot` (of a fully linearized model) into the frozen layers of a fixed-shape cache
    (`StaticPrefill`), which then continues the sequence after its `tokens`. The snapshot may be in either
    tier: the layers are on its device."""
    for layer, part in zip(layers, snapshot.layers, strict=True):
        if not part.linear:
            raise ValueError("a fixed-shape prefill cache restores the snapshots of fully linearized models only")
        for name, tensor in layer.state.items():
            saved = part.tensors[name]
            if saved.shape != tensor.shape:
                raise ValueError(f"a prefix snapshot of another shape ({name}: {tuple(saved.shape)} for "
                                 f"{tuple(tensor.shape)})")
            tensor.copy_(saved, non_blocking=True)  # from either tier
        layer.seen = snapshot.tokens


def restored_cache(config, snapshot: Snapshot) -> DynamicCache:
    """A new prefill cache of the model of `config` holding a copy of `snapshot`, as if it had prefilled its
    `tokens`: the rest of the prompt is prefilled into it. The copies are on the snapshot's device, whatever
    tier it is in."""
    cache = DynamicCache(config=config)
    for index, part in enumerate(snapshot.layers):
        copies = {name: t.to(snapshot.device, non_blocking=True, copy=True) for name, t in part.tensors.items()}
        if part.linear:
            layer = claim_cache_layer(cache, index, part.mask_window)
            layer.state = copies
            layer.seen = snapshot.tokens
            layer.is_initialized = True
            continue
        layer = cache.layers[index] if index < len(cache.layers) else None
        if not isinstance(layer, DynamicLayer) or layer.is_sliding != part.sliding:
            raise ValueError(f"a prefix snapshot of another model (layer {index}: "
                             f"{'sliding' if part.sliding else 'full'} attention keys for a {type(layer).__name__})")
        layer.lazy_initialization(copies["keys"], copies["values"])
        layer.keys, layer.values = copies["keys"], copies["values"]
        if part.sliding:
            layer.cumulative_length = snapshot.tokens  # the positions seen, of which the last window - 1 are kept
    return cache


class _Node:
    __slots__ = ("children", "key", "parent", "snapshot")

    def __init__(self, parent: _Node | None, key: tuple[int, ...]):
        self.parent, self.key = parent, key
        self.children: dict[tuple[int, ...], _Node] = {}
        self.snapshot: Snapshot | None = None


@dataclasses.dataclass
class Lookup:
    """What the cache holds for a prompt: the snapshot of its longest cached prefix (None: none), and how many
    of its tokens (whole blocks) follow cached prompts' paths, with or without a snapshot at their end."""

    snapshot: Snapshot | None
    followed: int


class PrefixCache:
    """The snapshots of prompt prefixes at multiples of `block` tokens, within `budget_bytes` on their device and
    `host_budget_bytes` in host memory (see the module's docstring). Counts, as vLLM does, the prompt tokens of
    the requests looked up (`query_tokens`) and those found cached (`hit_tokens`: tokens restored instead of
    prefilled); and the snapshots dropped for good (`evictions`), moved to the host (`offloads`) and back
    (`reloads`). Used by the engine's thread alone; `stats` may be read from another."""

    def __init__(self, block: int = DEFAULT_BLOCK, budget_bytes: int = DEFAULT_BUDGET_BYTES["cpu"],
                 host_budget_bytes: int = 0):
        if block < 1 or budget_bytes < 1 or host_budget_bytes < 0:
            raise ValueError(f"block and budget_bytes must be >= 1, host_budget_bytes >= 0, got {block}, "
                             f"{budget_bytes} and {host_budget_bytes}")
        self.block, self.budget_bytes, self.host_budget_bytes = block, budget_bytes, host_budget_bytes
        self._root = _Node(None, ())
        # The nodes holding a snapshot, per tier, least recently used first.
        self._used: collections.OrderedDict[int, _Node] = collections.OrderedDict()
        self._host: collections.OrderedDict[int, _Node] = collections.OrderedDict()
        self.nbytes = self.host_nbytes = 0
        self.query_tokens = self.hit_tokens = 0
        self.evictions = self.offloads = self.reloads = 0

    @property
    def entries(self) -> int:
        return len(self._used) + len(self._host)

    @property
    def host_entries(self) -> int:
        return len(self._host)

    def stats(self) -> dict:
        return {"enabled": True, "block": self.block, "entries": self.entries, "bytes": self.nbytes,
                "budget_bytes": self.budget_bytes, "host_entries": self.host_entries, "host_bytes": self.host_nbytes,
                "host_budget_bytes": self.host_budget_bytes, "query_tokens": self.query_tokens,
                "hit_tokens": self.hit_tokens, "evictions": self.evictions, "offloads": self.offloads,
                "reloads": self.reloads}

    def lookup(self, prompt: list[int]) -> Lookup:
        """The longest cached prefix of `prompt` strictly shorter than it (at least its last token is left to
        prefill, for the logits of the next one), on its device (moved back from the host if there), counted
        in `query_tokens` and `hit_tokens`."""
        found, followed = self._walk(prompt)
        if found is not None and found.snapshot.on_host:
            found = self._reload(found)
            # Making room may have dropped snapshots for good, and with them the paths past `found`.
            followed = self._walk(prompt)[1]
        elif found is not None:
            self._used.move_to_end(id(found))
        self.query_tokens += len(prompt)
        self.hit_tokens += found.snapshot.tokens if found is not None else 0
        return Lookup(found.snapshot if found is not None else None, followed)

    def holds(self, prefix: list[int]) -> bool:
        """Whether a snapshot of exactly `prefix` is kept, in either tier (marked as just used there if so)."""
        node = self._find(prefix)
        if node is None or node.snapshot is None:
            return False
        self._tier(node).move_to_end(id(node))
        return True

    def insert(self, prefix: list[int], snapshot: Snapshot) -> bool:
        """Keep `snapshot`, the state after `prefix` (whole blocks), on its device, moving the least recently
        used ones to the host or dropping them until it fits; False if it could not fit even alone."""
        if len(prefix) % self.block or not prefix or snapshot.tokens != len(prefix):
            raise ValueError(f"a prefix snapshot covers whole blocks of {self.block} tokens, got {len(prefix)}")
        size = snapshot.nbytes
        if size > self.budget_bytes:
            return False
        replaced = self._find(prefix)
        if replaced is not None and replaced.snapshot is not None:
            self._drop(replaced)
        self._make_room(size)
        # The path after the evictions, which prune the nodes that lead to no snapshot.
        node = self._root
        for start in range(0, len(prefix), self.block):
            key = tuple(prefix[start:start + self.block])
            node = node.children.get(key) or node.children.setdefault(key, _Node(node, key))
        node.snapshot = snapshot
        self._used[id(node)] = node
        self.nbytes += size
        return True

    def clear(self) -> None:
        for tier in (self._used, self._host):
            while tier:
                self._evict(next(iter(tier.values())))

    def _walk(self, prompt: list[int]) -> tuple[_Node | None, int]:
        """The deepest node with a snapshot that `prompt` strictly extends, and how many of its tokens follow
        the tree."""
        node, found, followed = self._root, None, 0
        while followed + self.block < len(prompt):
            child = node.children.get(tuple(prompt[followed:followed + self.block]))
            if child is None:
                break
            node, followed = child, followed + self.block
            if node.snapshot is not None:
                found = node
        return found, followed

    def _find(self, prefix: list[int]) -> _Node | None:
        node = self._root
        for start in range(0, len(prefix), self.block):
            node = node.children.get(tuple(prefix[start:start + self.block]))
            if node is None:
                return None
        return node

    def _tier(self, node: _Node) -> collections.OrderedDict[int, _Node]:
        return self._host if node.snapshot.on_host else self._used

    def _make_room(self, size: int) -> None:
        """Move the device tier's least recently used snapshots out until `size` more bytes fit its budget."""
        while self.nbytes + size > self.budget_bytes:
            self._demote(next(iter(self._used.values())))

    def _demote(self, node: _Node) -> None:
        """Move a device snapshot to the host tier, making room there, or drop it if it cannot fit there."""
        size = node.snapshot.nbytes
        if not self.host_budget_bytes or size > self.host_budget_bytes:
            self._evict(node)
            return
        del self._used[id(node)]
        self.nbytes -= size
        self._keep_on_host(node, size)
        node.snapshot.to_host()
        self.offloads += 1

    def _keep_on_host(self, node: _Node, size: int) -> None:
        """Count `node` (of `size` bytes) in the host tier as its most recently used, dropping the least
        recently used ones for good until it fits."""
        while self.host_nbytes + size > self.host_budget_bytes:
            self._evict(next(iter(self._host.values())))
        self._host[id(node)] = node
        self.host_nbytes += size

    def _reload(self, node: _Node) -> _Node | None:
        """Move a host snapshot back to its device as the most recently used there, moving others out to make
        room; None (it stays on the host, the most recently used there) if its device has no memory for it."""
        size = node.snapshot.nbytes
        del self._host[id(node)]  # out of both tiers: making room never moves or drops it
        self.host_nbytes -= size
        self._make_room(size)
        try:
            node.snapshot.to_device()
        except torch.OutOfMemoryError:
            self._keep_on_host(node, size)
            return None
        self._used[id(node)] = node
        self.nbytes += size
        self.reloads += 1
        return node

    def _drop(self, node: _Node) -> None:
        if node.snapshot.on_host:
            self.host_nbytes -= node.snapshot.nbytes
        else:
            self.nbytes -= node.snapshot.nbytes
        del self._tier(node)[id(node)]
        node.snapshot = None

    def _evict(self, node: _Node) -> None:
        """Drop a snapshot for good, and the nodes that lead to no other one."""
        self._drop(node)
        self.evictions += 1
        while node.parent is not None and not node.children and node.snapshot is None:
            del node.parent.children[node.key]
            node = node.parent
