"""Copy scaling on fixed views: a model whose demand outgrows its warm copies gets one more, on the
node with the most free memory, at most one per model per cooldown."""

from __future__ import annotations

from typing import Any

from router.lifecycle.copies import CopyConfig, DemandMeter, plan_copies
from telemetry.cluster.schema import ModelLoad, NodeLoad
from telemetry.cluster.view import ClusterView
from tests.helpers import load

NOW = 10_000.0
CFG = CopyConfig(enabled=True, target_utilisation=0.5, cooldown_ms=3000)


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
