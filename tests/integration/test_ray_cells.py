"""Simulations as Ray tasks (scenarios.sim.cells): a sweep, a replay's candidate runs and a search's grid
on a local Ray cluster that the test starts give exactly what local processes and one process give,
cell for cell. Skipped where Ray is not installed (`pip install 'edgeroute[ray]'`)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from scenarios.plan.sweep import sweep
from scenarios.replay.simulated import replay_sim
from scenarios.sim.cells import run_cells
from scenarios.spec.schema import load_scenario

ray = pytest.importorskip("ray")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """A local Ray cluster of two CPUs, started here and stopped after the module."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # (loopback, this test's own processes)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def _square(x: int) -> int:
    return x * x


def _strip(report: dict[str, Any]) -> dict[str, Any]:
    """A replay's report without what differs between two runs of the same simulations (times)."""
    out = {k: v for k, v in report.items() if k != "started_at"}
    out["policies"] = {n: {k: v for k, v in p.items() if k != "wall_s"} for n, p in report["policies"].items()}
    return out


def test_cells_come_back_in_order(cluster: Any) -> None:
    assert run_cells(_square, list(range(50)), ray="auto") == [x * x for x in range(50)]


def test_a_sweep_on_ray_equals_the_local_pool_and_the_serial_sweep(cluster: Any) -> None:
    scenario = load_scenario(ROOT / "scenarios" / "quickstart.yaml")
    runs = [scenario.policy("p2c"), scenario.policy("least_outstanding")]
    args: dict[str, Any] = {"duration_s": 2.0, "echo": False, "seeds": 2}
    on_ray = sweep(scenario, runs, [2, 3, 4], ray="auto", **args)
    assert on_ray == sweep(scenario, runs, [2, 3, 4], jobs=2, **args)
    assert on_ray == sweep(scenario, runs, [2, 3, 4], jobs=1, **args)
    assert len(on_ray["grid"]["p2c"]["4"]["slo_by_seed"]) == 2


def test_a_replays_candidates_on_ray_equal_the_runs_in_turn(cluster: Any) -> None:
    scenario = load_scenario(ROOT / "scenarios" / "overload.yaml")
    runs = list(scenario.policies)
    assert _strip(replay_sim(scenario, runs, duration_s=4.0, ray="auto")) == _strip(
        replay_sim(scenario, runs, duration_s=4.0)
    )
