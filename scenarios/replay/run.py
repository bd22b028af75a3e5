"""`edgeroute replay`: replay a scenario once per policy against the live local stack.

One stack (broker, nodes, router) serves every policy in turn; between runs the router's policy is
swapped through `PUT /admin/policy` (the same validated, atomic path operators use) and the cluster is
let drain. Every policy sees the identical arrival schedule (same seed).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from scenarios.replay.canary import canary_steps, start_canaries
from scenarios.replay.capture import attach_recorded, recorded_host
from scenarios.replay.partitions import partitions
from scenarios.replay.report import (
    format_comparison,
    format_table,
    node_warm_rates,
    recovery,
    series,
    summarize,
    write_report,
)
from scenarios.replay.tenants import compare_tenants, tenant_header, tenant_weights
from scenarios.replay.trust import HostWatch, verdict
from scenarios.spec.schema import MAX_DURATION_S, PolicyRun, Scenario
from scenarios.spec.workload import mean_rate_rps
from scenarios.stack.faults import FaultInjector
from scenarios.stack.launcher import Stack
from scenarios.stack.loadgen import UNKNOWN_MODEL_PAYLOAD, Arrival, build_schedule, fetch_payloads, run_load
from scenarios.stack.procs import http_json
from scenarios.stack.sites import SiteStack, stack_for
from telemetry.process.cli import missing_extra

log = logging.getLogger("edgeroute.replay")


def _progress(label: str) -> Any:
    last = [0.0]

    def show(done: int, total: int) -> None:
        now = time.monotonic()
        if not sys.stderr.isatty() or (now - last[0] < 0.2 and done != total):
            return
        last[0] = now
        width = 30
        filled = int(width * done / max(1, total))
        sys.stderr.write(f"\r  {label:<20} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
        if done == total:
            sys.stderr.write("\n")
        sys.stderr.flush()

    return show


def _plan(scenario: Scenario, duration_s: float | None) -> tuple[float, float, list[Arrival]]:
    """(measured duration, warm-up, the arrival schedule): the same for live and simulated replays."""
    duration = duration_s if duration_s is not None else scenario.workload.duration_s
    if not 0 < duration <= MAX_DURATION_S:  # as the scenario's own duration_s (reports keep series over it)
        raise ValueError(f"a replay lasts above 0 and at most {MAX_DURATION_S:g} seconds, not {duration!r}")
    warmup = min(scenario.workload.warmup_s, duration / 4)
    return duration, warmup, build_schedule(scenario.workload, scenario.seed, duration + warmup, scenario.base_dir)


def _header(scenario: Scenario, mode: str, duration: float, warmup: float) -> dict[str, Any]:
    return {
        "scenario": scenario.name,
        "mode": mode,
        "seed": scenario.seed,
        "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "duration_s": duration,
        "warmup_s": warmup,
        "policies": {},
    }


NODE_RESIDENCY_COUNTERS = ("model_requests", "cold_requests", "loads", "evictions")  # /admin/stats, SimNode


def _wait_idle(router_url: str, headers: dict[str, str], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status, view = http_json(f"{router_url}/admin/view", headers=headers)
        if status == 200 and all(n["outstanding"] == 0 for n in view["nodes"]):
            return
        time.sleep(0.2)


def replay_live(
    scenario: Scenario,
    runs: list[PolicyRun],
    *,
    kafka: str | None = None,
    duration_s: float | None = None,
    log_dir: Path | None = None,
    echo: bool = True,
    calibrate: bool = False,
) -> dict[str, Any]:
    """Run each policy on the live stack; returns the report (not yet written). With `calibrate`, the
    host is measured on the stack first (scenarios.calibrate.host) and the report carries it under "host"."""
    duration, warmup, schedule = _plan(scenario, duration_s)
    models = {a.model for a in schedule} or {m for s in scenario.workload.sites for m in s.models}
    report = _header(scenario, "live", duration, warmup)
    rerouting = any("reroute" in run_router(scenario, run) for run in runs)
    stack = stack_for(scenario, kafka=kafka)
    if log_dir is not None:
        stack.log_dir = log_dir
    with stack:
        if echo:
            print(f"router: {stack.router_url}\nkafka: {stack.bootstrap}", flush=True)
        if isinstance(stack, SiteStack):  # how the sites were kept apart: namespaces, or why not
            report["isolation"] = stack.isolation
        cascades = frozenset(c.name for c in scenario.cascade_specs())
        payloads = asyncio.run(
            fetch_payloads(
                stack.router_url, models, scenario.seed, stack.client_headers, UNKNOWN_MODEL_PAYLOAD, cascades
            )
        )
        if calibrate and runs:
            report["host"] = _calibrate(stack, scenario, runs[0], payloads)
        for run in runs:
            # with a model catalogue what is resident matters: every run starts from the start-up set
            stack.use_nodes(run.node_specs(scenario.topology.nodes), fresh=bool(scenario.models))
            stack.set_policy(run.policy.model_dump(exclude_none=True))
            canaries = start_canaries(stack, run_router(scenario, run))  # (policy and model canaries)
            if rerouting:
                stack.set_reroute(run_router(scenario, run).get("reroute") or {})
            if any("tenants" in r.router for r in runs):  # (the scenario has its own: the schema checks)
                stack.set_tenants(run_router(scenario, run)["tenants"])
            if cascades:  # the cascade, or one of its halves
                stack.set_cascade_mode(run.router.get("cascade_mode", "cascade"))
            _wait_idle(stack.router_url, stack.admin_headers)
            moves_before = stack.reroute_stats() if rerouting else {}
            overload_before = _router_overload(stack)
            for p in stack.nodes.values():  # executions are counted from here (duplicates checked)
                http_json(f"{p.url}/admin/stats?reset=1", headers=stack.node_headers)
            injector = FaultInjector(stack, list(scenario.faults))
            started = time.monotonic()
            t0_ms = time.time() * 1000.0  # the router's clock
            injector.start()
            lags: list[float] = []
            watch = HostWatch(stack.pids)
            watch.start()
            urls = stack.router_urls or stack.router_url
            hdrs = stack.client_headers
            results = asyncio.run(
                run_load(urls, schedule, payloads, 5.0, _progress(run.name), hdrs, lags, tenant_header(scenario.router))
            )
            trust = verdict(lags, watch.stop())  # (figures from a starved host say so)
            wall = time.monotonic() - started
            injector.stop()
            if scenario.faults:
                stack.restore()
                stack.wait_ready(60)
            measured = [r for r in results if r.arrival.at_s >= warmup]
            summary = summarize(measured, duration, _node_costs(scenario, run), tenant_weights(scenario.router))
            summary["warmup_requests"] = len(results) - len(measured)
            summary["wall_s"] = round(wall, 2)
            summary["trust"] = trust
            summary["faults"] = injector.events
            summary["node_stats"] = {
                n: http_json(f"{p.url}/admin/stats?executed=1", headers=stack.node_headers)[1]
                for n, p in sorted(stack.nodes.items())
            }
            executed = [i for st in summary["node_stats"].values() for i in st.pop("executed_ids", [])]
            summary["executions"] = execution_check(executed, sum(r.stages for r in results if r.status == 200))
            if rerouting:
                summary["reroute"] = _moves_during(moves_before, stack.reroute_stats())
            stats = summary["node_stats"].values()
            summary["residency"].update(
                node_warm_rates(*(sum(int(st.get(k, 0)) for st in stats) for k in NODE_RESIDENCY_COUNTERS))
            )
            status, pol = http_json(f"{stack.router_url}/admin/policy", headers=stack.admin_headers)
            if status == 200 and pol.get("state"):
                summary["policy_state"] = _relative(pol["state"], t0_ms)
            # the answer margin and retry budget as the run left them, and the budget's worst window in it
            since = f"?since_s={int(t0_ms / 1000.0)}"
            status, view = http_json(f"{stack.router_url}/admin/view{since}", headers=stack.admin_headers)
            if status == 200 and "overload" in view:
                summary["overload"] = _overload_during(overload_before, view["overload"])
            if canaries is not None:
                summary["canary"] = canary_steps(stack, t0_ms, canaries)
            if injector.errors:
                summary["fault_errors"] = injector.errors
            summary.update(series(results, warmup, duration + warmup))
            marks = triggers(scenario)
            if marks:
                summary["recovery"] = recovery(results, marks, duration + warmup)
            if cuts := partitions(results, scenario):
                summary["partitions"] = cuts
            report["policies"][run.name] = summary
        status, view = http_json(f"{stack.router_url}/admin/view", headers=stack.admin_headers)
        report["telemetry"] = view["telemetry"] if status == 200 else {}
    return report


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


def execution_check(executed_ids: list[str], answered_ok: int) -> dict[str, int]:
    """From the nodes' ids of what they executed: how many executions, how many requests ran more than
    once (an attempt id is the router's request id, '-', the attempt), and the executions whose answer
    no client got (`answered_ok`: executions behind the 200 answers; the rest are a hedge's loser, or
    one that finished after the router gave up)."""
    runs = Counter(i.rsplit("-", 1)[0] for i in executed_ids)
    return {
        "executions": len(executed_ids),
        "duplicate_executions": sum(n - 1 for n in runs.values() if n > 1),
        "wasted_executions": max(0, len(executed_ids) - answered_ok),
    }


def _router_overload(stack: Stack) -> dict[str, Any]:
    """The router's overload block (`/admin/view`) as it stands, {} if it does not answer."""
    status, view = http_json(f"{stack.router_url}/admin/view", headers=stack.admin_headers)
    return view.get("overload", {}) if status == 200 else {}


def _overload_during(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The router's overload block for one run: its running totals (retries, and the retry budget's
    refusals) less what they stood at before the run, as the simulator's fresh run counts them; the
    budget's window and the answer margin as the run left them."""
    out = dict(after)
    out["retries"] = after.get("retries", 0) - before.get("retries", 0)
    budget = after.get("retry_budget")
    if isinstance(budget, dict) and "refused" in budget:
        out["retry_budget"] = {
            **budget,
            "refused": budget["refused"] - before.get("retry_budget", {}).get("refused", 0),
        }
    return out


def _moves_during(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"enabled": after.get("enabled", False)}
    for key in ("moves", "displaced", "misses", "moved_wait_ms"):
        out[key] = round(after.get(key, 0) - before.get(key, 0), 1)
    return out


def _calibrate(stack: Stack, scenario: Scenario, first: PolicyRun, payloads: dict[str, Any]) -> dict[str, Any] | None:
    """Measure the host on the scenario's stack, as the first run will find it (printed with the report)."""
    from scenarios.calibrate.host import compare_with_profile, measure_host
    from scenarios.calibrate.profile import load_profile

    specs = first.node_specs(scenario.topology.nodes)
    stack.use_nodes(specs, fresh=bool(scenario.models))
    stack.set_policy(first.policy.model_dump(exclude_none=True))
    if scenario.cascade_specs():  # a cascade measured as its first model alone: one stage per request
        stack.set_cascade_mode("first_only")
    _wait_idle(stack.router_url, stack.admin_headers)
    level = measure_host(stack, scenario, specs, offered_rate(scenario), payloads)
    if level is None:
        return None
    return {"level": level, "vs_profile": compare_with_profile(load_profile(), level)}


def _node_costs(scenario: Scenario, run: PolicyRun) -> dict[str, tuple[str, float]]:
    return {n.id: (n.partition, n.cost_per_s) for n in run.node_specs(scenario.topology.nodes)}


def _relative(state: dict[str, Any], t0_ms: float) -> dict[str, Any]:
    """Plugin state with its timer history in seconds from the start of the run (for the plots)."""
    out: dict[str, Any] = {}
    for plugin, st in state.items():
        st = dict(st)
        if "history" in st:
            st["history"] = [[round((t - t0_ms) / 1000.0, 3), site, d] for t, site, d in st["history"]]
        out[plugin] = st
    return out


def compare(live: dict[str, Any], sim: dict[str, Any]) -> dict[str, Any]:
    """Per policy: live and sim p50, p99 (relative error of sim) and SLO attainment (points apart)."""
    out: dict[str, Any] = {}
    for name, lp in live["policies"].items():
        sp = sim["policies"].get(name)
        if sp is None:
            continue
        row: dict[str, Any] = {}
        for key in ("p50", "p95", "p99"):
            lv, sv = lp["latency_ms"][key], sp["latency_ms"][key]
            row[key] = {"live": lv, "sim": sv, "rel_err": round((sv - lv) / lv, 4) if lv else None}
        for key in ("exec_mean", "queue_mean", "overhead_p50"):
            lv, sv = lp.get("node_ms", {}).get(key), sp.get("node_ms", {}).get(key)
            if lv is not None and sv is not None:
                row[key] = {"live": lv, "sim": sv, "rel_err": round((sv - lv) / lv, 4) if lv else None}
        ls, ss = lp["slo_attainment"], sp["slo_attainment"]
        row["slo_attainment"] = {"live": ls, "sim": ss, "points": round((ss - ls) * 100, 2)}
        by_tenant = compare_tenants(lp, sp)
        if by_tenant:
            row["by_tenant"] = by_tenant
        out[name] = row
    return out


def replay_remote(
    scenario: Scenario, router_url: str, token: str | None = None, duration_s: float | None = None
) -> dict[str, Any]:
    """The scenario's open-loop workload against a router that is already running (a deployment):
    no stack is started, no fault injected, no policy set. One run, named after the router's policy
    when the token may read `/admin/policy`, else "router"."""
    if scenario.faults:
        log.warning("%s: faults are injected only on a local stack; replaying its workload alone", scenario.name)
    router_url = router_url.rstrip("/")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    duration, warmup, schedule = _plan(scenario, duration_s)
    models = {a.model for a in schedule} or {m for s in scenario.workload.sites for m in s.models}
    report = _header(scenario, "live", duration, warmup)
    report["router"] = router_url
    payloads = asyncio.run(fetch_payloads(router_url, models, scenario.seed, headers))
    status, pol = http_json(f"{router_url}/admin/policy", headers=headers)
    name = str(pol.get("name") or "router") if status == 200 and isinstance(pol, dict) else "router"
    started = time.monotonic()
    results = asyncio.run(run_load(router_url, schedule, payloads, progress=_progress(name), headers=headers))
    measured = [r for r in results if r.arrival.at_s >= warmup]
    summary = summarize(measured, duration)
    summary["warmup_requests"] = len(results) - len(measured)
    summary["wall_s"] = round(time.monotonic() - started, 2)
    summary.update(series(results, warmup, duration + warmup))
    report["policies"][name] = summary
    status, view = http_json(f"{router_url}/admin/view", headers=headers)
    report["telemetry"] = view.get("telemetry", {}) if status == 200 and isinstance(view, dict) else {}
    return report


def run_replay(
    scenario: Scenario,
    runs: list[PolicyRun],
    out_dir: Path,
    mode: str = "live",
    profile_path: Path | None = None,
    calibrate: bool | None = None,
    **kwargs: Any,
) -> Path:
    """Replay live, simulated, or both (then the live report carries the sim one and the comparison).

    `calibrate` (None: only with `both`) measures the host before the live runs; the simulation of
    `both` then runs on the profile calibrated to it (scenarios.calibrate.host)."""
    if calibrate is None:
        calibrate = mode == "both"
    router_url, token = kwargs.pop("router_url", None), kwargs.pop("token", None)
    if router_url is not None:
        report = replay_remote(scenario, router_url, token, kwargs.get("duration_s"))
    elif mode == "sim":  # (a capture's replay runs on the host it recorded)
        host = recorded_host(scenario)
        report = replay_sim(scenario, runs, duration_s=kwargs.get("duration_s"), profile_path=profile_path, host=host)
    else:
        report = replay_live(scenario, runs, calibrate=calibrate, **kwargs)
        if mode == "both":
            host = report.get("host")
            sim = replay_sim(scenario, runs, duration_s=kwargs.get("duration_s"), profile_path=profile_path, host=host)
            report["sim"] = sim
            report["comparison"] = compare(report, sim)
    if scenario.recorded is not None:  # a capture's replay: what was recorded, beside every run
        attach_recorded(scenario, report)
    path = write_report(report, out_dir)
    try:
        from scenarios.replay.render import render

        markdown: Path | str = render(report, out_dir)
    except ModuleNotFoundError as exc:  # the report stands without its plots and summary page
        if (hint := missing_extra(exc)) is None:
            raise
        markdown = f"none (report.md and its plots {hint})"
    if report.get("host"):
        from scenarios.calibrate.host import format_host

        print(format_host(report["host"]["vs_profile"]))
    print(format_table(report))
    if "sim" in report:
        print(format_table(report["sim"]))
        print(format_comparison(report["comparison"]))
    print(f"report: {path}\nsummary: {markdown}")
    return path


def offered_rate(scenario: Scenario) -> float:
    """Mean offered request rate of the workload over the run (requests per second; a site counts for
    the share of the run it is active)."""
    return sum(mean_rate_rps(site, scenario.workload.duration_s) for site in scenario.workload.sites)


def replay_sim(
    scenario: Scenario,
    runs: list[PolicyRun],
    *,
    duration_s: float | None = None,
    profile_path: Path | None = None,
    host: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run each policy in the simulator on the same schedule the live replay would send; with `host`
    (a host measurement, scenarios.calibrate.host), on the profile calibrated to it."""
    from scenarios.calibrate.profile import load_profile
    from scenarios.sim import Profile, Simulation

    duration, warmup, schedule = _plan(scenario, duration_s)
    doc = load_profile(profile_path)
    nodes = len(scenario.topology.nodes)
    if host is not None:
        from scenarios.calibrate.host import host_profile

        doc = host_profile(doc, host["level"], nodes)
    profile = Profile.from_json(doc, offered_rate(scenario), nodes)
    report = _header(scenario, "sim", duration, warmup)
    report["profile"] = "host-calibrated" if host is not None else str(profile_path or "default")
    messages = 0
    telemetry: dict[str, Any] = {}
    from scenarios.calibrate.cascade import cascade_profiles

    profiles = cascade_profiles(scenario)
    for run in runs:
        sim = Simulation(scenario, run, schedule, profile, cascade_profiles=profiles)
        started = time.perf_counter()
        results = sim.run()
        wall = time.perf_counter() - started
        measured = [r for r in results if r.arrival.at_s >= warmup]
        summary = summarize(measured, duration, _node_costs(scenario, run), tenant_weights(scenario.router))
        if sim.policy.state():
            summary["policy_state"] = _relative(sim.policy.state(), 0.0)
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
            summary["reroute"] = _moves_during({}, sim.lc.reroute.as_json())
        summary["overload"] = sim.lc.overload_summary((0, int(duration + warmup) + 1))  # as the live run's
        summary.update(series(results, warmup, duration + warmup))
        if cuts := partitions(results, scenario):
            summary["partitions"] = cuts
        marks = triggers(scenario)
        if marks:  # and what the same arrivals get without each trigger (a simulated run each)
            base = {
                name: Simulation(without, run, arrivals, profile).run()
                for name, (without, arrivals) in untriggered(scenario, schedule).items()
            }
            summary["recovery"] = recovery(results, marks, duration + warmup, base)
        report["policies"][run.name] = summary
        messages += sim.store.messages
        telemetry = sim.store.summary()  # lag of the last run; messages of all of them
    report["telemetry"] = {**telemetry, "messages": messages}
    return report
