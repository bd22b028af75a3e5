"""Copy scaling on fixed views: a model whose demand outgrows its warm copies gets one more, on the
node with the most free memory, at most one per model per cooldown."""

from __future__ import annotations

from typing import Any

from router.lifecycle.copies import CopyConfig, DemandMeter, plan_copies
from telemetry.cluster.schema import ModelLoad, NodeLoad
from telemetry.cluster.view import ClusterView
from tests.helpers import load

NOW = 10_000.0
# (one copy is enough here: the capacity rule alone; the spare copies have tests of their own below)
CFG = CopyConfig(enabled=True, target_utilisation=0.5, cooldown_ms=3000, min_copies=1)
SPARE = CFG.model_copy(update={"min_copies": 2, "spare_share": 0.25})


def node(node_id: str, resident: bool, free_mb: int = 100, exec_ms: float = 10.0, **kw: Any) -> NodeLoad:
    msg = load(node_id, sent_at_ms=NOW, **kw)
    return msg.replace(
        models={"m": ModelLoad(resident=resident, ewma_ms_by_batch={"1": exec_ms})},
        memory_budget_bytes=1000 << 20,
        memory_used_bytes=(1000 - free_mb) << 20,
    )


def view(*loads: NodeLoad) -> ClusterView:
    return ClusterView.of(list(loads), NOW)


def test_demand_above_the_warm_copies_capacity_loads_one_more_on_the_freest_node() -> None:
    # one warm copy, 1 slot, 10 ms: 100 req/s at full use, 50 at the planned 0.5
    v = view(node("warm", True), node("tight", False, free_mb=50), node("roomy", False, free_mb=400))
    assert plan_copies(v, {"m": 40.0}, NOW, CFG, set(), {}) == []
    assert plan_copies(v, {"m": 60.0}, NOW, CFG, set(), {}) == [("m", "roomy")]


def test_no_new_copy_while_one_loads_within_the_cooldown_or_without_any_warm_copy() -> None:
    v = view(node("warm", True), node("cold", False))
    assert plan_copies(v, {"m": 60.0}, NOW, CFG, {"m"}, {}) == [], "a copy is loading"
    assert plan_copies(v, {"m": 60.0}, NOW, CFG, set(), {"m": NOW - 1000}) == [], "cooldown"
    assert plan_copies(v, {"m": 60.0}, NOW, CFG, set(), {"m": NOW - 4000}) == [("m", "cold")]
    nowhere = view(node("a", False), node("b", False))
    assert plan_copies(nowhere, {"m": 500.0}, NOW, CFG, set(), {}) == [], "the first load is the policy's"


def test_stale_or_draining_nodes_neither_count_as_copies_nor_get_one() -> None:
    v = ClusterView.of([node("warm", True), node("old", False).replace(sent_at_ms=0.0)], 0.0)
    v = v.with_node(v.nodes["warm"], NOW)  # only `warm` was heard from recently
    assert plan_copies(v, {"m": 60.0}, NOW, CFG, set(), {}) == []


def test_more_warm_copies_and_slots_raise_the_capacity() -> None:
    v = view(node("w1", True, capacity=2), node("w2", True), node("cold", False))
    assert plan_copies(v, {"m": 140.0}, NOW, CFG, set(), {}) == [], "3 slots x 100/s x 0.5 = 150/s"
    assert plan_copies(v, {"m": 160.0}, NOW, CFG, set(), {}) == [("m", "cold")]


def test_the_demand_meter_counts_per_model_over_its_window() -> None:
    meter = DemandMeter(window_ms=1000)
    for t in range(0, 1000, 10):
        meter.record("m", NOW + t)
    meter.record("other", NOW)
    rates = meter.rates(NOW + 999)
    assert rates["m"] == 100.0 and rates["other"] == 1.0
    assert meter.rates(NOW + 2500) == {}, "quiet models drop out"
    for t in range(100_000):
        meter.record("busy", NOW + t)
    assert len(meter._times["busy"]) <= 1001, "a meter nobody reads stays within its window"


