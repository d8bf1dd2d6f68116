"""The options of the sparse-cache op: the window and linear branches' options and the cache's size."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..gla_window.options import GlaWindowOptions


@dataclass(frozen=True, eq=False)
class SparseCacheOptions:
    """How one layer mixes the linear state, the window and the sparse cache (`naive.py`'s formula):

    branches  the linear part and the softmax window as `GlaWindowOptions` gives them (window, scale,
              alpha, sinks, beta, normalize, shared, eps); the cached keys join the window's softmax
    slots     the cache's size: at most this many tokens past the window per KV head (>= 1)
    """

    branches: GlaWindowOptions
    slots: int

    def __post_init__(self):
        if self.slots < 1:
            raise ValueError(f"a sparse cache needs at least one slot, got {self.slots}")
        if self.branches.window < 1:
            raise ValueError(f"the window must hold at least one token, got {self.branches.window}")

    @property
    def window(self) -> int:
        return self.branches.window

    def replace(self, **changes) -> SparseCacheOptions:
        return dataclasses.replace(self, **changes)
