"""The prefill cost model the engine paces its chunks by."""

from linearize.serve.pacing import WINDOW, PrefillCost


def test_the_fit_separates_the_fixed_share_once_two_sizes_are_seen():
    cost = PrefillCost()
    cost.add(10, 0.030)
    assert cost.fit() is None and cost.last_per_token_s == 0.003
    cost.add(110, 0.130)
    fixed, per_token = cost.fit()
    assert abs(fixed - 0.020) < 1e-12 and abs(per_token - 0.001) < 1e-12


def test_calls_that_cannot_separate_the_shares_keep_the_last_fit():
    cost = PrefillCost()
    cost.add(10, 0.030)
    cost.add(110, 0.130)
    for _ in range(WINDOW):  # the window fills with one size: from then on nothing to fit
        cost.add(50, 0.070)
    before = cost.fit()
    assert before is not None
    cost.add(50, 0.070)
    assert cost.fit() == before
    cost.add(60, 0.010)  # a larger call that took less time: noise, no fit with a negative per-token share
    assert cost.fit() == before and cost.last_per_token_s == 0.010 / 60
