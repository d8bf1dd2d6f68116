"""The wavelet-matrix search behind STILL's and the sparse cache's evictions, against its definition."""

import pytest
import torch

from linearize.ops.ranking import kth_ranked_above


@pytest.mark.parametrize("K, N", [(0, 9), (1, 9), (1, 1), (5, 40), (16, 100), (16, 128), (40, 300), (290, 300),
                                  (400, 300)])
def test_kth_ranked_above_equals_counting_every_pair(K, N):
    """The wavelet-matrix search against its definition: for each element, count the higher-ranked ones in
    index order and take where the count reaches K (members ranked 0.., non-members -1)."""
    g = torch.Generator().manual_seed(K * N + 1)
    member = torch.rand(2, 3, N, generator=g) < 0.7
    rank = torch.stack([torch.randperm(N, generator=g) for _ in range(6)]).view(2, 3, N)
    rank = torch.where(member, rank, -1)
    higher = torch.cumsum(rank[..., None, :] > rank[..., :, None], -1)  # [..., element, index]
    reached = higher >= K
    expected = torch.where(reached.any(-1), reached.int().argmax(-1), N)
    got = kth_ranked_above(rank, K)
    assert torch.equal(got[member], expected[member])
