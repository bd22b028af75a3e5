"""The one quantile helper: nearest rank for every reported figure, a 101-point grid for distributions.

`nearest_rank(values, q)`: the smallest value with at least `q` of the values at or below it (q in
[0, 1]; `empty`, 0 by default, for no values): an observed value, never interpolated, so a p99 over
100 answers is the 99th slowest. Used for reports, benchmarks, node stats, telemetry lag and hedge
delays. `nearest_rank_high(values, q)`: the same value for a high `q`, found among the few largest
values instead of sorting them all (a window that is read often: the router's answer margin).

`grid_101(samples)`: the 0th..100th percentiles with linear interpolation between order statistics,
the form in which the simulator's profile stores a measured distribution (sampled by inverse CDF).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Collection, Iterable


def nearest_rank(values: Iterable[float], q: float, *, presorted: bool = False, empty: float = 0.0) -> float:
    ordered = values if presorted and isinstance(values, list) else sorted(values)
    n = len(ordered)
    if n == 0:
        return empty
    return ordered[_rank(n, q) - 1]


def nearest_rank_high(values: Collection[float], q: float, *, empty: float = 0.0) -> float:
    """`nearest_rank(values, q)`, read from the top: the (n - rank + 1)-th largest value, so a p99
    costs a pass over the values that keeps the largest 1%, not a sort."""
    n = len(values)
    if n == 0:
        return empty
    return heapq.nlargest(n - _rank(n, q) + 1, values)[-1]


def _rank(n: int, q: float) -> int:
    """The 1-based rank from the bottom of the nearest-rank `q` quantile of `n` values."""
    return min(n, max(1, math.ceil(q * n - 1e-9)))


def grid_101(samples: Iterable[float]) -> list[float]:
    ordered = sorted(samples)
    n = len(ordered)
    if n == 0:
        return [0.0] * 101
    out = []
    for p in range(101):
        pos = (n - 1) * p / 100.0
        lo = int(pos)
        hi = min(lo + 1, n - 1)
        out.append(round(ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo), 4))
    return out
