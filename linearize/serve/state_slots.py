"""The rows of slots mode, a fully linearized model: its decode state has one fixed shape per request, so
the batch is a fixed set of `max_batch` slots of one frozen cache, stepped together by `StaticDecoder` (a
CUDA graph per step on a GPU). A request's prefilled state is loaded into a free slot; idle slots step
too, on whatever they hold, so that the step's shape never changes, and their tokens are dropped.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from transformers import DynamicCache

from ..decode import StaticDecoder
from .request import Active


class StateSlots:
    """`max_batch` slots of linear-attention state and the free ones among them."""

    def __init__(self, model, max_batch: int, cuda_graph: bool | None):
        self.model, self.max_batch, self.cuda_graph = model, max_batch, cuda_graph
        self.device = next(model.parameters()).device
        self._free = list(range(max_batch))
        self._decoder: StaticDecoder | None = None

    def decoder(self) -> StaticDecoder:
        """The decoder over the slots, made at the first use from a one-token prefill of every slot (their
        states are replaced as requests take the slots)."""
        if self._decoder is None:
            cache = DynamicCache(config=self.model.config)
            start = torch.zeros(self.max_batch, 1, dtype=torch.long, device=self.device)
            self.model(input_ids=start, past_key_values=cache, use_cache=True, logits_to_keep=1)
            self._decoder = StaticDecoder(self.model, cache, batch=self.max_batch, cuda_graph=self.cuda_graph)
        return self._decoder

    def load(self, cache, length: int, running: list[Active], limits: tuple[int, int]) -> int:
        """A prefilled state of `length` tokens (`cache`, batch 1) into a free slot; returns the slot."""
        decoder = self.decoder()
        slot = self._free.pop(0)  # back with all the others in `abandon` if the load fails
        decoder.load_row(slot, cache, length)
        return slot

    def step(self, running: list[Active], limits: tuple[int, int]) -> Iterable[tuple[Active, torch.Tensor, int]]:
        """One step of every slot: each running request's logits [vocab] and their argmax."""
        tokens = [0] * self.max_batch
        for active in running:
            tokens[active.slot] = active.last
        # One upload of the step's tokens and one read of every row's argmax: per-row reads would
        # synchronise with the device once per running request.
        logits = self._decoder.step(torch.tensor(tokens, device=self.device).view(-1, 1))[:, -1]
        greedy = logits.argmax(-1).tolist()
        return [(active, logits[active.slot], greedy[active.slot]) for active in running]

    def free(self, slot: int, running: list[Active]) -> None:
        self._free.append(slot)

    def abandon(self, running: list[Active]) -> None:
        """After a failed step or load: the state may be half-written, so the slots start afresh."""
        for active in running:
            active.slot = None
        self.close()
        self._free = list(range(self.max_batch))

    def close(self) -> None:
        if self._decoder is not None:
            self._decoder.close()
            self._decoder = None
