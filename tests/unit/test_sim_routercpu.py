"""The router's own core in the simulator (scenarios.sim.routercpu): where a scenario gives the router's
CPU, requests wait for the work ahead of them, the live saturation rule sheds on that lag, and past
capacity the simulator sees what the live router would; without it nothing changes."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from pydantic import ValidationError

from router.lifecycle.saturation import SaturationConfig
from scenarios.sim import DEFAULT_PROFILE, Profile, simulate
from scenarios.sim.routercpu import RouterCore
from scenarios.spec.schema import Scenario
from scenarios.spec.workload import build_schedule

PROFILE = Profile.from_json(json.loads(DEFAULT_PROFILE.read_text()))
MIX = {2: 0.1, 0: 0.3, -1: 0.6}


def _scenario(rate: float, cpu: tuple[float, float] | None, saturation: bool = True) -> Scenario:
    topology: dict[str, object] = {
        "partitions": ["edge-a"],
        "nodes": [
            {"id": f"n{i}", "partition": "edge-a", "slots": 2, "max_queue": 1024, "models": ["echo"]} for i in range(2)
        ],
    }
    if cpu is not None:
        topology["routers"] = [{"id": "r", "cpu_us_per_request": cpu[0], "cpu_us_per_refusal": cpu[1]}]
    site = {"site": "edge-a", "rate_rps": rate, "models": {"echo": 1}, "priorities": MIX,
            "deadline_ms": dict.fromkeys(MIX, 150.0)}  # fmt: skip
    return Scenario.model_validate(
        {
            "name": "core",
            "topology": topology,
            "workload": {"duration_s": 6, "sites": [site]},
            "router": {"saturation": {"enabled": saturation}},
            "policies": ["p2c"],
        }
    )


def _run(scenario: Scenario) -> tuple[dict[int, Counter[str]], float]:
    results = simulate(scenario, scenario.policies, PROFILE, build_schedule(scenario.workload, 1))["p2c"][0]
    by: dict[int, Counter[str]] = {p: Counter() for p in MIX}
    for r in results:
        c = by[r.arrival.priority]
        c["sent"] += 1
        c["in_time"] += r.status == 200 and r.latency_ms <= r.arrival.deadline_ms
        c[str(r.status)] += 1
    goodput = sum(c["in_time"] for c in by.values()) / scenario.workload.duration_s
    return by, goodput


def test_the_core_waits_for_the_work_ahead_and_ticks_late_by_it() -> None:
    core = RouterCore(1000.0, 250.0, SaturationConfig(window=2))
    assert core.arrive(0.0) == 0.0
    core.take(0.0, False)  # busy until 1 ms
    assert core.arrive(0.5) == 1.0  # waits for the request ahead
    core.take(1.0, False)  # busy until 2 ms
    for k in range(40):  # a backlog: each arrival 0.1 ms apart, each 1 ms of work
        start = core.arrive(1.0 + k * 0.1)
        core.take(start, False)
    # the ticks due at 10 and 20 ms found about 30 and 20 ms of work ahead of them
    core.arrive(20.5)
    assert core.saturation.lag_ms == pytest.approx(min(core.free_at, 42.0) - 20.0, abs=15.0)
    assert core.saturation.lag_ms > 15.0
    assert core.refuse(-1, 150.0) is not None  # sheddable refused on that lag
    assert core.refuse(2, 150.0) is None  # critical never (its budget is above the lag)
    core.arrive(10_000.0)  # idle since: the window's ticks on time
    assert core.saturation.lag_ms == 0.0
    assert core.take(10_000.0, True) == pytest.approx(10_000.25)  # a refusal's CPU


def test_the_core_says_how_busy_each_tick_was_and_its_shares_come_down_after_an_idle_spell() -> None:
    """Each tick is also told the part of its interval the core worked (the live loop's busy share): a
    core kept busy refuses a rising share of sheddable work on that alone; idle long enough after, the
    share is back to none (the idle ticks are fed, not only the lag's window)."""
    core = RouterCore(1000.0, 250.0, SaturationConfig())
    at = 0.0
    for _ in range(400):  # one request a ms, each a ms of work: busy on every tick, never behind
        start = core.arrive(at)
        core.take(start, False)
        at += 1.0
    sat = core.saturation
    assert sat.lag_ms < 2.0 and sat.busy > 0.95 and sat.shed_share == 1.0
    assert core.refuse(-1, 150.0) is not None and core.refuse(2, 150.0) is None
    core.arrive(at + 2_000.0)  # two idle seconds
    assert sat.busy == 0.0 and sat.shed_share == 0.0 and sat.bulk_share == 0.0
    assert core.refuse(-1, 150.0) is None


def test_below_capacity_the_core_changes_little() -> None:
    free_by, free = _run(_scenario(400.0, None))
    by, cored = _run(_scenario(400.0, (1000.0, 250.0)))
    assert cored >= 0.97 * free
    assert all(by[p]["503"] <= free_by[p]["503"] for p in MIX)  # (the few a cold view refuses, as without)


def test_past_capacity_the_rule_keeps_critical_in_time_where_refusals_are_cheap() -> None:
    """Twice the core's capacity, a refusal a tenth of a request: critical work in time, goodput near
    the bound (1 - 2f) / (1 - f) of the capacity; the rule off, the backlog makes everything late."""
    cap = 1000.0  # 1,000 us a request
    on, good_on = _run(_scenario(2 * cap, (1000.0, 100.0)))
    off, good_off = _run(_scenario(2 * cap, (1000.0, 100.0), saturation=False))
    assert on[2]["in_time"] >= 0.99 * on[2]["sent"]
    assert good_on >= 0.8 * cap  # the bound is 0.889
    assert on[-1]["503"] > on[0]["503"] > 0  # sheddable shed first, then bulk
    assert off[2]["in_time"] < 0.5 * off[2]["sent"]
    assert good_off < 0.3 * cap


def test_a_router_cpu_needs_both_figures() -> None:
    with pytest.raises(ValidationError, match="go together"):
        Scenario.model_validate(
            {
                **_scenario(1.0, None).model_dump(exclude_defaults=True),
                "topology": {
                    "partitions": ["a"],
                    "nodes": [{"id": "n", "partition": "a", "models": ["echo"]}],
                    "routers": [{"id": "r", "cpu_us_per_request": 500}],
                },
            }  # fmt: skip
        )
