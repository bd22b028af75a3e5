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
from pathlib import Path
from typing import Any

from scenarios.replay.canary import canary_steps, start_canaries
from scenarios.replay.capture import attach_recorded, recorded_host
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
)
from scenarios.replay.copies import CopyWatch, add_residency
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
from scenarios.replay.simulated import replay_sim
from scenarios.replay.tenants import compare_tenants, tenant_header, tenant_weights
from scenarios.replay.trust import HostWatch, verdict
from scenarios.spec.schema import PolicyRun, Scenario
from scenarios.stack.faults import FaultInjector
from scenarios.stack.launcher import Stack
from scenarios.stack.loadgen import UNKNOWN_MODEL_PAYLOAD, fetch_payloads, run_load
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


def _wait_idle(router_url: str, headers: dict[str, str], timeout_s: float = 10.0) -> None:
    """Until no node has a request of the router's in flight and a native data plane has settled on
    the policy (no reload for half a second: a run's first requests go to the proxy's new worker)."""
    deadline = time.monotonic() + timeout_s
    reloads: Any = None
    while time.monotonic() < deadline:
        status, view = http_json(f"{router_url}/admin/view", headers=headers)
        dp = view.get("data_plane") if status == 200 else None
        now = None if not dp else dp.get("reloads")
        if status == 200 and all(n["outstanding"] == 0 for n in view["nodes"]) and now == reloads:
            return
        reloads = now
        time.sleep(0.5 if dp else 0.2)


def replay_live(
    scenario: Scenario,
    runs: list[PolicyRun],
    *,
    kafka: str | None = None,
    duration_s: float | None = None,
    log_dir: Path | None = None,
    echo: bool = True,
    calibrate: bool = False,
    data_plane: bool = False,
) -> dict[str, Any]:
    """Run each policy on the live stack; returns the report (not yet written). With `calibrate`, the
    host is measured on the stack first (scenarios.calibrate.host) and the report carries it under "host".
    With `data_plane`, the load goes through the router's native data plane (router.dataplane); each
    run's summary says how much of it the proxy carried natively."""
    duration, warmup, schedule = plan(scenario, duration_s)
    models = {a.model for a in schedule} or {m for s in scenario.workload.sites for m in s.models}
    report = header(scenario, "live", duration, warmup)
    rerouting = any("reroute" in run_router(scenario, run) for run in runs)
    stack = stack_for(scenario, kafka=kafka, data_plane=data_plane)
    if log_dir is not None:
        stack.log_dir = log_dir
    with stack:
        if echo:
            print(f"router: {stack.router_url}\nkafka: {stack.bootstrap}", flush=True)
        if isinstance(stack, SiteStack):  # how the sites were kept apart: namespaces, or why not
            report["isolation"] = stack.isolation
        if data_plane:
            report["data_plane"] = data_plane_note(stack)
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
            if any("copies" in r.router for r in runs):  # (a run turns copy scaling on or off)
                stack.set_copies(run_router(scenario, run).get("copies") or {})
            if any("tenants" in r.router for r in runs):  # (the scenario has its own: the schema checks)
                stack.set_tenants(run_router(scenario, run)["tenants"])
            if cascades:  # the cascade, or one of its halves
                stack.set_cascade_mode(run.router.get("cascade_mode", "cascade"))
            _wait_idle(stack.router_url, stack.admin_headers)
            moves_before = stack.reroute_stats() if rerouting else {}
            overload_before = _router_overload(stack)
            carried_before = _carried(stack)
            for p in stack.nodes.values():  # executions are counted from here (duplicates checked)
                http_json(f"{p.url}/admin/stats?reset=1", headers=stack.node_headers)
            injector = FaultInjector(stack, list(scenario.faults))
            started = time.monotonic()
            t0_ms = time.time() * 1000.0  # the router's clock
            injector.start()
            lags: list[float] = []
            watch = HostWatch(stack.pids)
            watch.start()
            held = _copy_watch(stack, scenario)
            urls = stack.router_urls or stack.router_url
            hdrs = stack.client_headers
            try:
                results = asyncio.run(
                    run_load(
                        urls, schedule, payloads, 5.0, _progress(run.name), hdrs, lags, tenant_header(scenario.router)
                    )
                )
            finally:
                samples = held.stop() if held is not None else []
            trust = verdict(lags, watch.stop())  # (figures from a starved host say so)
            wall = time.monotonic() - started
            injector.stop()
            if scenario.faults:
                stack.restore()
                stack.wait_ready(60)
            measured = [r for r in results if r.arrival.at_s >= warmup]
            summary = summarize(measured, duration, node_costs(scenario, run), tenant_weights(scenario.router))
            summary["warmup_requests"] = len(results) - len(measured)
            if scenario.autoscale is not None and run.autoscale:  # (said, not left out silently)
                summary["autoscale"] = {"note": "the autoscaler runs in the simulator; live, every node ran"}
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
                summary["reroute"] = moves_during(moves_before, stack.reroute_stats())
            stats = summary["node_stats"].values()
            summary["residency"].update(
                node_warm_rates(*(sum(int(st.get(k, 0)) for st in stats) for k in NODE_RESIDENCY_COUNTERS))
            )
            status, pol = http_json(f"{stack.router_url}/admin/policy", headers=stack.admin_headers)
            if status == 200 and pol.get("state"):
                summary["policy_state"] = relative(pol["state"], t0_ms)
            # the answer margin and retry budget as the run left them, and the budget's worst window in it
            since = f"?since_s={int(t0_ms / 1000.0)}"
            status, view = http_json(f"{stack.router_url}/admin/view{since}", headers=stack.admin_headers)
            if status == 200 and "overload" in view:
                summary["overload"] = _overload_during(overload_before, view["overload"])
            if canaries is not None:
                summary["canary"] = canary_steps(stack, t0_ms, canaries)
            if carried_before is not None:
                time.sleep(0.25)  # (the proxy's counts are read every check_ms)
                state = view.get("data_plane") if status == 200 and isinstance(view, dict) else None
                summary["data_plane"] = carried_during(carried_before, _carried(stack), state)
            if injector.errors:
                summary["fault_errors"] = injector.errors
            summary.update(series(results, warmup, duration + warmup))
            if held is not None:  # (a model catalogue: residency per model, and copies over time)
                add_residency(summary, (st.get("by_model") for st in stats), samples)
            marks = triggers(scenario)
            if marks:
                summary["recovery"] = recovery(results, marks, duration + warmup)
            if cuts := partitions(results, scenario):
                summary["partitions"] = cuts
            report["policies"][run.name] = summary
        status, view = http_json(f"{stack.router_url}/admin/view", headers=stack.admin_headers)
        report["telemetry"] = view["telemetry"] if status == 200 else {}
    return report


