"""The rows of serial mode, a hybrid (linearized and softmax layers): each request decodes on its own
cache, one step per running request a turn, with no batching across requests."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .request import Active


class SerialRows:
    def __init__(self, model):
        self.model = model
        self.device = next(model.parameters()).device

    def load(self, cache, length: int, running: list[Active], limits: tuple[int, int]) -> None:
        """Nothing to copy: the request goes on decoding on its own prefill cache."""

    def step(self, running: list[Active], limits: tuple[int, int]) -> Iterator[tuple[Active, torch.Tensor, None]]:
        """Each running request's next logits [vocab], one forward each, as its turn comes."""
        for active in list(running):
            ids = torch.tensor([[active.last]], device=self.device)
            out = self.model(input_ids=ids, past_key_values=active.cache, use_cache=True, logits_to_keep=1)
            yield active, out.logits[0, -1], None

    def free(self, slot: int, running: list[Active]) -> None:
        pass

    def abandon(self, running: list[Active]) -> None:
        pass

    def close(self) -> None:
        pass
