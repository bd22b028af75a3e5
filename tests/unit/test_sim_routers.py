"""Several central routers in the simulator (`topology.routers`, scenarios.sim.replicas): each takes its
share of the arrivals, reads the telemetry after its own lag into a view of its own, and hears the
others' in-flight loads as live routers do (telemetry.kafka.peers); the same seed, the same run."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from scenarios.sim import Profile, Simulation
from scenarios.spec.schema import Scenario
from scenarios.spec.workload import build_schedule


def scenario(routers: list[dict[str, Any]], deployment: str = "central") -> Scenario:
    node = {"slots": 2, "speed": 0.5, "models": ["sensor_mlp"]}
    return Scenario.model_validate(
        {
            "name": "routers",
            "seed": 4,
            "topology": {
                "deployment": deployment,
                "partitions": ["a"],
                "nodes": [{"id": f"n{i}", "partition": "a", **node} for i in range(3)],
                "routers": routers,
            },
            "workload": {
                "duration_s": 30,
                "warmup_s": 1,
                "sites": [{"site": "a", "rate_rps": 60, "models": {"sensor_mlp": 1.0}, "deadline_ms": {0: 300}}],
            },
            "policies": ["p2c"],
        }
    )


def run(s: Scenario) -> tuple[Simulation, list[Any]]:
    from scenarios.calibrate.profile import load_profile

    sim = Simulation(s, s.policies[0], build_schedule(s.workload, s.seed, 31), Profile.from_json(load_profile()))
    return sim, sim.run()


def test_each_router_takes_its_share_with_a_view_of_its_own() -> None:
    lag = [400.0] * 101
    sim, results = run(scenario([{"id": "r1", "share": 0.5, "telemetry_lag_ms": lag},
                                 {"id": "r2", "share": 0.3}, {"id": "r3", "share": 0.2}]))  # fmt: skip
    assert all(r.status == 200 for r in results if r.arrival.at_s >= 2.0)
    sent = [sum(r.lc.tracker.totals()[0].values()) for r in sim.replicas]
    shares = [n / sum(sent) for n in sent]
    assert shares == pytest.approx([0.5, 0.3, 0.2], abs=0.03), shares
    stores = [r.lc.store for r in sim.replicas]
    assert len({id(s) for s in stores}) == 3 and sim.replicas[0].lc is sim.lc
    assert stores[0].lag_quantile(0.5) == pytest.approx(400.0, abs=10) and stores[1].lag_quantile(0.5) < 50.0
    assert len({id(r.policy) for r in sim.replicas}) == 3, "each router its own policy object"


def test_each_router_hears_the_others_loads() -> None:
    sim, _ = run(scenario([{"id": "r1"}, {"id": "r2"}]))
    for me, other in ((0, 1), (1, 0)):
        r = sim.replicas[me]
        assert r.heard > 0 and r.sent > 0
        assert set(r.peers._latest) == {sim.replicas[other].id}, "its own messages are not its peers'"
        # what it last heard is the other's running sums as they stood (dispatched at least settled)
        _, msg = r.peers._latest[sim.replicas[other].id]
        assert sum(msg.dispatched.values()) >= sum(msg.settled.values()) > 0


def test_the_same_seed_gives_the_same_run_and_one_router_names_only_its_lag() -> None:
    two = [{"id": "r1", "telemetry_lag_ms": [float(i) for i in range(101)]}, {"id": "r2"}]
    first = [(r.status, r.node, round(r.latency_ms, 6)) for r in run(scenario(two))[1]]
    again = [(r.status, r.node, round(r.latency_ms, 6)) for r in run(scenario(two))[1]]
    assert first == again
    sim, _ = run(scenario([{"id": "only", "telemetry_lag_ms": [250.0] * 101}]))
    assert not sim.replicas and sim.store.lag_quantile(0.5) == pytest.approx(250.0, abs=10)


def test_routers_belong_to_a_central_fleet() -> None:
    with pytest.raises(ValidationError, match="per_site deployment has a router per partition"):
        scenario([{"id": "r1"}, {"id": "r2"}], deployment="per_site")
    with pytest.raises(ValidationError, match="ids must be unique"):
        scenario([{"id": "r1"}, {"id": "r1"}])
