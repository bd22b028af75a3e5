"""What live and simulated replays share: the run's plan (measured duration, warm-up, the arrival
schedule), the report's header, the router settings a run replays with, what a run recovers from
(its triggers) and the same run without each, the offered rate, and small helpers of the summaries."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from nodes.residency import MODEL_COUNTS
from scenarios.spec.schema import MAX_DURATION_S, PolicyRun, Scenario
from scenarios.spec.workload import Arrival, build_schedule, mean_rate_rps


def plan(scenario: Scenario, duration_s: float | None) -> tuple[float, float, list[Arrival]]:
    """(measured duration, warm-up, the arrival schedule): the same for live and simulated replays."""
    duration = duration_s if duration_s is not None else scenario.workload.duration_s
    if not 0 < duration <= MAX_DURATION_S:  # as the scenario's own duration_s (reports keep series over it)
        raise ValueError(f"a replay lasts above 0 and at most {MAX_DURATION_S:g} seconds, not {duration!r}")
    warmup = min(scenario.workload.warmup_s, duration / 4)
    return duration, warmup, build_schedule(scenario.workload, scenario.seed, duration + warmup, scenario.base_dir)


def header(scenario: Scenario, mode: str, duration: float, warmup: float) -> dict[str, Any]:
    return {
        "scenario": scenario.name,
        "mode": mode,
        "seed": scenario.seed,
        "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "duration_s": duration,
        "warmup_s": warmup,
        "policies": {},
    }


NODE_RESIDENCY_COUNTERS = MODEL_COUNTS  # /admin/stats, SimNode (and per model, their `by_model`)


def triggers(scenario: Scenario) -> list[tuple[str, float, float]]:
    """What a run recovers from (scenarios.replay.report.recovery): each fault that lasts a while and each
    traffic class confined to a window of the run, as (name, start s, end s)."""
    return sorted(((name, start, end) for name, start, end, _ in _triggers(scenario)), key=lambda t: t[1])


def _triggers(scenario: Scenario) -> list[tuple[str, float, float, tuple[str, int]]]:
    """Each trigger with where it comes from: ("fault", index in faults) or ("site", index in sites)."""
    out = [
        (f"{f.kind} {f.node or '-'.join(f.link or [])}".strip(), f.at_s, f.at_s + f.duration_s, ("fault", i))
        for i, f in enumerate(scenario.faults)
        if f.duration_s is not None
    ]
    for i, site in enumerate(scenario.workload.sites):
        if site.stop_s is not None:
            out.append((f"traffic {site.name or site.site}", site.start_s, site.stop_s, ("site", i)))
    return out


def untriggered(scenario: Scenario, schedule: list[Arrival]) -> dict[str, tuple[Scenario, list[Arrival]]]:
    """For each trigger (`triggers`, by name): the scenario and schedule without it (the fault left out,
    or the traffic class's arrivals taken out of the schedule), everything else the same."""
    out: dict[str, tuple[Scenario, list[Arrival]]] = {}
    for name, _, _, (kind, i) in _triggers(scenario):
        if kind == "fault":
            rest = [f for j, f in enumerate(scenario.faults) if j != i]
            out[name] = (scenario.model_copy(update={"faults": rest}), schedule)
        else:
            out[name] = (scenario, [a for a in schedule if a.source != i])
    return out


def run_router(scenario: Scenario, run: PolicyRun) -> dict[str, Any]:
    """The router settings a run replays with: the scenario's `router:` section, the run's over it."""
    return {**scenario.router, **run.router}


def moves_during(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"enabled": after.get("enabled", False)}
    for key in ("moves", "displaced", "misses", "moved_wait_ms"):
        out[key] = round(after.get(key, 0) - before.get(key, 0), 1)
    return out


def node_costs(scenario: Scenario, run: PolicyRun) -> dict[str, tuple[str, float]]:
    return {n.id: (n.partition, n.cost_per_s) for n in run.node_specs(scenario.topology.nodes)}


def relative(state: dict[str, Any], t0_ms: float) -> dict[str, Any]:
    """Plugin state with its timer history in seconds from the start of the run (for the plots)."""
    out: dict[str, Any] = {}
    for plugin, st in state.items():
        st = dict(st)
        if "history" in st:
            st["history"] = [[round((t - t0_ms) / 1000.0, 3), site, d] for t, site, d in st["history"]]
        out[plugin] = st
    return out


def offered_rate(scenario: Scenario) -> float:
    """Mean offered request rate of the workload over the run (requests per second; a site counts for
    the share of the run it is active)."""
    return sum(mean_rate_rps(site, scenario.workload.duration_s) for site in scenario.workload.sites)
