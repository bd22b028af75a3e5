from __future__ import annotations

import math
from typing import Any

import pytest

from scenarios.replay.report import format_table, summarize
from scenarios.spec.workload import Arrival, Result
from telemetry.measure.quantiles import nearest_rank


def r(status: int | None, ms: float, prio: int = 0, node: str = "a", deadline: float = 100.0) -> Result:
    return Result(Arrival(0.0, "s", "m", prio, deadline), status, ms, node if status == 200 else "none")


def test_percentile_nearest_rank() -> None:
    values = [float(i) for i in range(1, 101)]
    assert nearest_rank(values, 0.5, presorted=True) == 50.0
    assert nearest_rank(values, 0.99, presorted=True) == 99.0
    assert nearest_rank(values, 1.0, presorted=True) == 100.0
    assert nearest_rank([], 0.5) == 0.0
    assert math.isnan(nearest_rank([], 0.5, empty=math.nan)), "a caller may ask for NaN where 0 could be a value"


def test_summary_accounts_for_every_request() -> None:
    results = [
        r(200, 10),
        r(200, 150),
        r(503, 1),
        r(504, 100, prio=5),
        r(None, 5000, prio=5),
        r(200, 20, prio=5, node="b"),
    ]
    s = summarize(results, 2.0)
    assert s["sent"] == 6 and s["completed"] == 3
    assert s["errors"] == {"503": 1, "504": 1, "lost": 1}
    assert s["lost"] == 1
    assert s["sent"] == s["completed"] + sum(s["errors"].values())
    assert s["slo_attainment"] == round(2 / 6, 4)  # 150 ms missed its 100 ms deadline
    assert s["by_node"] == {"a": 2, "b": 1}
    assert set(s["by_priority"]) == {"0", "5"}
    p5 = s["by_priority"]["5"]
    assert p5["sent"] == 3 and p5["completed"] == 1 and p5["lost"] == 1
    assert s["latency_ms"]["max"] == 150
    table = format_table({"scenario": "x", "mode": "live", "policies": {"p": s}})
    assert "p " in table and "lost" in table


def test_recovery_compares_the_level_before_a_trigger_with_the_level_after_it_settles() -> None:
    from pathlib import Path

    from scenarios.replay.common import triggers
    from scenarios.replay.report import recovery
    from scenarios.spec.schema import load_scenario

    def at(t: float, status: int, ms: float) -> Result:
        return Result(Arrival(t, "s", "m", 0, 100.0), status, ms, "a" if status == 200 else "none")

    # 10 req/s of 20 ms answers, a trigger from 20 s to 30 s that fails everything, then a system
    # that stays degraded (half the answers late) or one that recovers
    def run(degraded: bool) -> list[Result]:
        out = []
        for i in range(600):
            t = i / 10.0
            if 20 <= t < 30:
                out.append(at(t, 503, 1.0))
            else:
                out.append(at(t, 200, 150.0 if degraded and t >= 30 and i % 2 else 20.0))
        return out

    healthy = recovery(run(False), [("surge", 20.0, 30.0)], 60.0)[0]
    assert healthy["before"]["goodput_rps"] == 10.0 and healthy["goodput_ratio"] == 1.0 and healthy["p99_ratio"] == 1.0
    assert healthy["after"]["from_s"] == 35.0 and healthy["after"]["to_s"] == 55.0
    stuck = recovery(run(True), [("surge", 20.0, 30.0)], 60.0)[0]
    assert stuck["goodput_ratio"] == 0.5 and stuck["p99_ratio"] > 5
    assert recovery(run(False), [("late", 50.0, 59.0)], 60.0) == [], "nothing to measure after it: no row"

    s = load_scenario(Path(__file__).resolve().parents[2] / "scenarios" / "metastable.yaml")
    assert triggers(s) == [("traffic surge", 22.0, 52.0), ("slow_node box-2", 77.0, 87.0)]


def test_recovery_against_the_same_arrivals_without_the_trigger() -> None:
    """An after-window that holds a burst of its own arrivals has a higher p99 than the window before
    the trigger whatever the trigger left behind; the same arrivals without the trigger tell the two
    apart: the ratio against them is 1 when nothing outlived the trigger."""
    from scenarios.replay.common import untriggered
    from scenarios.replay.report import recovery
    from scenarios.spec.schema import load_scenario
    from scenarios.spec.workload import build_schedule

    def at(t: float, ms: float) -> Result:
        return Result(Arrival(t, "s", "m", 0, 1000.0), 200, ms, "a")

    # 10 req/s of 20 ms answers; the after-window (35-55 s) holds a burst answered in 90 ms, with the
    # trigger (20-30 s) or without it
    def run(trigger: bool, left_behind: float = 0.0) -> list[Result]:
        out = []
        for i in range(600):
            t = i / 10.0
            ms = 90.0 if 40 <= t < 41 else 20.0
            if trigger and 20 <= t < 30:
                ms = 900.0
            elif trigger and t >= 30:
                ms += left_behind
            out.append(at(t, ms))
        return out

    row = recovery(run(True), [("surge", 20.0, 30.0)], 60.0, {"surge": run(False)})[0]
    assert row["p99_ratio"] == 4.5, "the burst against a quiet window before"
    assert row["untriggered"]["p99_ms"] == 90.0 and row["p99_ratio_untriggered"] == 1.0
    assert row["goodput_ratio_untriggered"] == 1.0
    stuck = recovery(run(True, 30.0), [("surge", 20.0, 30.0)], 60.0, {"surge": run(False)})[0]
    assert stuck["p99_ratio_untriggered"] == pytest.approx(120 / 90, rel=1e-3), "what the trigger left behind"
    assert "untriggered" not in recovery(run(True), [("surge", 20.0, 30.0)], 60.0)[0], "live runs: none"

    scenario = load_scenario("metastable")
    schedule = build_schedule(scenario.workload, scenario.seed)
    variants = untriggered(scenario, schedule)
    assert set(variants) == {"traffic surge", "slow_node box-2"}
    without_surge, arrivals = variants["traffic surge"]
    assert without_surge is scenario and arrivals == [a for a in schedule if not 22 <= a.at_s < 52 or a.source != 1]
    assert len(schedule) - len(arrivals) == sum(a.source == 1 for a in schedule) > 10_000
    without_slowdown, same = variants["slow_node box-2"]
    assert same is schedule and without_slowdown.faults == [] and scenario.faults != []


