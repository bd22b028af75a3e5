"""Scaling signals (router.lifecycle.scaling): the queueing model's node counts, the demand meter and its
trend, the signals per pool and model, and the simulated autoscaler acting on them."""

from __future__ import annotations

import math

import pytest

from router.lifecycle.scaling import ALL_MODELS, Demand, ScalingConfig, erlang_c, nodes_needed, signals
from tests.helpers import load, view


def test_erlang_c_at_its_known_values() -> None:
    assert erlang_c(1, 0.5) == pytest.approx(0.5)  # M/M/1: the probability of waiting is the load
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)
    assert erlang_c(10, 8.0) == pytest.approx(0.4092, abs=1e-4)
    assert erlang_c(3, 3.0) == 1.0 and erlang_c(3, 0.0) == 0.0


def test_nodes_needed_grows_with_the_demand_and_a_tighter_deadline_or_target() -> None:
    base = [nodes_needed(rate, 14.0, 1, 150.0, 0.99, 1000) for rate in (10, 50, 100, 200, 400)]
    assert base == sorted(base) and base[0] == 1 and base[-1] >= math.ceil(400 * 0.014)
    assert nodes_needed(200, 14.0, 1, 30.0, 0.99, 1000) >= nodes_needed(200, 14.0, 1, 150.0, 0.99, 1000)
    assert nodes_needed(200, 14.0, 1, 150.0, 0.9999, 1000) >= nodes_needed(200, 14.0, 1, 150.0, 0.99, 1000)
    assert nodes_needed(200, 14.0, 4, 150.0, 0.99, 1000) <= nodes_needed(200, 14.0, 1, 150.0, 0.99, 1000)
    assert nodes_needed(0, 14.0, 1, 150.0, 0.99, 1000) == 0
    assert nodes_needed(10, 200.0, 1, 150.0, 0.99, 50) == 50, "a deadline the service alone misses: the most"


def test_the_demand_is_taken_ahead_on_its_trend_only_while_it_rises() -> None:
    d = Demand(window_s=10)
    for second in range(20):  # 10, 20, ... requests a second
        for _ in range(10 * (second + 1)):
            d.record("edge-a", "edge", "m", 150.0, second * 1000.0 + 10.0)
    now = 20_000.0
    flat = d.rates(now)[("edge-a", "edge", "m")]
    ahead = d.rates(now, lead_s=10.0)[("edge-a", "edge", "m")]
    assert flat == (pytest.approx(155.0), pytest.approx(150.0))  # seconds 10-19: 110..200
    assert ahead[0] == pytest.approx(155.0 + 10.0 * (10.0 + 4.5 + 1.0))
    falling = Demand(window_s=10)
    for second in range(10):
        for _ in range(100 - 10 * second):
            falling.record("edge-a", "edge", "m", 150.0, second * 1000.0)
    rate = falling.rates(10_000.0)[("edge-a", "edge", "m")][0]
    assert falling.rates(10_000.0, lead_s=10.0)[("edge-a", "edge", "m")][0] == rate


def test_signals_per_pool_and_model_and_for_the_pool_as_a_whole() -> None:
    v = view(
        load("a1", models={"m": 10.0, "k": 2.0}, capacity=1),
        load("a2", models={"m": 10.0}, capacity=1),
        load("c1", models={"m": 4.0}, partition="cloud", tier="cloud", capacity=4),
        load("gone", models={"m": 10.0}, status="draining"),
        heard_at_ms=4_900.0,
    )
    d = Demand(window_s=5)
    for second in range(5):
        for _ in range(150):
            d.record("edge-a", "edge", "m", 200.0, second * 1000.0)
        for _ in range(20):
            d.record("edge-a", "edge", "k", 50.0, second * 1000.0)
        for _ in range(100):
            d.record("cloud", "cloud", "m", 200.0, second * 1000.0)
    got = {(s.site, s.tier, s.model): s for s in signals(v, d, ScalingConfig(), 5_000.0)}
    edge_m = got[("edge-a", "edge", "m")]
    assert edge_m.nodes == 2 and edge_m.demand_rps == 150.0 and edge_m.service_ms == 10.0
    assert edge_m.needed == nodes_needed(150.0, 10.0, 1, 200.0, 0.99, 1000) >= 2
    pool = got[("edge-a", "edge", ALL_MODELS)]
    assert pool.nodes == 2 and pool.demand_rps == 170.0 and pool.deadline_ms == 50.0
    assert pool.needed >= edge_m.needed
    assert got[("cloud", "cloud", "m")].needed == nodes_needed(100.0, 4.0, 4, 200.0, 0.99, 1000)


def test_the_autoscaler_adds_nodes_before_the_crowd_and_saves_node_seconds() -> None:
    from scenarios.replay.simulated import replay_sim
    from scenarios.spec.schema import Scenario

    nodes = [{"id": f"b{i}", "partition": "s", "slots": 1, "speed": 0.01, "models": ["mobilenet_s"]} for i in range(6)]
    doc = {
        "name": "ramp",
        "seed": 4,
        "topology": {"partitions": ["s"], "nodes": nodes},
        "router": {"scaling": {"target": 0.999, "window_s": 10, "lead_s": 15}},
        "autoscale": {"interval_s": 5, "up_delay_s": 10, "down_after_s": 10,
                      "pools": [{"site": "s", "nodes": [n["id"] for n in nodes], "min_nodes": 2}]},
        "workload": {"duration_s": 100, "warmup_s": 2, "sites": [
            {"site": "s", "arrival": "diurnal", "rate_rps": 300, "min_rate_rps": 30, "period_s": 100,
             "models": {"mobilenet_s": 1.0}, "deadline_ms": {0: 150}}]},
        "policies": ["p2c", {"name": "peak", "preset": "p2c", "autoscale": False}],
    }  # fmt: skip
    s = Scenario.model_validate(doc)
    report = replay_sim(s, list(s.policies))["policies"]
    scaled, peak = report["p2c"], report["peak"]
    pool = scaled["autoscale"]["pools"][0]
    assert scaled["slo_attainment"] >= 0.99 and peak["slo_attainment"] >= 0.99
    assert pool["node_seconds"] < pool["peak_node_seconds"] * 0.9
    assert max(up for _, _, up in pool["ticks"]) > 2, "nodes were added"
    assert scaled["autoscale"]["first_slo_miss_s"] is None or (
        scaled["autoscale"]["first_rise_s"] < scaled["autoscale"]["first_slo_miss_s"]
    )
    assert "autoscale" not in peak
