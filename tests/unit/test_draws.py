"""The telemetry's draws (scenarios.sim.draws) are `random.Random(seed)`'s numbers in its order, one at
a time or a block at a time, and `Distribution.samples` gives `Distribution.sample`'s values to the
last bit, the exponential tail beyond p99 included: what lets the simulator draw its reports' lags in
bulk and answer as it did drawing them one by one."""

from __future__ import annotations

import random

from scenarios.calibrate.profile import load_profile
from scenarios.sim import Distribution, Profile
from scenarios.sim.draws import BLOCK, Draws


def test_the_stream_is_random_random_s_taken_one_at_a_time_or_in_blocks() -> None:
    for seed in (0, 3, 2**40 + 7):
        reference, draws, pick = random.Random(seed), Draws(seed), random.Random(seed + 1)
        want: list[float] = []
        got: list[float] = []
        for _ in range(400):
            k = pick.choice((0, 1, 2, 17, BLOCK - 1, BLOCK + 3))
            if k == 0:
                want.append(reference.random())
                got.append(draws.random())
            else:
                want.extend(reference.random() for _ in range(k))
                got.extend(draws.take(k).tolist())
        assert got == want
        assert draws.drawn == len(want)


def test_samples_are_sample_s_values_tail_included() -> None:
    dists = [
        Profile.from_json(load_profile()).telemetry_lag_ms,
        Distribution([0.0] * 50 + [1.0] * 51),  # flat stretches and a step
        Distribution([float(i * i) for i in range(101)]),  # a long tail beyond p99
    ]
    for dist in dists:
        a, b = random.Random(5), Draws(5)
        one_by_one = [dist.sample(a) for _ in range(50_000)]
        at_once = dist.samples(b.take(50_000)).tolist()
        assert at_once == one_by_one
        assert any(x > dist.q[99] for x in one_by_one) or dist.q[99] == dist.q[100]
