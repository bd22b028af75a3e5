"""The native data plane in the simulator (scenarios.sim.dataplane): it carries what the live proxy
would (a policy it can express, emulated links included), balances on its own counts, retries a refused
connection elsewhere, and leaves the rest to the simulated router; with it off nothing changes."""

from __future__ import annotations

from typing import Any

from scenarios.replay.simulated import replay_sim
from scenarios.spec.schema import Scenario


def _scenario(**extra: Any) -> Scenario:
    doc: dict[str, Any] = {
        "name": "sim-dataplane",
        "seed": 4,
        "topology": {
            "partitions": ["edge-a"],
            "nodes": [
                {"id": "a", "partition": "edge-a", "slots": 1, "models": ["sensor_mlp"]},
                {"id": "b", "partition": "edge-a", "slots": 1, "models": ["sensor_mlp"]},
            ],
        },
        "workload": {
            "duration_s": 6,
            "warmup_s": 0.5,
            "sites": [{"site": "edge-a", "rate_rps": 60, "models": {"sensor_mlp": 1.0}, "deadline_ms": {0: 300}}],
        },
        "policies": ["p2c", "least_outstanding", "round_robin", "compass"],
    }
    doc.update(extra)
    return Scenario.model_validate(doc)


def _run(scenario: Scenario, native: bool) -> dict[str, Any]:
    return replay_sim(scenario, list(scenario.policies), data_plane=native)["policies"]


def test_the_proxy_carries_what_it_can_express_and_answers_every_request() -> None:
    runs = _run(_scenario(), True)
    for name in ("p2c", "least_outstanding", "round_robin"):
        p = runs[name]
        carried = p["data_plane"]
        assert carried["native_share"] > 0.95 and p["lost"] == 0, (name, carried)
        assert p["slo_attainment"] > 0.98 and set(p["by_node"]) == {"a", "b"}, (name, p["by_node"])
    slo = runs["compass"]  # a policy the proxy cannot express: every request to the router
    assert slo["data_plane"]["native"] == 0 and slo["lost"] == 0 and slo["slo_attainment"] > 0.98


def test_a_killed_node_is_retried_elsewhere_and_left_out() -> None:
    faults = [{"at_s": 2.0, "kind": "kill_node", "node": "b", "duration_s": 3.0}]
    runs = _run(_scenario(faults=faults, policies=["p2c"]), True)
    p = runs["p2c"]
    assert p["data_plane"]["native_share"] > 0.95 and p["lost"] == 0
    # refused connections go to the other node, and the checks take b out: nothing fails for it
    assert p["slo_attainment"] > 0.97 and not p["errors"], p["errors"]


def test_a_central_routers_proxy_carries_linked_sites_and_leaves_a_cut_one_to_the_router() -> None:
    """A router in no site, edge-a's clients 20 ms from the cloud: the proxy carries their requests and
    a cloud node's answers wait out the link both ways; while the link is cut edge-a's requests go to
    the router, which sends them to edge-a's node only."""
    links = {
        "partitions": ["edge-a", "cloud"],
        "links": [{"a": "edge-a", "b": "cloud", "rtt_ms": 20}],
        "nodes": [
            {"id": "a", "partition": "edge-a", "slots": 1, "models": ["sensor_mlp"]},
            {"id": "c", "partition": "cloud", "tier": "cloud", "slots": 2, "models": ["sensor_mlp"]},
        ],
    }
    on = _run(_scenario(topology=links, policies=["p2c"]), True)["p2c"]
    assert on["data_plane"]["native_share"] > 0.95 and on["lost"] == 0 and on["slo_attainment"] > 0.99
    assert on["by_node"]["c"] > 0 and on["latency_ms"]["p99"] >= 20.0  # (the cloud's answers crossed)
    cut = [{"at_s": 2.0, "kind": "cut_link", "link": ["edge-a", "cloud"], "duration_s": 2.0}]
    both = {n: _run(_scenario(topology=links, policies=["p2c"], faults=cut), n)["p2c"] for n in (True, False)}
    assert both[True]["data_plane"]["router"] > 0.2 * both[True]["sent"], "the cut site's requests: the router's"
    for p in both.values():
        assert p["lost"] == 0 and not p["errors"] and p["slo_attainment"] > 0.99, p


def test_slo_priority_is_carried_with_its_deadline_filter_as_the_proxys_admission() -> None:
    """About 2.5x what two slow nodes execute: the proxy refuses early (429) about as many bulk requests
    as the router's deadline filter does, and every priority request is tried and answers in time."""
    nodes = [{"id": n, "partition": "edge-a", "slots": 1, "speed": 0.005, "models": ["sensor_mlp"]} for n in "ab"]
    work = {
        "duration_s": 6,
        "warmup_s": 0.5,
        "sites": [
            {"site": "edge-a", "name": "bulk", "rate_rps": 400, "models": {"sensor_mlp": 1.0}, "deadline_ms": {0: 40}},
            {
                "site": "edge-a",
                "name": "alerts",
                "rate_rps": 20,
                "models": {"sensor_mlp": 1.0},
                "priorities": {5: 1.0},
                "deadline_ms": {5: 60},
            },
        ],
    }
    scenario = _scenario(topology={"partitions": ["edge-a"], "nodes": nodes}, workload=work, policies=["slo_priority"])
    on, off = _run(scenario, True)["slo_priority"], _run(scenario, False)["slo_priority"]
    assert on["data_plane"]["native_share"] > 0.95 and on["lost"] == 0 == off["lost"]
    early = on["error_reasons"]["no node can answer within the deadline"]
    filtered = off["error_reasons"]["no node for model 'sensor_mlp' passed filter 'deadline_filter'"]
    assert 0.75 < early / filtered < 1.33, (early, filtered)
    assert abs(on["by_priority"]["0"]["completed"] / off["by_priority"]["0"]["completed"] - 1.0) < 0.15
    alerts = on["by_priority"]["5"]
    assert alerts["completed"] == alerts["sent"] and alerts["slo_attainment"] == 1.0


