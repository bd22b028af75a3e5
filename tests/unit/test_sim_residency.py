"""The simulator's residency and workflows: the node's own LRU rule within its memory budget, loads
that take their declared time, workflows run stage by stage with the router's budget split, and the
node-count sweep."""

from __future__ import annotations

from typing import Any

import pytest

from scenarios.plan.sweep import parse_counts, sweep, with_nodes
from scenarios.replay.simulated import replay_sim
from scenarios.sim import Profile, Simulation, output_bytes
from scenarios.spec.schema import Scenario, load_scenario
from scenarios.spec.workload import build_schedule

CROP = {"crop": "image", "boxes": "detect.boxes", "scores": "detect.scores", "min_score": 0.0, "max_crops": 4}


def camera(nodes: int = 2, rate: float = 20.0, classifiers: int = 3, **over: Any) -> Scenario:
    cls = [f"cls-{i}" for i in range(classifiers)]
    doc: dict[str, Any] = {
        "name": "cam",
        "seed": 3,
        "models": {
            "det": {"zoo": "detector_head", "size_mb": 300, "load_ms": 300},
            **{c: {"zoo": "mobilenet_s", "seed": i + 1, "size_mb": 700, "load_ms": 400} for i, c in enumerate(cls)},
        },
        "topology": {
            "partitions": ["site"],
            "nodes": [
                {"id": f"g{i}", "partition": "site", "speed": 0.05, "memory_budget_mb": 1024, "models": ["det", *cls]}
                for i in range(1, nodes + 1)
            ],
        },
        "router": {
            "workflows": [
                {
                    "name": f"cam-{c}",
                    "slo_ms": 300,
                    "inputs": ["image"],
                    "stages": [
                        {"name": "detect", "model": "det", "inputs": {"image": "image"}},
                        {"name": "classify", "model": c, "inputs": {"image": CROP}},
                    ],
                }  # fmt: skip
                for c in cls
            ]
        },
        "workload": {
            "duration_s": 10,
            "warmup_s": 2,
            "sites": [
                {"site": "site", "rate_rps": rate, "models": {f"cam-{c}": 1.0 for c in cls}, "deadline_ms": {0: 300}}
            ],
        },
        "policies": ["p2c", "compass"],
    }
    doc.update(over)
    return Scenario.model_validate(doc)


def simulate(s: Scenario, policy: str) -> Simulation:
    from scenarios.calibrate.profile import load_profile
    from scenarios.replay.common import plan as _plan

    _, _, schedule = _plan(s, None)
    sim = Simulation(s, s.policy(policy), schedule, Profile.from_json(load_profile(None)))
    sim.run()
    return sim


@pytest.mark.parametrize("policy", ["p2c", "compass"])
def test_a_node_never_holds_more_than_its_budget_and_evicts_to_load(policy: str) -> None:
    sim = simulate(camera(), policy)
    for node in sim.nodes.values():
        budget = node.spec.memory_budget_mb << 20
        assert node.peak_memory <= budget
        assert node.residency.used_bytes <= budget
        assert len(node.residency.resident) <= 2, "the detector and one 700 MB classifier fit in 1 GB"
    assert sum(n.loads for n in sim.nodes.values()) > 0, "three classifiers, room for one per node"
    assert sum(n.evictions for n in sim.nodes.values()) > 0


def test_at_start_a_node_holds_its_models_in_config_order_while_they_fit() -> None:
    sim = Simulation(camera(), camera().policy("p2c"), [], Profile.from_json(_profile()))
    assert sim.nodes["g1"].residency.resident == ["det", "cls-0"]


def _profile() -> dict[str, Any]:
    from scenarios.calibrate.profile import load_profile

    return load_profile(None)


def test_a_cold_load_longer_than_the_deadline_is_a_miss_and_a_model_too_big_is_503() -> None:
    s = camera(nodes=1, classifiers=2, rate=5.0)
    sim = simulate(s, "p2c")
    results = [r for r in sim.results if r is not None]
    assert any(r.status == 504 for r in results), "cls-1 loads in 400 ms, past 300 ms"
    missed = [r for r in results if r.status == 504 and r.error.startswith("stage classify")]
    assert missed and all(r.bytes_kept == 4 * 3 * 64 * 64 * 4 for r in missed), (
        "the crops went to the node that made them though its answer came too late (the router counts them so)"
    )
    big = camera(nodes=1, classifiers=1, models={
        "det": {"zoo": "detector_head", "size_mb": 300}, "cls-0": {"zoo": "mobilenet_s", "size_mb": 4096}})  # fmt: skip
    sim = simulate(big, "p2c")
    reasons = {r.error for r in sim.results if r is not None and r.status == 503}
    assert any("more than the node's whole budget" in e for e in reasons), reasons


