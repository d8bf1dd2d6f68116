import pytest
import torch

from linearize.data import ResumableLoader


class Items(torch.utils.data.Dataset):
    """Item i is the tensor [i, i]: a batch shows which items it holds."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor([i, i])


def ids(batches) -> list[list[int]]:
    return [batch[:, 0].tolist() for batch in batches]


def take(loader, n: int) -> list[list[int]]:
    """The next n batches across epoch ends, as a training loop over steps would draw them."""
    out = []
    while len(out) < n:
        for batch in loader:
            out.append(batch[:, 0].tolist())
            if len(out) == n:
                break
    return out


def test_epoch_is_a_seeded_permutation_without_the_last_partial_batch():
    loader = ResumableLoader(Items(23), batch_size=4, seed=5)
    assert len(loader) == 5
    epoch0 = ids(loader)
    epoch1 = ids(loader)
    assert len(epoch0) == 5 and all(len(b) == 4 for b in epoch0)
    assert len({item for batch in epoch0 for item in batch}) == 20
    assert epoch0 != epoch1
    assert ids(ResumableLoader(Items(23), batch_size=4, seed=5)) == epoch0
    assert ids(ResumableLoader(Items(23), batch_size=4, seed=6)) != epoch0


def test_batches_are_stacked_items():
    batch = next(iter(ResumableLoader(Items(8), batch_size=4)))
    assert batch.shape == (4, 2) and torch.equal(batch[:, 0], batch[:, 1])


@pytest.mark.parametrize("world_size", [2, 4])
def test_ranks_partition_each_global_batch(world_size):
    whole = take(ResumableLoader(Items(50), batch_size=8, seed=1), 12)
    per_rank = [take(ResumableLoader(Items(50), batch_size=8, seed=1, rank=r, world_size=world_size), 12)
                for r in range(world_size)]
    for step, global_batch in enumerate(whole):
        shards = [per_rank[r][step] for r in range(world_size)]
        assert all(len(shard) == 8 // world_size for shard in shards)
        assert [item for shard in shards for item in shard] == global_batch  # disjoint, in rank order, all


@pytest.mark.parametrize("stop", [1, 4, 6, 7, 13])  # mid-epoch, at an epoch's end (6 batches/epoch), and later
def test_resume_continues_exactly_like_an_uninterrupted_run(stop):
    uninterrupted = take(ResumableLoader(Items(50), batch_size=8, seed=3), 20)
    first = ResumableLoader(Items(50), batch_size=8, seed=3)
    before = take(first, stop)
    state = first.state_dict()
    resumed = ResumableLoader(Items(50), batch_size=8, seed=3)
    resumed.load_state_dict(state)
    assert before + take(resumed, 20 - stop) == uninterrupted


def test_resume_on_another_world_size_keeps_the_global_batches():
    uninterrupted = take(ResumableLoader(Items(50), batch_size=8, seed=3), 10)
    first = ResumableLoader(Items(50), batch_size=8, seed=3)
    take(first, 4)
    shards = []
    for rank in range(2):
        loader = ResumableLoader(Items(50), batch_size=8, seed=3, rank=rank, world_size=2)
        loader.load_state_dict(first.state_dict())
        shards.append(take(loader, 6))
    assert [a + b for a, b in zip(*shards)] == uninterrupted[4:]


def test_state_records_the_position():
    loader = ResumableLoader(Items(50), batch_size=8, seed=3)
    take(loader, 8)
    assert loader.state_dict() == {"seed": 3, "epoch": 1, "position": 2, "batch_size": 8, "num_items": 50}


def test_resuming_with_another_configuration_is_refused():
    state = ResumableLoader(Items(50), batch_size=8, seed=3).state_dict()
    for other in (ResumableLoader(Items(50), batch_size=8, seed=4), ResumableLoader(Items(50), batch_size=4, seed=3),
                  ResumableLoader(Items(51), batch_size=8, seed=3)):
        with pytest.raises(ValueError, match="Cannot resume"):
            other.load_state_dict(state)


def test_bad_configuration():
    with pytest.raises(ValueError, match="not divisible by world_size"):
        ResumableLoader(Items(50), batch_size=6, world_size=4)
    with pytest.raises(ValueError, match="outside world_size"):
        ResumableLoader(Items(50), batch_size=8, rank=2, world_size=2)
    with pytest.raises(ValueError, match="fewer than one batch"):
        ResumableLoader(Items(5), batch_size=8)
