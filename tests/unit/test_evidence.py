"""The router's own evidence of a node's life (router.lifecycle.evidence): telemetry is advice, not a
lifeline. A node stays routable at any telemetry age while the router hears from it; a failure takes it
out at once; only nodes with stale telemetry and no evidence of late are probed."""

from __future__ import annotations

from policies import RouteRequest, build_policy
from policies.api import Context
from router.lifecycle import Failure, Lifecycle, LifecycleSettings, Send
from router.lifecycle.evidence import Evidence, ProbeConfig
from telemetry.cluster.store import ViewStore
from tests.helpers import load

NOW = 10_000.0


def lifecycle(**probes: float) -> Lifecycle[str]:
    store = ViewStore(stale_after_ms=500.0)
    lc: Lifecycle[str] = Lifecycle(LifecycleSettings(probes=ProbeConfig(**probes)), store, lambda e: True)  # type: ignore[arg-type]
    store.apply_many([load("a", sent_at_ms=NOW), load("b", sent_at_ms=NOW)], NOW)
    return lc


def test_an_answer_keeps_a_node_live_past_its_telemetry_and_a_failure_takes_it_out() -> None:
    ev = Evidence(ProbeConfig(fresh_ms=1000.0))
    assert not ev.alive("a", NOW)
    ev.observe("a", True, NOW)
    assert ev.alive("a", NOW + 999) and not ev.alive("a", NOW + 1001), "evidence counts fresh_ms"
    ev.observe("a", None, NOW + 10)  # the router stopped waiting: says nothing
    assert ev.alive("a", NOW + 20)
    ev.observe("a", False, NOW + 30)
    assert not ev.alive("a", NOW + 31), "a failure after the last sign of life: out at once"
    ev.observe("a", True, NOW + 40)
    assert ev.alive("a", NOW + 41)


def test_routing_goes_on_at_any_telemetry_age_while_the_router_hears_from_its_nodes() -> None:
    lc = lifecycle(fresh_ms=1000.0)
    policy = build_policy("p2c")
    late = NOW + 60_000.0  # a minute without telemetry: far past stale_after_ms and the panic age
    for t in (late, late + 600):
        lc.evidence.observe("a", True, t - 100)
        lc.evidence.observe("b", True, t - 100)
        a = lc.begin(RouteRequest("m"), policy, t, t + 100)
        assert isinstance(lc.decide(a, t), Send)
    lc.evidence.observe("b", False, late + 700)  # b's connection refused
    chosen = set()
    for i in range(40):
        t = late + 710 + i
        a = lc.begin(RouteRequest("m"), policy, t, t + 100)
        step = lc.decide(a, t)
        assert isinstance(step, Send)
        chosen.add(step.decision.node_id)
    assert chosen == {"a"}, "the failed node is out of rotation"
    assert lc.decide(lc.begin(RouteRequest("m"), policy, late + 5000, late + 5100), late + 5000).status == 503, (
        "silent on both telemetry and evidence: no node"
    )


def test_the_columnar_and_per_node_paths_agree_on_evidence() -> None:
    store = ViewStore(stale_after_ms=500.0)
    lc: Lifecycle[str] = Lifecycle(LifecycleSettings(), store, lambda e: True)
    store.apply_many([load(n, sent_at_ms=NOW) for n in "abcdef"], NOW)
    late = NOW + 60_000.0  # (past the panic age too)
    for n in "ace":
        lc.evidence.observe(n, True, late)
    view = lc.view()
    healthy = build_policy("least_outstanding").filters[0]
    ctx = Context(late, lc.rng)
    table = view.table("m")
    rows = healthy.admit_rows(RouteRequest("m"), view, table, ctx, None)  # type: ignore[attr-defined]
    by_rows = {table.nodes[i].node_id for i in range(len(table)) if rows is None or rows[i]}
    admit = healthy.admitter(RouteRequest("m"), view, ctx)  # type: ignore[attr-defined]
    assert by_rows == {n.node_id for n in view if admit(n)} == {"a", "c", "e"}


def test_only_stale_silent_nodes_are_probed_one_at_a_time() -> None:
    lc = lifecycle(interval_ms=200.0, max_per_round=1)
    assert lc.probes_due(NOW + 100) == [], "fresh telemetry: nothing to probe"
    late = NOW + 2000
    lc.evidence.observe("a", True, late - 50)  # a answered just now
    due = lc.probes_due(late)
    assert [n.node_id for n in due] == ["b"], "a has evidence within the interval; one probe per round"
    assert lc.probes_due(late + 10) == [], "b's probe is under way"
    lc.probed("b", False, late + 20)
    assert not lc.view().is_live(lc.store.view.get("b"), late + 20)  # type: ignore[arg-type]
    assert [n.node_id for n in lc.probes_due(late + 300)] == ["a"], "the longest silent first"
    lc.probed("a", True, late + 310)
    assert lc.view().is_live(lc.store.view.get("a"), late + 310)  # type: ignore[arg-type]
    assert lc.evidence.probes_ok == 1 and lc.evidence.probes_failed == 1


def test_each_attempts_end_is_evidence() -> None:
    lc = lifecycle()
    a = lc.begin(RouteRequest("m"), build_policy("p2c"), NOW, NOW + 100)
    send = lc.decide(a, NOW)
    assert isinstance(send, Send)
    lc.dispatched(send.state)
    node = send.decision.node_id
    lc.ended(a, node, send.state.partition, 503, "", NOW + 5000, Failure.CONNECT, twin_open=True)
    assert not lc.evidence.alive(node, NOW + 5001)
    lc.ended(a, node, send.state.partition, 429, "full", NOW + 5002, dispatched=False)
    assert lc.evidence.alive(node, NOW + 5003), "a refusal is an answer: the node is alive"


def test_the_simulator_serves_through_a_long_broker_outage_and_drops_a_node_that_dies_in_it() -> None:
    """The same evidence in the simulator: a broker outage past the panic age costs nothing, and a node
    killed in the middle of it stops getting traffic within 2 s."""
    from scenarios.calibrate.profile import load_profile
    from scenarios.sim import Profile, Simulation
    from scenarios.spec.schema import Scenario
    from scenarios.spec.workload import build_schedule

    s = Scenario.model_validate(
        {
            "name": "outage",
            "seed": 2,
            "topology": {
                "partitions": ["edge"],
                "nodes": [
                    {"id": "e1", "partition": "edge", "speed": 0.1, "models": ["sensor_mlp"]},
                    {"id": "e2", "partition": "edge", "speed": 0.1, "models": ["sensor_mlp"]},
                ],
            },
            "workload": {
                "duration_s": 50,
                "warmup_s": 1,
                "sites": [{"site": "edge", "rate_rps": 20, "models": {"sensor_mlp": 1.0}, "deadline_ms": {0: 200}}],
            },
            "faults": [
                {"at_s": 2, "kind": "broker_outage", "duration_s": 45},
                {"at_s": 40, "kind": "kill_node", "node": "e2"},
            ],
            "policies": ["round_robin"],
        }
    )
    schedule = build_schedule(s.workload, s.seed, 51)
    sim = Simulation(s, s.policies[0], schedule, Profile.from_json(load_profile()))
    results = sim.run()
    assert all(r.status == 200 for r in results if r.arrival.at_s < 40), "a broker outage is not a serving outage"
    late = [r for r in results if r.arrival.at_s > 42]
    assert late and all(r.node == "e1" and r.status == 200 for r in late), "the dead node left within 2 s"
