"""Idle nodes' periodic reports taken in bulk (scenarios.sim.telemetry) give the answers of taking
every report one by one, to the last bit: generated fleets with faults (kills and restarts, slow nodes,
broker outages, cut links), change thresholds, schedulers and policies, simulated both ways."""

from __future__ import annotations

import random
from typing import Any

import pytest

import scenarios.sim.telemetry as telemetry
from scenarios.bench.digest import fingerprint
from scenarios.calibrate.profile import load_profile
from scenarios.sim import Profile, Simulation
from scenarios.spec.schema import Scenario
from scenarios.spec.workload import build_schedule

MODELS = ["sensor_mlp", "mobilenet_s", "tiny_transformer"]


def fleet(seed: int) -> Scenario:
    rng = random.Random(seed)
    sites = ["edge-a", "edge-b"]
    nodes: list[dict[str, Any]] = []
    for i in range(rng.randrange(3, 14)):
        part = rng.choice([*sites, "cloud"])
        nodes.append(
            {
                "id": f"n{i}",
                "partition": part,
                "tier": "cloud" if part == "cloud" else "edge",
                "slots": rng.choice((1, 1, 2)),
                "speed": rng.choice((0.05, 0.2, 1.0)),
                "scheduler": rng.choice(("fifo", "priority")),
                "change_threshold": rng.choice((1, 4, 4, 100)),
                "models": rng.sample(MODELS, rng.randrange(1, 4)),
            }
        )
    served = sorted({m for n in nodes for m in n["models"]})
    faults: list[dict[str, Any]] = []
    for _ in range(rng.randrange(0, 4)):
        kind = rng.choice(("kill_node", "slow_node", "broker_outage", "cut_link"))
        at = round(rng.uniform(0.5, 3.5), 1)
        if kind == "kill_node":
            faults.append(
                {"at_s": at, "kind": kind, "node": rng.choice(nodes)["id"], "duration_s": rng.choice((0.5, 1.0))}
            )
        elif kind == "slow_node":
            faults.append({"at_s": at, "kind": kind, "node": rng.choice(nodes)["id"], "factor": 4, "duration_s": 1.0})
        elif kind == "broker_outage":
            faults.append({"at_s": at, "kind": kind, "duration_s": rng.choice((0.3, 1.5))})
        else:
            faults.append({"at_s": at, "kind": kind, "link": ["edge-a", "cloud"], "duration_s": 1.0})
    doc = {
        "name": f"bulk-{seed}",
        "seed": seed,
        "topology": {
            "partitions": [*sites, "cloud"],
            "links": [{"a": s, "b": "cloud", "rtt_ms": 20} for s in sites],
            "nodes": nodes,
            **({"deployment": "per_site"} if rng.random() < 0.2 else {}),
        },
        "workload": {
            "duration_s": 4,
            "warmup_s": 0,
            "sites": [
                {
                    "site": s,
                    "rate_rps": rng.choice((5, 30, 120)),
                    "arrival": rng.choice(("poisson", "bursty")),
                    "models": {m: 1.0 for m in served},
                    "priorities": {0: 0.7, 10: 0.2, -1: 0.1},
                    "deadline_ms": {0: 300, 10: 100, -1: 400},
                }
                for s in sites
            ],
        },
        "faults": faults,
        "policies": [rng.choice(("p2c", "round_robin", "least_outstanding", "edge_first", "slo_priority"))],
    }
    return Scenario.model_validate(doc)


@pytest.mark.parametrize("seed", range(24))
def test_reports_in_bulk_answer_as_reports_one_by_one(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    scenario = fleet(seed)
    schedule = build_schedule(scenario.workload, scenario.seed, 4.0)
    profile = Profile.from_json(load_profile())
    digests = []
    for bulk in (True, False):
        monkeypatch.setattr(telemetry, "BULK", bulk)
        sim = Simulation(scenario, scenario.policies[0], schedule, profile)
        digests.append((fingerprint(sim.run(), sim), sim.store.messages, sim.events))
        if bulk:
            taken = sim.bulk_reports
    assert digests[0] == digests[1]
    if scenario.topology.deployment != "per_site":  # (one router's view: idle nodes' reports in bulk)
        assert taken > 0


@pytest.mark.parametrize(
    "name", ["quickstart", "broker-outage", "edge-outage", "camera-pipeline", "cascade", "flash-crowd"]
)
def test_shipped_scenarios_answer_the_same_with_reports_in_bulk(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where reports outnumber requests the engine takes them in bulk by itself; the shipped scenarios'
    fleets are small, so they run one by one: forced into bulk, they answer the same."""
    from scenarios import BUNDLED_DIR
    from scenarios.replay.common import offered_rate, plan
    from scenarios.spec.schema import load_scenario

    scenario = load_scenario(BUNDLED_DIR / f"{name}.yaml")
    _, _, schedule = plan(scenario, None)
    profile = Profile.from_json(load_profile(), offered_rate(scenario), len(scenario.topology.nodes))
    digests = []
    for bulk in (True, False):
        monkeypatch.setattr(telemetry, "BULK", bulk)
        sim = Simulation(scenario, scenario.policies[0], schedule, profile)
        digests.append((fingerprint(sim.run(), sim), sim.events))
        assert sim.bulk_reports > 0 if bulk else sim.bulk_reports == 0
    assert digests[0] == digests[1]