def test_a_live_runs_overload_counts_are_its_own_not_the_routers_running_totals() -> None:
    """The router counts retries and budget refusals since it started (a replay's calibration and
    earlier policies included); a run's report takes off what they stood at before it, as the
    simulator's fresh run counts them. The window and the margin stay as the run left them."""
    from scenarios.replay.run import _overload_during

    before = {"answer_margin_ms": 1.0, "retries": 484, "retry_budget": {"ratio": 0.2, "first_tries": 90, "refused": 7}}
    after = {
        "answer_margin_ms": 1.6,
        "retries": 503,
        "retry_budget": {"ratio": 0.2, "first_tries": 120, "refused": 9},
        "worst_window": {"ratio": 0.05},
    }
    run = _overload_during(before, after)
    assert run["retries"] == 19 and run["retry_budget"]["refused"] == 2
    assert run["retry_budget"]["first_tries"] == 120 and run["answer_margin_ms"] == 1.6
    assert run["worst_window"] == {"ratio": 0.05}
    assert after["retries"] == 503, "the router's own block is left as it was"
    assert _overload_during({}, after)["retries"] == 503, "a router that did not answer before: all of it"


def test_the_comparison_shows_the_host_overhead_beside_the_latencies() -> None:
    """A fast scenario's p50 moves with the host's per-request overhead from one run to the next, so
    the live-against-simulated comparison gives that overhead, live and simulated, beside the latencies
    it explains (and says n/a where a side lacks it)."""
    from scenarios.replay.report import format_comparison
    from scenarios.replay.run import compare

    def side(p50: float, overhead: float | None) -> dict[str, Any]:
        node_ms: dict[str, float] = {"exec_mean": 2.4, "queue_mean": 0.5}
        if overhead is not None:
            node_ms["overhead_p50"] = overhead
        return {
            "policies": {
                "p2c": {
                    "latency_ms": {"p50": p50, "p95": 9.0, "p99": 12.0},
                    "slo_attainment": 1.0,
                    "node_ms": node_ms,
                }
            }
        }

    row = compare(side(4.0, 2.0), side(4.8, 2.5))["p2c"]
    assert row["overhead_p50"] == {"live": 2.0, "sim": 2.5, "rel_err": 0.25}
    assert row["p50"]["rel_err"] == 0.2
    table = format_comparison({"p2c": row})
    assert "overhead ms live/sim" in table.splitlines()[0]
    assert "2.00 / 2.50" in table.splitlines()[1]
    assert "n/a" in format_comparison(compare(side(4.0, None), side(4.8, 2.5))).splitlines()[1]


def test_in_time_local_work_by_site_and_the_delay_timer_line() -> None:
    def at(site: str, status: int | None, ms: float, node: str) -> Result:
        return Result(Arrival(0.0, site, "m", 0, 100.0), status, ms, node)

    results = [
        at("store", 200, 20, "box"),  # local, in time
        at("store", 200, 120, "box"),  # local, late
        at("store", 200, 40, "cloud-1"),  # in time, but not local
        at("store", 503, 1, "none"),
        at("cloud", 200, 10, "cloud-1"),  # local to its own site
    ]
    nodes = {"box": ("store", 0.0), "cloud-1": ("cloud", 1.0)}
    s = summarize(results, 1.0, nodes)
    assert s["local_in_time_share"] == 0.4  # 2 of 5 sent
    assert set(s["by_site"]) == {"cloud", "store"} and s["by_site"]["store"]["sent"] == 4
    s["policy_state"] = {
        "delay_spill": {"sites": {"store": {"delay_ms": 12.5, "deferred": 9, "local_after_wait": 4}}, "history": []}
    }
    table = format_table({"scenario": "x", "mode": "sim", "policies": {"edge_first": s}})
    assert "delay timer of edge_first at store: 12.5 ms; 9 held, 4 found a local slot; in time locally 40.0%" in table


def test_cold_starts_are_counted_per_model() -> None:
    def ran(model: str, cold: int, status: int = 200) -> Result:
        out = Result(Arrival(0.0, "s", model, 0, 100.0), status, 10.0, "a" if status == 200 else "none")
        out.cold = cold
        return out

    s = summarize([ran("big", 1), ran("big", 1), ran("small", 0), ran("big", 1, status=503), ran("pipe", 2)], 1.0)
    assert s["residency"]["answered_cold"] == 4
    assert s["residency"]["answered_cold_by_model"] == {"big": 2, "pipe": 2}
