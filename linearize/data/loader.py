"""A deterministic, resumable, rank-sharded batch iterator over a map-style dataset of equal-shape tensors."""

import torch

from linearize.data.shuffle import permutation


class ResumableLoader:
    """Yields batches [batch_size // world_size, ...] of `dataset` items, stacked.

    Epoch e visits the items in a permutation that depends only on (seed, e); global batch b of it is the b-th run
    of `batch_size` items, and rank r gets the r-th contiguous slice of that batch, so the ranks' batches partition
    the global batch. The last incomplete global batch is dropped. Iterating yields the rest of the current epoch
    and then moves on to the next epoch, so `for batch in loader` runs one epoch, and breaking out then iterating
    again continues where it stopped.

    `state_dict()` records the position in global batches; a loader given it by `load_state_dict` yields exactly
    the batches an uninterrupted one would, on any world_size that divides batch_size.
    """

    def __init__(self, dataset, batch_size: int, *, seed: int = 0, rank: int = 0, world_size: int = 1):
        if batch_size % world_size:
            raise ValueError(f"batch_size={batch_size} is not divisible by world_size={world_size}.")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} is outside world_size={world_size}.")
        if len(dataset) < batch_size:
            raise ValueError(f"The dataset has {len(dataset)} items, fewer than one batch of {batch_size}.")
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.epoch = 0
        self.position = 0  # global batches of the current epoch already yielded

    def __len__(self) -> int:
        """Batches per epoch (the same on every rank)."""
        return len(self.dataset) // self.batch_size

    def __iter__(self):
        if self.position >= len(self):  # a state saved right after an epoch's last batch
            self._next_epoch()
        order = permutation(len(self.dataset), self.seed, self.epoch)
        local = self.batch_size // self.world_size
        while self.position < len(self):
            start = self.position * self.batch_size + self.rank * local
            # Count the batch as consumed before handing it out, so a state saved while it is being trained on
            # resumes with the next one.
            self.position += 1
            yield torch.stack([self.dataset[int(i)] for i in order[start : start + local]])
        self._next_epoch()

    def _next_epoch(self) -> None:
        self.epoch += 1
        self.position = 0

    def state_dict(self) -> dict:
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position,
                "batch_size": self.batch_size, "num_items": len(self.dataset)}

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state`; refuses a state from a different seed, batch size or dataset size."""
        mine = {"seed": self.seed, "batch_size": self.batch_size, "num_items": len(self.dataset)}
        theirs = {key: state[key] for key in mine}
        if theirs != mine:
            raise ValueError(f"Cannot resume: the saved loader had {theirs}, this one has {mine}.")
        self.epoch = state["epoch"]
        self.position = state["position"]