def _copy_watch(stack: Stack, scenario: Scenario) -> CopyWatch | None:
    """With a model catalogue, the nodes' resident models read through the run (started)."""
    if not scenario.models:
        return None
    watch = CopyWatch(lambda: [p.url for p in list(stack.nodes.values())], scenario.models, stack.node_headers)
    watch.start()
    return watch


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


def data_plane_note(stack: Stack) -> dict[str, Any]:
    """What the report says of the native data plane before the runs: on, or why not."""
    if _carried(stack) is None:
        return {"on": False, "why": f"the router runs without it: {_off_line(stack) or 'router.log says why'}"}
    return {"on": True}


def _off_line(stack: Stack) -> str | None:
    """A router's own line saying why its data plane is off (router.app; with routers per site, the
    first site's that says so), None if none wrote one."""
    for log_path in sorted(stack.log_dir.glob("router*.log")):
        try:
            text = log_path.read_text(errors="replace")[-20_000:]
        except OSError:
            continue
        lines = [ln for ln in text.splitlines() if "data plane off:" in ln]
        if lines:
            return lines[-1].split("data plane off:", 1)[1].strip()[:500]
    return None


def _carried(stack: Stack) -> dict[str, int] | None:
    """The proxies' request counts so far (router.dataplane.control; every site's, summed, with routers
    per site), None where a router runs without its data plane."""
    routers = list(stack.site_routers.values()) if isinstance(stack, SiteStack) else [stack.router]
    total: dict[str, int] = {}
    for router in routers:
        if router is None or not router.dataplane:
            return None
        status, view = http_json(f"{router.url}/admin/view", headers=stack.admin_headers)
        dp = view.get("data_plane") if status == 200 else None
        if not dp:
            return None
        for key, n in dp["requests"].items():
            total[key] = total.get(key, 0) + int(n)
    return total


def carried_during(before: dict[str, int], after: dict[str, int] | None, state: Any) -> dict[str, Any]:
    """A run's requests the proxy carried natively and passed to the router, and why it passed them."""
    after = after or before
    native, passed = after["native"] - before["native"], after["router"] - before["router"]
    out: dict[str, Any] = {
        "native": native,
        "router": passed,
        "native_share": round(native / max(1, native + passed), 4),
    }
    if isinstance(state, dict) and not state.get("native", True):
        out["why"] = state.get("reason", "")
    return out


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
        starts: dict[str, dict[str, dict[str, Any]]] = {}
        for wf, stages in lp.get("stage_starts", {}).items():
            for stage, v in stages.items():
                simmed = sp.get("stage_starts", {}).get(wf, {}).get(stage)
                if simmed is not None:
                    lv, sv = v["p50"], simmed["p50"]
                    starts.setdefault(wf, {})[stage] = {
                        "live": lv,
                        "sim": sv,
                        "rel_err": round((sv - lv) / lv, 4) if lv else None,
                    }
        if starts:  # (a workflow's stages: when each was routed, p50)
            row["stage_starts"] = starts
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
    duration, warmup, schedule = plan(scenario, duration_s)
    models = {a.model for a in schedule} or {m for s in scenario.workload.sites for m in s.models}
    report = header(scenario, "live", duration, warmup)
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
    # the simulated runs side by side, on local processes or Ray (scenarios.sim.cells)
    cells = {"jobs": kwargs.pop("jobs", 1), "ray": kwargs.pop("ray", None)}
    if router_url is not None:
        report = replay_remote(scenario, router_url, token, kwargs.get("duration_s"))
    elif mode == "sim":  # (a capture's replay runs on the host it recorded)
        host = recorded_host(scenario)
        duration, native = kwargs.get("duration_s"), kwargs.get("data_plane", False)
        report = replay_sim(
            scenario, runs, duration_s=duration, profile_path=profile_path, host=host, data_plane=native, **cells
        )
    else:
        report = replay_live(scenario, runs, calibrate=calibrate, **kwargs)
        if mode == "both":
            host, duration, native = report.get("host"), kwargs.get("duration_s"), kwargs.get("data_plane", False)
            sim = replay_sim(
                scenario, runs, duration_s=duration, profile_path=profile_path, host=host, data_plane=native, **cells
            )
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
