"""What a prefill call costs, for the engine's pacing (`Engine.prefill_tokens`): a fixed share (every
weight read once, the launches, the host's work) plus a share for each token, fitted by least squares
to the engine's recent calls."""

from __future__ import annotations

import collections

# Calls the fit looks back over: enough to hold the whole-prompt chunks of an idle engine beside the
# small paced ones, which the fit needs to tell the fixed share from the per-token one.
WINDOW = 64


class PrefillCost:
    def __init__(self):
        self._calls: collections.deque[tuple[int, float]] = collections.deque(maxlen=WINDOW)
        self._fit: tuple[float, float] | None = None
        self.last_per_token_s: float | None = None

    def add(self, tokens: int, seconds: float) -> None:
        self._calls.append((tokens, seconds))
        self.last_per_token_s = seconds / tokens
        fit = _least_squares(self._calls)
        if fit is not None:  # else the last one holds: recent calls of one size cannot separate the shares
            self._fit = fit

    def fit(self) -> tuple[float, float] | None:
        """(fixed seconds a call, seconds a token), or None until calls of two sizes have been seen."""
        return self._fit


def _least_squares(calls) -> tuple[float, float] | None:
    n = len(calls)
    mean_x = sum(x for x, _ in calls) / n
    mean_y = sum(y for _, y in calls) / n
    var = sum((x - mean_x) ** 2 for x, _ in calls)
    if var == 0:
        return None
    per_token = sum((x - mean_x) * (y - mean_y) for x, y in calls) / var
    if per_token <= 0:  # noise, not a cost model
        return None
    return max(0.0, mean_y - per_token * mean_x), per_token
