"""The rows of kv and hybrid modes, a model with softmax layers (and linearized ones, in a hybrid): a
`BatchedKVCache` whose rows 0..n-1 hold the n running requests (the last row's request moves into the row
of one that leaves), stepped together with per-row positions and masks; only the rows in use step. How much memory the rows may take is `kv_budget`'s policy.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .kv_budget import KVBudget
from .kv_slots import BatchedKVCache
from .request import Active


class KVRows:
    def __init__(self, model, budget: KVBudget):
        self.model, self.budget = model, budget
        self.cache = BatchedKVCache(model)
        self.device = next(model.parameters()).device

    def make_room(self, prompt_tokens: int, limits: tuple[int, int]) -> None:
        """Before a prefill starts: shrink buffers left larger than the admitted requests need (by requests
        gone since, `limits`), if with them the prefill's cache would pass the budget."""
        if self.budget.prefill_needs_room(self.cache.nbytes, prompt_tokens):
            self.cache.set_limits(*limits)
            self.cache.fit()

    def load(self, cache, length: int, running: list[Active], limits: tuple[int, int]) -> int:
        """A batch-1 prefill of `length` tokens into the row after the running ones; returns the row.
        `limits`: the rows and capacity the admitted requests, this one among them, can reach."""
        row = len(running)
        self.cache.set_limits(*limits)
        self.cache.load_row(row, cache, length)
        return row

    def step(self, running: list[Active], limits: tuple[int, int]) -> Iterable[tuple[Active, torch.Tensor, int]]:
        """One step of rows 0..n-1: each running request's logits [vocab] and their argmax."""
        # The rows of this step, read before any request leaves: a leaving request hands its row to the last one.
        rows = [(active, active.slot) for active in running]
        tokens = [0] * len(rows)
        for active, row in rows:
            tokens[row] = active.last
        self.cache.set_limits(*limits)
        logits = self.cache.step(self.model, torch.tensor(tokens, device=self.device).view(-1, 1))[:, -1]
        greedy = logits.argmax(-1).tolist()  # one read of every row's argmax
        return [(active, logits[row], greedy[row]) for active, row in rows]

    def free(self, row: int, running: list[Active]) -> None:
        """A request left row `row` (and `running`): the last row's request moves into it, so that the
        running requests keep rows 0..n-1."""
        last = len(running)
        if row != last:
            moved = next(a for a in running if a.slot == last)
            self.cache.move_row(last, row)
            moved.slot = row
        self.cache.clear_row(last)
        if not running:
            self.cache.free()

    def abandon(self, running: list[Active]) -> None:
        """After a failed step or reallocation: the state may be half-written, so it is dropped, every row."""
        for active in running:
            active.slot = None
        self.cache.free()

    def close(self) -> None:
        self.cache.free()
