"""The rows of one linearized layer inside a `kv_slots.BatchedKVCache`: the layer's fixed-shape decode
state (every tensor of it, [rows, ...]), one row per running request.

The layer is a `LinearizeCacheLayer`, so the linearized attention finds it where it looks for its cache
(`claim_cache_layer`). Before a step the owner hands it the stepped rows (`begin_step`): its `state` is
then views of rows 0..n-1 of the buffers, frozen, so that the step writes each row's new state in place.
Its token count is the longest row's, which only says that the rows hold sequences; each row's position
comes with the step's position ids, and the methods keep any position they need in the state itself.
Every token of a step is valid (`unpadded`): the rows stepped are all running requests, whatever the
masks built for the softmax layers say of the columns.
"""

from __future__ import annotations

import torch

from ..cache import LinearizeCacheLayer


class StateRowsLayer(LinearizeCacheLayer):
    """A linearized layer's state rows (see the module docstring)."""

    def __init__(self, device: torch.device, mask_window: int | None = None):
        super().__init__(mask_window)
        self.device = device
        self.unpadded = True
        self.buffers: dict[str, torch.Tensor] | None = None
        self._shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None  # per row, from the first load

    @property
    def ready(self) -> bool:
        """Whether the layer knows its state's shapes (from a loaded prefill)."""
        return self._shapes is not None

    def check_source(self, source) -> None:
        if not isinstance(source, LinearizeCacheLayer) or source.state is None:
            raise ValueError("load_row needs a prefilled cache whose linearized layers hold a state, layer for layer")
        if any(t.shape[0] != 1 for t in source.state.values()):
            raise ValueError("load_row needs a batch-1 prefilled cache")

    def learn_shapes(self, source: LinearizeCacheLayer) -> None:
        if self._shapes is None:
            self._shapes = {name: (tuple(t.shape[1:]), t.dtype) for name, t in source.state.items()}

    def reallocate(self, rows: int, capacity: int) -> int:
        """New buffers of `rows` rows, the old rows that fit copied in; returns their bytes. The capacity
        (positions) is the softmax layers' concern: a state has one shape however long its sequence."""
        old = self.buffers or {}
        buffers, nbytes = {}, 0
        for name, (shape, dtype) in self._shapes.items():
            new = torch.zeros(rows, *shape, dtype=dtype, device=self.device)
            if name in old:
                keep = min(rows, old[name].shape[0])
                new[:keep].copy_(old[name][:keep])
            old.pop(name, None)  # one old tensor beside the new buffers at a time
            buffers[name] = new
            nbytes += new.nbytes
        self.buffers = buffers
        self.state = None  # views of the old buffers
        return nbytes

    def load(self, row: int, source: LinearizeCacheLayer, length: int) -> None:
        for name, tensor in self.buffers.items():
            tensor[row].copy_(source.state[name][0])

    def move(self, source: int, target: int, length: int) -> None:
        for tensor in self.buffers.values():
            tensor[target].copy_(tensor[source])

    def begin_step(self, rows: int, longest: int) -> None:
        """Rows 0..`rows`-1 step next; the longest holds `longest` tokens."""
        self.state = {name: tensor[:rows] for name, tensor in self.buffers.items()}
        self.frozen = True
        self.seen = longest

    def drop(self) -> None:
        self.buffers, self.state, self.frozen, self.seen = None, None, False, 0
