"""Shared pieces of the attention ops."""

import pytest
import torch

from linearize.ops.common import cumsum_over_tokens


@pytest.mark.parametrize("features", [1, 3])
@pytest.mark.parametrize("reverse", [False, True])
def test_cumsum_over_tokens_is_the_cumsum_over_dim_2(features, reverse):
    log_g = torch.randn(2, 3, 11, features, dtype=torch.float64)
    expected = log_g.flip(2).cumsum(2).flip(2) if reverse else log_g.cumsum(2)
    got = cumsum_over_tokens(log_g, reverse=reverse)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