def test_edge_first_keeps_its_sites_requests_home_until_the_site_has_no_room() -> None:
    """A router standing in edge-a carries edge-a's requests on edge-a's nodes while they have room and
    spills to the cloud when they have none; a request naming another site goes to the router."""
    topology = {
        "partitions": ["edge-a", "cloud"],
        "nodes": [
            {"id": "a", "partition": "edge-a", "slots": 1, "models": ["sensor_mlp"]},
            {"id": "b", "partition": "edge-a", "slots": 1, "models": ["sensor_mlp"]},
            {"id": "c", "partition": "cloud", "tier": "cloud", "slots": 4, "models": ["sensor_mlp"]},
        ],
    }

    def run(rate: float, speed: float) -> dict[str, Any]:
        for n in topology["nodes"][:2]:  # type: ignore[index]
            n["speed"] = speed
        sites = [
            {"site": "edge-a", "rate_rps": rate, "models": {"sensor_mlp": 1.0}, "deadline_ms": {0: 300}},
            {"site": "cloud", "rate_rps": 10, "models": {"sensor_mlp": 1.0}, "deadline_ms": {0: 300}},
        ]
        scenario = _scenario(
            topology=topology,
            workload={"duration_s": 6, "warmup_s": 0.5, "sites": sites},
            policies=["edge_first"],
            router={"site": "edge-a"},
        )
        return _run(scenario, True)["edge_first"]

    light = run(40, 1.0)
    assert light["lost"] == 0 and light["slo_attainment"] > 0.98
    assert 0.7 < light["data_plane"]["native_share"] < 0.9  # (edge-a's 40/s natively, the cloud's 10/s not)
    assert light["by_node"]["c"] < 0.3 * (light["by_node"]["a"] + light["by_node"]["b"])  # (the cloud's own 10/s)
    heavy = run(200, 0.005)  # about 1.2x what edge-a's two slow nodes execute
    assert heavy["lost"] == 0 and heavy["data_plane"]["native_share"] > 0.9
    assert heavy["by_node"]["c"] > 0.2 * heavy["sent"]  # the spill


def test_routers_per_site_each_carry_their_own_sites_requests_through_their_own_proxy() -> None:
    """Routers per site, no emulated links: each site's proxy carries the requests of its own site's
    clients, edge_first's site the router's own, on its site's nodes while they have room; with links
    every site's proxy passes every request to its router, and the answers are the router's alone."""
    topology: dict[str, Any] = {
        "deployment": "per_site",
        "partitions": ["edge-a", "edge-b"],
        "nodes": [
            {"id": "a1", "partition": "edge-a", "slots": 1, "models": ["sensor_mlp"]},
            {"id": "a2", "partition": "edge-a", "slots": 1, "models": ["sensor_mlp"]},
            {"id": "b1", "partition": "edge-b", "slots": 1, "models": ["sensor_mlp"]},
            {"id": "b2", "partition": "edge-b", "slots": 1, "models": ["sensor_mlp"]},
        ],
    }
    mix = {"rate_rps": 40, "models": {"sensor_mlp": 1.0}, "deadline_ms": {0: 300}}
    sites = [{"site": s, **mix} for s in ("edge-a", "edge-b")]
    work = {"duration_s": 6, "warmup_s": 0.5, "sites": sites}
    scenario = _scenario(topology=topology, workload=work, policies=["edge_first", "p2c"])
    sim = replay_sim(scenario, list(scenario.policies), data_plane=True)["policies"]
    for name in ("edge_first", "p2c"):
        p = sim[name]
        assert p["data_plane"]["native_share"] > 0.95 and p["lost"] == 0, (name, p["data_plane"])
        assert p["slo_attainment"] > 0.98 and set(p["by_node"]) == {"a1", "a2", "b1", "b2"}, (name, p["by_node"])
    home = sim["edge_first"]["by_node"]  # each site's proxy kept its site's requests home
    assert abs(home["a1"] + home["a2"] - (home["b1"] + home["b2"])) < 0.2 * sim["edge_first"]["sent"]
    # an emulated 20 ms link between the sites: each proxy carries its site's requests still, and the
    # answers of the other site's nodes come after the link's delay, as through the router
    linked = _scenario(
        topology={**topology, "links": [{"a": "edge-a", "b": "edge-b", "rtt_ms": 20, "jitter_ms": 2}]},
        workload=work,
        policies=["p2c"],
    )
    on, off = _run(linked, True)["p2c"], _run(linked, False)["p2c"]
    assert on["data_plane"]["native_share"] > 0.95 and on["lost"] == 0 == off["lost"], on["data_plane"]
    assert set(on["by_node"]) == {"a1", "a2", "b1", "b2"}, "p2c crosses the link half the time"
    for run in (on, off):  # (half the answers cross the 20 ms link: the tail is the link's)
        assert 20.0 <= run["latency_ms"]["p99"] < 40.0 and run["latency_ms"]["p50"] < 20.0, run["latency_ms"]
