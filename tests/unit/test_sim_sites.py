"""The simulator's sites that stand alone (`deployment: per_site`): a router per site with its own view,
evidence and policy; each site's reports reach the routers its telemetry path reaches; a link cut stops
requests and telemetry between two sites, a telemetry cut only telemetry."""

from __future__ import annotations

from typing import Any

from scenarios.replay.partitions import partitions
from scenarios.sim import Profile, Simulation
from scenarios.spec.schema import Scenario
from scenarios.spec.workload import build_schedule


def scenario(faults: list[dict[str, Any]], policy: str = "p2c") -> Scenario:
    node = {"slots": 1, "speed": 0.2}
    return Scenario.model_validate(
        {
            "name": "sites",
            "seed": 3,
            "topology": {
                "deployment": "per_site",
                "partitions": ["a", "b"],
                "links": [{"a": "a", "b": "b", "rtt_ms": 10}],
                "nodes": [
                    {"id": "a1", "partition": "a", "models": ["sensor_mlp", "resnet_s"], **node},
                    {"id": "b1", "partition": "b", "models": ["sensor_mlp"], **node},
                ],
            },
            "workload": {
                "duration_s": 40,
                "warmup_s": 1,
                "sites": [
                    {"site": s, "rate_rps": 20, "models": {"sensor_mlp": 0.8, "resnet_s": 0.2}, "deadline_ms": {0: 300}}
                    for s in ("a", "b")
                ],
            },
            "faults": faults,
            "policies": [policy],
        }
    )


def run(s: Scenario) -> tuple[Simulation, list[Any]]:
    from scenarios.calibrate.profile import load_profile

    sim = Simulation(s, s.policies[0], build_schedule(s.workload, s.seed, 41), Profile.from_json(load_profile()))
    return sim, sim.run()


def test_each_site_has_its_own_router() -> None:
    sim, _ = run(scenario([]))
    assert set(sim.lcs) == {"a", "b"} and sim.lcs["a"] is not sim.lcs["b"]
    assert sim.lcs["a"].store is not sim.lcs["b"].store and sim.policy_of("a") is not sim.policy_of("b")


def test_a_cut_off_site_serves_what_its_nodes_serve_and_nothing_is_lost() -> None:
    s = scenario([{"at_s": 10, "kind": "cut_link", "link": ["a", "b"], "duration_s": 20}])
    _, results = run(s)
    cut = partitions(results, s)[0]["sites"]
    assert cut["b"]["local"]["in_time"] >= 0.99, cut["b"]
    assert cut["b"]["remote"]["in_time"] == 0.0, "resnet_s is only served in site a"
    assert cut["a"]["local"]["in_time"] >= 0.99 and cut["a"]["lost"] == cut["b"]["lost"] == 0
    assert cut["b"]["spill_back_s"] is not None and cut["b"]["spill_back_s"] < 5.0
    b_resnet = [r for r in results if r.arrival.site == "b" and r.arrival.model == "resnet_s"]
    assert all(r.status == 200 for r in b_resnet if 1 <= r.arrival.at_s < 9.5 or r.arrival.at_s > 31), "WAN serves"


def test_a_telemetry_cut_costs_the_requests_nothing() -> None:
    s = scenario([{"at_s": 5, "kind": "cut_telemetry", "link": ["a", "b"], "duration_s": 30}])
    sim, results = run(s)
    assert all(r.status == 200 for r in results if r.arrival.at_s >= 1.0), "(before the first reports: 503)"
    b_resnet = [
        r for r in results if r.arrival.site == "b" and r.arrival.model == "resnet_s" and 10 < r.arrival.at_s < 30
    ]
    assert b_resnet and all(r.node == "a1" for r in b_resnet), "site b still routes to a1 on its own evidence"
    assert [label for _, label in sim.fault_log] == ["cut telemetry a-b", "restore telemetry a-b"]