def test_a_workflow_runs_every_stage_and_keeps_the_crops_on_the_detectors_node() -> None:
    s = camera(nodes=2, classifiers=1, rate=5.0)
    sim = simulate(s, "compass")
    measured = [r for r in sim.results if r is not None and r.arrival.at_s >= 2.0]  # after warm-up
    ok = [r for r in measured if r.status == 200]
    assert len(ok) == len(measured)
    crop_bytes = 4 * 3 * 64 * 64 * 4
    assert all(r.stages == 2 for r in ok)
    assert sum(r.bytes_kept for r in ok) == crop_bytes * len(ok), "compass keeps both stages on one node"
    assert sum(r.bytes_moved for r in ok) == 0
    assert all(r.exec_ms > 0 and r.latency_ms > r.exec_ms for r in ok)


def test_workflow_reports_are_deterministic_and_carry_residency_figures() -> None:
    s = camera()
    a, b = replay_sim(s, list(s.policies)), replay_sim(s, list(s.policies))
    for name in ("p2c", "compass"):
        pa, pb = a["policies"][name], b["policies"][name]
        assert pa["residency"] == pb["residency"] and pa["latency_ms"] == pb["latency_ms"]
        assert set(pa["residency"]) >= {"warm_hit_rate", "loads", "evictions", "bytes_kept", "bytes_moved"}
        assert pa["sent"] == pa["completed"] + sum(pa["errors"].values())
    assert a["policies"]["compass"]["residency"]["warm_hit_rate"] > a["policies"]["p2c"]["residency"]["warm_hit_rate"]


def test_output_bytes_come_from_the_zoo_graph() -> None:
    assert output_bytes("detector_head", "boxes") == 8 * 4 * 4
    assert output_bytes("detector_head", "scores", batch=2) == 2 * 8 * 4
    assert output_bytes("detector_head", "nope") == 0


def test_with_nodes_takes_the_first_nodes_then_copies_the_last() -> None:
    s = camera(nodes=2)
    assert [n.id for n in with_nodes(s, 1).topology.nodes] == ["g1"]
    grown = with_nodes(s, 4).topology.nodes
    assert [n.id for n in grown] == ["g1", "g2", "g2-1", "g2-2"]
    assert grown[3].models == grown[1].models


def test_parse_counts() -> None:
    assert parse_counts("1-3,6,2") == [1, 2, 3, 6]
    assert parse_counts(" 1 - 3 ") == [1, 2, 3] and len(parse_counts("1-256")) == 256
    for bad in ("0-2", "abc", "-3", "3-", "1-2-3", "", "5-3", "10001"):
        with pytest.raises(ValueError, match="give counts from 1 to 10,000"):
            parse_counts(bad)
    # a huge range is refused before it is expanded (it took the machine's memory)
    for huge in ("1-100000000", "1-257", ",".join(str(i) for i in range(1, 300))):
        with pytest.raises(ValueError, match="256 counts at most"):
            parse_counts(huge)


def test_a_sweep_finds_the_fewest_nodes_per_policy() -> None:
    s = camera(classifiers=2, rate=10.0)
    result = sweep(s, list(s.policies), [1, 2, 3], target=0.99, echo=False)
    assert result["needed"]["compass"] == 2, result["grid"]["compass"]
    assert result["grid"]["compass"]["2"]["warm_hit_rate"] > result["grid"]["p2c"]["2"]["warm_hit_rate"]
    assert set(result["grid"]["p2c"]) == {"1", "2", "3"}


def test_the_camera_pipeline_scenario_parses_and_compares_the_three_policies() -> None:
    s = load_scenario("scenarios/camera-pipeline.yaml")
    assert [p.name for p in s.policies] == ["p2c", "compass", "esg"]
    assert len(s.workflow_specs()) == 6
    schedule = build_schedule(s.workload, s.seed, 10.0, s.base_dir)
    assert {a.model for a in schedule} >= {"cam-a", "sensor"}