def test_a_rising_demand_gets_its_copy_one_load_time_ahead() -> None:
    """Below the warm copy's capacity now but climbing: the copy is planned for the demand a load time
    from now (the fleet's measured load, 2.5 s), not when it is already there; flat, it is not."""
    from router.lifecycle.copies import CopyState

    warm = node("warm", True).replace(
        models={"m": ModelLoad(resident=True, load_ms=2500.0, ewma_ms_by_batch={"1": 10.0})}
    )
    v = view(warm, node("cold", False))
    rising, flat = CopyState(CFG), CopyState(CFG)
    for t in range(0, 1000, 50):  # a 2 s window: 20/s, then 40/s; 50/s is the warm copy's planned capacity
        rising.record("m", NOW - 2000 + t)
    for t in range(1000, 2000, 25):
        rising.record("m", NOW - 2000 + t)
    for t in range(0, 2000, 1000 // 30):
        flat.record("m", NOW - 2000 + t)
    assert rising.demand.rates(NOW)["m"] == 30.0 and 30.0 <= flat.demand.rates(NOW)["m"] <= 31.0
    assert rising.plan(v, NOW) == [("m", "cold")], "30/s now, about 100/s one load from now"
    v2 = view(node("warm", True), node("cold", False))
    assert flat.plan(v2, NOW) == [], "a flat 30/s is not more than the copy serves"


def test_a_load_that_would_evict_another_models_last_warm_copy_goes_elsewhere() -> None:
    both = {"m": ModelLoad(resident=False), "hot": ModelLoad(resident=True, ewma_ms_by_batch={"1": 5.0})}
    only_hot = node("only-hot", False, free_mb=10).replace(models=both)  # full: a load there evicts `hot`
    spare = node("spare", False, free_mb=5)
    v = view(node("warm", True), only_hot, spare)
    assert plan_copies(v, {"m": 60.0, "hot": 10.0}, NOW, CFG, set(), {}) == [("m", "spare")]
    assert plan_copies(view(node("warm", True), only_hot), {"m": 60.0, "hot": 10.0}, NOW, CFG, set(), {}) == []
    assert plan_copies(view(node("warm", True), only_hot), {"m": 60.0}, NOW, CFG, set(), {}) == [("m", "only-hot")], (
        "`hot` has no demand: its copy may go"
    )
    roomy = only_hot.replace(memory_used_bytes=100 << 20)  # room for a model of the mean size: nothing leaves
    assert plan_copies(view(node("warm", True), roomy), {"m": 60.0, "hot": 10.0}, NOW, CFG, set(), {}) == [
        ("m", "only-hot")
    ]


def test_a_model_in_demand_keeps_a_spare_copy_ahead_of_a_jump() -> None:
    """Below its one copy's capacity (50/s planned), a model with at least a quarter of it (12.5/s) gets a
    second warm copy, which no trend would have asked for; one with less, or with two, does not; the
    trend's projection does not earn one (only the demand measured)."""
    v = view(node("warm", True), node("cold", False))
    assert plan_copies(v, {"m": 20.0}, NOW, SPARE, set(), {}) == [("m", "cold")]
    assert plan_copies(v, {"m": 10.0}, NOW, SPARE, set(), {}) == [], "under a quarter of a copy"
    assert plan_copies(v, {"m": 10.0}, NOW, SPARE, set(), {}, projected_rps={"m": 40.0}) == [], "a trend alone"
    assert plan_copies(v, {"m": 20.0}, NOW, CFG, set(), {}) == [], "min_copies 1: none"
    two = view(node("w1", True), node("w2", True), node("cold", False))
    assert plan_copies(two, {"m": 40.0}, NOW, SPARE, set(), {}) == [], "two warm copies already"


def test_a_spare_copy_evicts_no_copy_another_model_in_demand_needs() -> None:
    """A full node holding `k` is the only place for `m`'s spare copy: it goes there only while `k` keeps
    its own two copies elsewhere or is not in demand, so two models cannot take each other's spare copies
    in turn; a copy the demand itself asks for is placed by the capacity rule alone."""
    k_warm = {"m": ModelLoad(resident=False), "k": ModelLoad(resident=True, ewma_ms_by_batch={"1": 10.0})}
    full = node("full", False, free_mb=10).replace(models=k_warm)  # a load there evicts `k`
    other_k = node("other-k", False, free_mb=0).replace(models=k_warm)
    v = view(node("warm", True), full, other_k.replace(node_id="k2", endpoint="http://k2"))
    assert plan_copies(v, {"m": 20.0, "k": 20.0}, NOW, SPARE, set(), {}) == [], "k in demand, two copies"
    assert plan_copies(v, {"m": 20.0, "k": 5.0}, NOW, SPARE, set(), {}) == [("m", "full")], "k not in demand"
    three = view(node("warm", True), full, *(other_k.replace(node_id=f"k{i}", endpoint=f"http://k{i}") for i in (2, 3)))
    assert plan_copies(three, {"m": 20.0, "k": 20.0}, NOW, SPARE, set(), {}) == [("m", "full")], "k keeps two"
    # a copy `m`'s demand asks for (over its one copy's 50/s) may take `k`'s spare: k still serves its 20/s
    assert plan_copies(v, {"m": 60.0, "k": 20.0}, NOW, SPARE, set(), {}) == [("m", "full")]


def test_copies_the_demand_asks_for_come_before_spare_ones() -> None:
    models = {name: ModelLoad(resident=True, ewma_ms_by_batch={"1": 10.0}) for name in ("over", "spare")}
    cold = {name: ModelLoad(resident=False) for name in ("over", "spare")}
    v = view(node("warm", True).replace(models=models), node("cold", False).replace(models=cold))
    one = SPARE.model_copy(update={"max_loading": 1})
    assert plan_copies(v, {"over": 60.0, "spare": 40.0}, NOW, one, set(), {}) == [("over", "cold")]
    assert plan_copies(v, {"over": 30.0, "spare": 40.0}, NOW, one, set(), {}) == [("spare", "cold")]


def test_at_most_max_loading_copies_load_at_once_fleet_wide() -> None:
    models = {name: ModelLoad(resident=True, ewma_ms_by_batch={"1": 10.0}) for name in ("a", "b", "c")}
    cold = {name: ModelLoad(resident=False) for name in ("a", "b", "c")}
    v = view(node("warm", True).replace(models=models), node("cold", False).replace(models=cold))
    demand = {"a": 60.0, "b": 70.0, "c": 80.0}
    assert plan_copies(v, demand, NOW, CFG, set(), {}) == [("c", "cold"), ("b", "cold")], "max_loading 2"
    assert plan_copies(v, demand, NOW, CFG, {"z"}, {}) == [("c", "cold")], "one loading already"


def test_a_planned_copy_is_a_load_under_way_where_the_policies_see_loads() -> None:
    """The planner's load is recorded in the overlay (as a request's cold send records its own), so
    `compass` charges what is left of it on that node instead of starting a load of its own elsewhere;
    the load time is the fleet's measured one where the target never loaded the model."""
    from router.lifecycle import Lifecycle, LifecycleSettings
    from router.lifecycle.copies import CopyState
    from telemetry.cluster.store import ViewStore

    store = ViewStore()
    warm = node("warm", True).replace(
        models={"m": ModelLoad(resident=True, load_ms=2500.0, ewma_ms_by_batch={"1": 10.0})}
    )
    for msg in (warm, node("cold", False)):
        store.apply(msg, NOW)
    lc: Lifecycle[str] = Lifecycle(LifecycleSettings(), store, lambda e: False)
    state = CopyState(CFG)
    for t in range(0, 2000, 10):
        state.record("m", NOW - 2000 + t)
        state.record("m", NOW - 2000 + t + 5)
    assert state.plan(store.view, NOW, lc.tracker) == [("m", "cold")]
    cold = store.view.get("cold")
    assert cold is not None and lc.tracker.load_ready_at(cold, "m") == NOW + 2500.0


def test_loads_the_policy_set_off_count_against_max_loading() -> None:
    """A cold send's load (the policy's own, recorded by the overlay) holds a node's loader and memory
    as a copy does: with `max_loading` of them under way the planner waits."""
    from router.lifecycle import Lifecycle, LifecycleSettings
    from router.lifecycle.copies import CopyState
    from telemetry.cluster.store import ViewStore

    store = ViewStore()
    two = {name: ModelLoad(resident=name == "m", ewma_ms_by_batch={"1": 10.0}) for name in ("m", "x", "y")}
    cold = {name: ModelLoad(resident=False) for name in ("m", "x", "y")}
    for msg in (node("warm", True).replace(models=two), node("c1", False).replace(models=cold)):
        store.apply(msg, NOW)
    lc: Lifecycle[str] = Lifecycle(LifecycleSettings(), store, lambda e: False)
    c1 = store.view.get("c1")
    assert c1 is not None
    lc.tracker.sent_model(c1, "x", NOW)  # the policy sent x and y to a node where they were cold
    lc.tracker.sent_model(c1, "y", NOW)
    assert lc.tracker.loads_under_way(store.view) == {"x": 1, "y": 1}
    state = CopyState(CFG)
    for t in range(0, 2000, 10):
        state.record("m", NOW - 2000 + t)
    assert state.plan(store.view, NOW) == [("m", "c1")], "without the tracker: only its own loads count"
    state2 = CopyState(CFG)
    for t in range(0, 2000, 10):
        state2.record("m", NOW - 2000 + t)
    assert state2.plan(store.view, NOW, lc.tracker) == [], "two loads under way: max_loading 2"


def test_a_policy_run_turns_copy_scaling_on_or_off_in_the_simulator() -> None:
    """`copies` among a run's router settings: the same scenario compared with copy scaling on and off
    in one replay (one model's demand rising eightfold on boxes where it is warm on one)."""
    from scenarios.calibrate.profile import load_profile
    from scenarios.sim import Profile, Simulation
    from scenarios.spec.schema import Scenario
    from scenarios.spec.workload import build_schedule

    models = {m: {"zoo": "mobilenet_s", "seed": i + 1, "size_mb": 700, "load_ms": 2500} for i, m in enumerate("habc")}
    orders = [["h", "a", "b", "c"], ["b", "c", "h", "a"], ["c", "a", "h", "b"], ["a", "b", "h", "c"]]
    hot = [{"site": "s", "name": f"h{k}", "rate_rps": 20 + 35 * k, "start_s": 10 * k, "stop_s": 10 * k + 10,
            "models": {"h": 1}, "deadline_ms": {0: 150}} for k in range(5)]  # fmt: skip
    sc = Scenario.model_validate(
        {
            "name": "ramp",
            "seed": 5,
            "models": models,
            "topology": {
                "partitions": ["s"],
                "nodes": [
                    {"id": f"g{i}", "partition": "s", "speed": 0.01, "memory_budget_mb": 1500, "models": o}
                    for i, o in enumerate(orders)
                ],
            },  # fmt: skip
            "workload": {
                "duration_s": 50,
                "warmup_s": 1,
                "sites": [
                    *hot,
                    {
                        "site": "s",
                        "name": "rest",
                        "rate_rps": 9,
                        "models": {"a": 1, "b": 1, "c": 1},
                        "deadline_ms": {0: 150},
                    },
                ],
            },  # fmt: skip
            "policies": [
                {"name": "on", "preset": "compass", "router": {"copies": {"enabled": True}}},
                {"name": "off", "preset": "compass", "router": {"copies": {"enabled": False}}},
            ],  # fmt: skip
        }
    )
    profile = Profile.from_json(load_profile())
    schedule = build_schedule(sc.workload, sc.seed, 51)
    made, hot = {}, {}
    for run in sc.policies:
        sim = Simulation(sc, run, schedule, profile)
        sim.run()
        made[run.name] = sim.copies_made
        assert sim.copy_samples is not None
        hot[run.name] = [counts["h"] for _, counts in sim.copy_samples]  # (a report's timeline.copies)
    assert made["on"] >= 1 and made["off"] == 0, made
    assert hot["on"][0] == 1 and max(hot["on"]) >= 2, f"copies on: the hot model gains a warm copy {hot}"
