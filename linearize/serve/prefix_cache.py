"""Prefix caching for slots mode: prefilled states of prompt prefixes, kept so that a later prompt that
starts with one of them prefills only the rest.

A fully linearized model's state after n tokens has one size whatever n is, so a cached prefix costs the
same whatever its length, and it is the whole of what the prefix left behind (every layer's recurrent
state, window ring, validity and scores: each `LinearizeCacheLayer.state` tensor, copied). A state
cannot be cut back to a shorter prefix, so one is kept only at the lengths it was taken at: the block
boundaries (multiples of `block` tokens) that a prefill call ends on.

The snapshots hang in a tree of blocks: each node is one more block of tokens, its children keyed by the
next block's tokens (exact keys, so two prefixes never share a node by a hash collision), and a node holds
a snapshot or only leads to deeper ones. A flat map of chained block hashes (vLLM's) finds the longest
cached prefix as well, but the tree also tells how far a prompt follows any cached prompt's tokens past its
last snapshot: there another prompt with the same start went on differently (a shared system prompt, most
often), and the engine ends a prefill call there so that the state at that point is kept too.

Memory: the snapshots' bytes stay within `budget_bytes`, the least recently used whole snapshots dropped
first; they stay on the model's device (no host tier). Token keys are not counted: a node without a
snapshot lives only as long as one below it.
"""

from __future__ import annotations

import collections
import dataclasses

import torch
from transformers import DynamicCache

from ..cache import LinearizeCacheLayer, claim_cache_layer

# The default budget, where none is given: modest next to the model and the decode slots.
DEFAULT_BUDGET_BYTES = {"cuda": 1 << 30, "cpu": 256 << 20}
DEFAULT_BLOCK = 256


@dataclasses.dataclass
class Snapshot:
    """Every layer's state after the first `tokens` tokens of a prompt: (its mask window, its tensors)."""

    tokens: int
    layers: list[tuple[int | None, dict[str, torch.Tensor]]]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, state in self.layers for t in state.values())


def take_snapshot(cache, tokens: int) -> Snapshot:
    """A copy of the state in `cache` (a batch-1 prefill of a fully linearized model) after `tokens`
    tokens: copies, because later calls write the state in place."""
    layers = list(cache.layers)
    if not all(isinstance(layer, LinearizeCacheLayer) and layer.state is not None for layer in layers):
        raise ValueError("a prefix snapshot needs the prefilled cache of a fully linearized model")
    return Snapshot(tokens, [(layer.mask_window, {name: t.clone() for name, t in layer.state.items()})
                             for layer in layers])


def restore_into_layers(layers: list[LinearizeCacheLayer], snapshot: Snapshot) -> None:
    """Write `snapshot` into the frozen layers of a fixed-shape cache (`StaticPrefill`), which then continues
    the sequence after its `tokens`."""
    for layer, (_, state) in zip(layers, snapshot.layers, strict=True):
        for name, tensor in layer.state.items():
            if state[name].shape != tensor.shape:
                raise ValueError(f"a prefix snapshot of another shape ({name}: {tuple(state[name].shape)} for "
                                 f"{tuple(tensor.shape)})")
            tensor.copy_(state[name])
        layer.seen = snapshot.tokens


def restored_cache(config, snapshot: Snapshot) -> DynamicCache:
    """A new cache holding a copy of `snapshot`, to prefill the rest of the prompt into."""
    cache = DynamicCache(config=config)
    for index, (mask_window, state) in enumerate(snapshot.layers):
        layer = claim_cache_layer(cache, index, mask_window)
        layer.state = {name: t.clone() for name, t in state.items()}
        layer.seen = snapshot.tokens
        layer.is_initialized = True
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
    """The snapshots of prompt prefixes at multiples of `block` tokens, within `budget_bytes` (see the module's
    docstring). Counts, as vLLM does, the prompt tokens of the requests looked up (`query_tokens`) and those
    found cached (`hit_tokens`: tokens restored instead of prefilled). Used by the engine's thread alone;
    `stats` may be read from another."""

    def __init__(self, block: int = DEFAULT_BLOCK, budget_bytes: int = DEFAULT_BUDGET_BYTES["cpu"]):
        if block < 1 or budget_bytes < 1:
            raise ValueError(f"block and budget_bytes must be >= 1, got {block} and {budget_bytes}")
        self.block, self.budget_bytes = block, budget_bytes
        self._root = _Node(None, ())
        # The nodes holding a snapshot, least recently used first.
        self._used: collections.OrderedDict[int, _Node] = collections.OrderedDict()
        self.nbytes = 0
        self.query_tokens = self.hit_tokens = 0
        self.evictions = 0

    @property
    def entries(self) -> int:
        return len(self._used)

    def stats(self) -> dict:
        return {"enabled": True, "block": self.block, "entries": self.entries, "bytes": self.nbytes,
                "budget_bytes": self.budget_bytes, "query_tokens": self.query_tokens,
                "hit_tokens": self.hit_tokens, "evictions": self.evictions}

    def lookup(self, prompt: list[int]) -> Lookup:
        """The longest cached prefix of `prompt` strictly shorter than it (at least its last token is left to
        prefill, for the logits of the next one), counted in `query_tokens` and `hit_tokens`."""
        node, found, followed = self._root, None, 0
        while followed + self.block < len(prompt):
            child = node.children.get(tuple(prompt[followed:followed + self.block]))
            if child is None:
                break
            node, followed = child, followed + self.block
            if node.snapshot is not None:
                found = node
        if found is not None:
            self._used.move_to_end(id(found))
        self.query_tokens += len(prompt)
        self.hit_tokens += found.snapshot.tokens if found is not None else 0
        return Lookup(found.snapshot if found is not None else None, followed)

    def holds(self, prefix: list[int]) -> bool:
        """Whether a snapshot of exactly `prefix` is kept (marked as just used if so)."""
        node = self._find(prefix)
        if node is None or node.snapshot is None:
            return False
        self._used.move_to_end(id(node))
        return True

    def insert(self, prefix: list[int], snapshot: Snapshot) -> bool:
        """Keep `snapshot`, the state after `prefix` (whole blocks), dropping the least recently used ones
        until it fits; False if it could not fit even alone."""
        if len(prefix) % self.block or not prefix or snapshot.tokens != len(prefix):
            raise ValueError(f"a prefix snapshot covers whole blocks of {self.block} tokens, got {len(prefix)}")
        size = snapshot.nbytes
        if size > self.budget_bytes:
            return False
        replaced = self._find(prefix)
        if replaced is not None and replaced.snapshot is not None:
            self._drop(replaced)
        while self.nbytes + size > self.budget_bytes:
            self._evict(next(iter(self._used.values())))
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
        while self._used:
            self._evict(next(iter(self._used.values())))

    def _find(self, prefix: list[int]) -> _Node | None:
        node = self._root
        for start in range(0, len(prefix), self.block):
            node = node.children.get(tuple(prefix[start:start + self.block]))
            if node is None:
                return None
        return node

    def _drop(self, node: _Node) -> None:
        self.nbytes -= node.snapshot.nbytes
        del self._used[id(node)]
        node.snapshot = None

    def _evict(self, node: _Node) -> None:
        """Drop a snapshot, and the nodes that lead to no other one."""
        self._drop(node)
        self.evictions += 1
        while node.parent is not None and not node.children and node.snapshot is None:
            del node.parent.children[node.key]
            node = node.parent
