"""Simulated replays: each policy run of a scenario in the simulator, on the schedule a live replay
would send, summarised as a live run is (scenarios.replay.report).

Each run is one independent simulation (a cell, scenarios.sim.cells): with `jobs` or `ray` the runs
of a replay run side by side, on local processes or as Ray tasks, and the report is the same as run
one after another (the runs come back in their order; each is seeded from the scenario alone).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from scenarios.replay.common import (
    NODE_RESIDENCY_COUNTERS,
    header,
    moves_during,
    node_costs,
    offered_rate,
    plan,
    relative,
    run_router,
    triggers,
    untriggered,
)
from scenarios.replay.copies import add_residency
from scenarios.replay.partitions import partitions
from scenarios.replay.report import node_warm_rates, recovery, series, summarize
from scenarios.replay.tenants import tenant_weights
from scenarios.sim.cells import run_cells
from scenarios.spec.schema import PolicyRun, Scenario
from scenarios.spec.workload import Arrival

Cell = tuple[Scenario, PolicyRun, list[Arrival], Any, Any, float, float]


def replay_sim(
    scenario: Scenario,
    runs: list[PolicyRun],
    *,
    duration_s: float | None = None,
    profile_path: Path | None = None,
    host: dict[str, Any] | None = None,
    jobs: int = 1,
    ray: str | None = None,
    data_plane: bool = False,
) -> dict[str, Any]:
    """Run each policy in the simulator on the same schedule the live replay would send; with `host`
    (a host measurement, scenarios.calibrate.host), on the profile calibrated to it. The runs on
    `jobs` processes (1: here, one after another; 0: one per core) or on Ray (`ray`)."""
    from scenarios.calibrate.cascade import cascade_profiles
    from scenarios.calibrate.profile import load_profile
    from scenarios.sim import Profile

    if data_plane:  # the router's native data plane, modelled (scenarios.sim.dataplane)
        router = {**scenario.router, "data_plane": {**scenario.router.get("data_plane", {}), "enabled": True}}
        scenario = scenario.model_copy(update={"router": router})
    duration, warmup, schedule = plan(scenario, duration_s)
    doc = load_profile(profile_path)
    nodes = len(scenario.topology.nodes)
    if host is not None:
        from scenarios.calibrate.host import host_profile

        doc = host_profile(doc, host["level"], nodes)
    profile = Profile.from_json(doc, offered_rate(scenario), nodes)
    report = header(scenario, "sim", duration, warmup)
    report["profile"] = "host-calibrated" if host is not None else str(profile_path or "default")
    profiles = cascade_profiles(scenario)
    cells: list[Cell] = [(scenario, run, schedule, profile, profiles, duration, warmup) for run in runs]
    messages = 0
    telemetry: dict[str, Any] = {}
    for run, (summary, sent, lag) in zip(runs, run_cells(simulate_run, cells, jobs, ray, label="replay"), strict=True):
        report["policies"][run.name] = summary
        messages += sent
        telemetry = lag  # lag of the last run; messages of all of them
    report["telemetry"] = {**telemetry, "messages": messages}
    return report


def simulate_run(cell: Cell) -> tuple[dict[str, Any], int, dict[str, Any]]:
    """One policy run simulated and summarised: (its summary, telemetry messages, the telemetry's lag)."""
    from scenarios.sim import Simulation

    scenario, run, schedule, profile, profiles, duration, warmup = cell
    sim = Simulation(scenario, run, schedule, profile, cascade_profiles=profiles)
    started = time.perf_counter()
    results = sim.run()
    wall = time.perf_counter() - started
    measured = [r for r in results if r.arrival.at_s >= warmup]
    summary = summarize(measured, duration, node_costs(scenario, run), tenant_weights(scenario.router))
    if sim.policy.state():
        summary["policy_state"] = relative(sim.policy.state(), 0.0)
    summary["warmup_requests"] = len(results) - len(measured)
    summary["wall_s"] = round(wall, 3)
    summary["events"] = sim.events
    summary["residency"].update(
        node_warm_rates(*(sum(getattr(n, k) for n in sim.nodes.values()) for k in NODE_RESIDENCY_COUNTERS))
    )
    summary["faults"] = sim.fault_log
    if sim.canary is not None:
        summary["canary"] = sim.canary.report()
    elif run_router(scenario, run).get("model_canaries"):  # (said, not left out silently)
        summary["canary"] = {"decisions": [], "note": "model canaries run live only"}
    served = sum(n.served for n in sim.nodes.values())
    ok = sum(r.stages for r in results if r.status == 200)
    summary["executions"] = {"executions": served, "wasted_executions": max(0, served - ok)}
    if "reroute" in run_router(scenario, run):
        summary["reroute"] = moves_during({}, sim.lc.reroute.as_json())
    summary["overload"] = sim.lc.overload_summary((0, int(duration + warmup) + 1))  # as the live run's
    summary.update(series(results, warmup, duration + warmup))
    if sim.copy_samples is not None:  # (a model catalogue: residency per model, and copies over time)
        add_residency(summary, (n.per_model.as_json() for n in sim.nodes.values()), sim.copy_samples)
    if cuts := partitions(results, scenario):
        summary["partitions"] = cuts
    marks = triggers(scenario)
    if marks:  # and what the same arrivals get without each trigger (a simulated run each)
        base = {
            name: Simulation(without, run, arrivals, profile).run()
            for name, (without, arrivals) in untriggered(scenario, schedule).items()
        }
        summary["recovery"] = recovery(results, marks, duration + warmup, base)
    if sim.proxy is not None:  # the native data plane, modelled: what it carried, what went to the router
        carried = sum(p.carried for p in sim.proxies.values())  # (every site's proxy, with routers per site)
        passed = len(results) - carried
        summary["data_plane"] = {
            "native": carried,
            "router": passed,
            "native_share": round(carried / max(1, len(results)), 4),
        }
        why = sim.proxy.whole_router or (sim.proxy.plan.reason if sim.proxy.plan.balance is None else None)
        if why:
            summary["data_plane"]["why"] = why
    if sim.replicas:  # several routers (topology.routers): each one's load messages and lag
        summary["routers"] = sim.replicas_report()
    scaled = sim.autoscale_report((duration + warmup) * 1000.0)
    if scaled is not None:
        summary["autoscale"] = scaled | _first_rise(scaled, summary["timeline"], sim.cfg.lifecycle.scaling)
    return summary, sim.store.messages, sim.store.summary()


def _first_rise(scaled: dict[str, Any], timeline: dict[str, Any], cfg: Any) -> dict[str, Any]:
    """When the signal first asked for more nodes than a pool had, and when the run's in-time share
    first fell below the signal's target (its per-second timeline): the signal should come first."""
    rises = [t for pool in scaled["pools"] for t, needed, up in pool["ticks"] if needed > up]
    target = cfg.target if cfg is not None else 0.99
    bucket, warmup = timeline["bucket_s"], timeline["warmup_s"]
    slos = timeline["slo_attainment"]
    misses = [i * bucket for i, slo in enumerate(slos) if slo is not None and slo < target and i * bucket >= warmup]
    return {"first_rise_s": min(rises) if rises else None, "first_slo_miss_s": misses[0] if misses else None}
