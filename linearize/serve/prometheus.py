"""Prometheus's text exposition format (version 0.0.4), for the few kinds of metric the server keeps:
counters, gauges read when scraped, and histograms.

    # HELP name what it counts
    # TYPE name counter
    name{label="value"} 3

A histogram is its cumulative `_bucket{le="..."}` counts (the last `le="+Inf"`), `_sum` and `_count`.
Written here rather than taken from `prometheus_client`, which the project does not depend on.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Callable

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
BACKSLASH, NEWLINE = "\\", "\n"


def _escape(value: str) -> str:
    return value.replace(BACKSLASH, BACKSLASH * 2).replace(NEWLINE, BACKSLASH + "n").replace('"', BACKSLASH + '"')


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{name}="{_escape(str(value))}"' for name, value in labels.items()) + "}"


def _number(value: float) -> str:
    value = float(value)
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return str(int(value)) if value.is_integer() and abs(value) < 2**53 else repr(value)


class _Metric:
    kind = ""

    def __init__(self, name: str, help: str, labels: dict[str, str] | None = None):
        self.name, self.help, self.labels = name, help, dict(labels or {})
        self._lock = threading.Lock()

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help.replace(BACKSLASH, BACKSLASH * 2).replace(NEWLINE, BACKSLASH + 'n')}",
                f"# TYPE {self.name} {self.kind}"]

    def lines(self) -> list[str]:
        raise NotImplementedError


class Counter(_Metric):
    """A count that only grows, one series per value of its `label` (if it has one)."""

    kind = "counter"

    def __init__(self, name: str, help: str, labels: dict[str, str] | None = None, label: str | None = None,
                 values: tuple[str, ...] = ()):
        super().__init__(name, help, labels)
        self.label = label
        self._counts: dict[str | None, float] = {value: 0.0 for value in values} if label else {None: 0.0}

    def inc(self, amount: float = 1.0, value: str | None = None) -> None:
        if amount < 0:
            raise ValueError("a counter only grows")
        with self._lock:
            self._counts[value] = self._counts.get(value, 0.0) + amount

    def lines(self) -> list[str]:
        with self._lock:
            counts = dict(self._counts)
        return [f"{self.name}{_labels({**self.labels, **({self.label: v} if self.label else {})})} {_number(c)}"
                for v, c in counts.items()]


class ReadCounter(_Metric):
    """A count that only grows, kept elsewhere and read when scraped, from `read`."""

    kind = "counter"

    def __init__(self, name: str, help: str, read: Callable[[], float], labels: dict[str, str] | None = None):
        super().__init__(name, help, labels)
        self.read = read

    def lines(self) -> list[str]:
        return [f"{self.name}{_labels(self.labels)} {_number(self.read())}"]


class Gauge(ReadCounter):
    """A value read when scraped, from `read`: it may go down as well as up."""

    kind = "gauge"


class Histogram(_Metric):
    """Observations counted in buckets of upper bounds `buckets` (and +Inf), with their sum."""

    kind = "histogram"

    def __init__(self, name: str, help: str, buckets: tuple[float, ...], labels: dict[str, str] | None = None):
        super().__init__(name, help, labels)
        if list(buckets) != sorted(set(buckets)):
            raise ValueError("histogram buckets must increase")
        self.buckets = tuple(buckets)
        self._counts = [0] * (len(buckets) + 1)  # the last: above every bound
        self._sum = 0.0

    def observe(self, value: float) -> None:
        with self._lock:
            self._counts[bisect.bisect_left(self.buckets, value)] += 1
            self._sum += value

    def lines(self) -> list[str]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        lines, seen = [], 0
        for bound, count in zip((*self.buckets, math.inf), counts):
            seen += count
            lines.append(f"{self.name}_bucket{_labels({**self.labels, 'le': _number(bound)})} {seen}")
        lines.append(f"{self.name}_sum{_labels(self.labels)} {_number(total)}")
        lines.append(f"{self.name}_count{_labels(self.labels)} {seen}")
        return lines


def exposition(metrics: list[_Metric]) -> str:
    """The text a scrape gets: each metric's HELP and TYPE lines, then its samples."""
    return "".join(line + "\n" for metric in metrics for line in (*metric.header(), *metric.lines()))
