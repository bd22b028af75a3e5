"""The one quantile helper: nearest rank for every reported figure, a 101-point grid for distributions.

`nearest_rank(values, q)`: the smallest value with at least `q` of the values at or below it (q in
[0, 1]; `empty`, 0 by default, for no values): an observed value, never interpolated, so a p99 over
100 answers is the 99th slowest. Used for reports, benchmarks, node stats, telemetry lag and hedge
delays. `nearest_rank_index(n, q)`: the position of that value among n values in order.

`grid_101(samples)`: the 0th..100th percentiles with linear interpolation between order statistics,
the form in which the simulator's profile stores a measured distribution (sampled by inverse CDF).
"""

from __future__ import annotations

import math
from collections.abc import Iterable


def nearest_rank(values: Iterable[float], q: float, *, presorted: bool = False, empty: float = 0.0) -> float:
    ordered = values if presorted and isinstance(values, list) else sorted(values)
    n = len(ordered)
    if n == 0:
        return empty
    return ordered[nearest_rank_index(n, q)]


def nearest_rank_index(n: int, q: float) -> int:
    """Where `nearest_rank`'s value sits among `n` values (n >= 1) in ascending order (0-based): for
    a selection that does not sort them all (numpy's partition)."""
    return min(n, max(1, math.ceil(q * n - 1e-9))) - 1


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
