"""The one quantile helper (telemetry.measure.quantiles)."""

from __future__ import annotations

import random

import pytest

from telemetry.measure.quantiles import grid_101, nearest_rank


def test_nearest_rank_is_an_observed_value() -> None:
    values = [float(v) for v in range(1, 101)]
    random.Random(0).shuffle(values)
    assert nearest_rank(values, 0.5) == 50.0
    assert nearest_rank(values, 0.99) == 99.0, "p99 of 100 answers: the 99th slowest"
    assert nearest_rank(values, 0.07) == 7.0, "no float overshoot to the next rank"
    assert nearest_rank(values, 1.0) == 100.0 and nearest_rank(values, 0.0) == 1.0
    assert nearest_rank([], 0.5) == 0.0
    assert nearest_rank([3.0], 0.99) == 3.0


def test_grid_interpolates_between_order_statistics() -> None:
    g = grid_101([0.0, 10.0])
    assert len(g) == 101 and g[0] == 0.0 and g[50] == 5.0 and g[100] == 10.0
    assert grid_101([]) == [0.0] * 101
    assert grid_101([4.0]) == [4.0] * 101
    rng = random.Random(1)
    xs = [rng.gauss(10, 2) for _ in range(1000)]
    assert grid_101(xs)[50] == pytest.approx(sorted(xs)[499] / 2 + sorted(xs)[500] / 2, abs=1e-3)
