"""A sweep on a process pool gives exactly the serial sweep (every cell is its own seeded simulation)."""

from __future__ import annotations

from pathlib import Path

from scenarios.plan.sweep import sweep
from scenarios.spec.schema import load_scenario

ROOT = Path(__file__).resolve().parents[2]


def test_a_parallel_sweep_equals_the_serial_one() -> None:
    scenario = load_scenario(ROOT / "scenarios" / "quickstart.yaml")
    runs = [scenario.policy("p2c"), scenario.policy("least_outstanding")]
    serial = sweep(scenario, runs, [2, 3], duration_s=3.0, echo=False, seeds=2, jobs=1)
    parallel = sweep(scenario, runs, [2, 3], duration_s=3.0, echo=False, seeds=2, jobs=2)
    assert parallel == serial
    assert set(serial["grid"]) == {"p2c", "least_outstanding"}
    assert len(serial["grid"]["p2c"]["2"]["slo_by_seed"]) == 2