def hot_model(copies: bool) -> Scenario:
    # nodes that queue rather than refuse: what the copy planner is measured against here
    queueing = {"speed": 0.05, "memory_budget_mb": 1024, "admit_by_deadline": False, "queue_target_ms": 0}
    nodes = [
        {"id": "g1", "partition": "site", **queueing, "models": ["cls", "filler"]},
        {"id": "g2", "partition": "site", **queueing, "models": ["filler", "cls"]},
        {"id": "g3", "partition": "site", **queueing, "models": ["filler", "cls"]},
    ]
    return Scenario.model_validate(
        {
            "name": "hot",
            "seed": 2,
            "models": {
                "cls": {"zoo": "mobilenet_s", "size_mb": 700, "load_ms": 400},
                "filler": {"zoo": "sensor_mlp", "size_mb": 700, "load_ms": 400},
            },
            "topology": {"partitions": ["site"], "nodes": nodes},
            # one attempt each: a retry of a refusal would load the model elsewhere on demand by itself
            "router": {"copies": {"enabled": copies, "target_utilisation": 0.5}, "max_attempts": 1},
            "workload": {
                "duration_s": 10,
                "warmup_s": 1,
                "sites": [{"site": "site", "rate_rps": 450, "models": {"cls": 1.0}, "deadline_ms": {0: 100}}],
            },
            "policies": ["compass"],
        }
    )


def test_copy_scaling_loads_a_hot_model_ahead_of_need_on_the_planners_clock() -> None:
    without, with_copies = simulate(hot_model(False), "compass"), simulate(hot_model(True), "compass")
    assert with_copies.copies_made >= 1
    assert sum(n.loads for n in with_copies.nodes.values()) >= 1
    served = {n.spec.id: n.served for n in with_copies.nodes.values()}
    assert sum(1 for v in served.values() if v > 100) >= 2, f"the load is shared by the copies: {served}"
    assert without.copies_made == 0
    late = [r for r in with_copies.results if r is not None and (r.status != 200 or r.latency_ms > 100)]
    late_without = [r for r in without.results if r is not None and (r.status != 200 or r.latency_ms > 100)]
    assert len(late) * 5 < len(late_without), "one copy cannot keep up with 450 req/s of 2.8 ms each"


class CheckedReports(Simulation):
    """Checks every telemetry report against the node's state when it is made (the simulator keeps a
    model's report while nothing it is built from changed; a report that lags the node is a bug)."""

    checked = 0
    batched = 0

    def _snapshot(self, node: Any) -> Any:
        msg = super()._snapshot(node)
        for m in node.spec.models:
            report = msg.models[m]
            ewma = {str(rows): round(v, 2) for (name, rows), v in node.ewma.items() if name == m}
            ewma["1"] = round(node.ewma.get((m, 1), self._baseline[m] / node.speed), 2)
            assert report.ewma_ms_by_batch == ewma, (node.spec.id, m)
            assert report.queued == node.sched.queued_by_model[m]
            assert report.in_flight == node.in_flight_of(m)
            assert report.resident == (m in node.residency)
            assert report.load_ms == node.load_ms.get(m)
            self.checked += 1
            self.batched += len(ewma) > 1
        assert msg.memory_used_bytes == sum(self._size[m] for m in node.residency.resident)
        return msg


@pytest.mark.parametrize("policy", ["p2c", "compass"])
def test_every_report_shows_the_node_as_it_is_each_batch_sizes_ewma_included(policy: str) -> None:
    from scenarios.calibrate.profile import load_profile
    from scenarios.replay.common import plan as _plan

    s = camera(rate=40.0)
    _, _, schedule = _plan(s, None)
    sim = CheckedReports(s, s.policy(policy), schedule, Profile.from_json(load_profile(None)))
    sim.run()
    assert sim.checked > 1000
    assert sim.batched > 100, "crops run as batches of several rows: their EWMAs are reported"


def test_a_simulated_report_has_residency_per_model_and_copies_over_time() -> None:
    s = camera()
    report = replay_sim(s, list(s.policies))
    for name, p in report["policies"].items():
        res, tl = p["residency"], p["timeline"]
        for k in ("model_requests", "cold_requests", "loads", "evictions"):
            assert sum(r[k] for r in res["by_model"].values()) == res[k], (name, k)
        assert set(tl["copies"]) == set(s.models), "every catalogue model, held or not"
        assert all(len(c) == len(tl["throughput_rps"]) for c in tl["copies"].values())
        assert all(0 <= n <= 2 for c in tl["copies"].values() for n in c if n is not None), "two nodes"
        assert tl["copies"]["det"][-1] == 2, "the detector stays on both nodes"
    thrash = report["policies"]["p2c"]["timeline"]["copies"]
    assert any(len({n for n in c if n is not None}) > 1 for m, c in thrash.items() if m != "det"), (
        "p2c loads and evicts classifiers: their copies change over the run"
    )
