"""`edgeroute replay`: replay a scenario once per policy against the live local stack.

One stack (broker, nodes, router) serves every policy in turn; between runs the router's policy is
swapped through `PUT /admin/policy` (the same validated, atomic path operators use) and the cluster is
let drain. Every policy sees the identical arrival schedule (same seed).
"""

from __future__ import annotations

import asyncio
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from scenarios.launcher import Stack, http_json
from scenarios.loadgen import build_schedule, fetch_payloads, run_load
from scenarios.report import format_table, summarize, write_report
from scenarios.schema import PolicyRun, Scenario


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
) -> dict[str, Any]:
    """Run each policy on the live stack; returns the report (not yet written)."""
    duration = duration_s if duration_s is not None else scenario.workload.duration_s
    warmup = min(scenario.workload.warmup_s, duration / 4)
    schedule = build_schedule(scenario.workload, scenario.seed, duration + warmup)
    models = {a.model for a in schedule} or {m for s in scenario.workload.sites for m in s.models}
    report: dict[str, Any] = {
        "scenario": scenario.name,
        "mode": "live",
        "seed": scenario.seed,
        "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "duration_s": duration,
        "warmup_s": warmup,
        "policies": {},
    }
    stack = Stack(scenario, kafka=kafka)
    if log_dir is not None:
        stack.log_dir = log_dir
    with stack:
        if echo:
            print(f"router: {stack.router_url}\nkafka: {stack.bootstrap}", flush=True)
        payloads = asyncio.run(fetch_payloads(stack.router_url, models, scenario.seed, stack.client_headers))
        for run in runs:
            stack.set_policy(run.policy.model_dump(exclude_none=True))
            _wait_idle(stack.router_url, stack.admin_headers)
            started = time.monotonic()
            results = asyncio.run(
                run_load(
                    stack.router_url,
                    schedule,
                    payloads,
                    progress=_progress(run.name),
                    headers=stack.client_headers,
                )
            )
            wall = time.monotonic() - started
            measured = [r for r in results if r.arrival.at_s >= warmup]
            summary = summarize(measured, duration)
            summary["warmup_requests"] = len(results) - len(measured)
            summary["wall_s"] = round(wall, 2)
            report["policies"][run.name] = summary
        status, view = http_json(f"{stack.router_url}/admin/view", headers=stack.admin_headers)
        report["telemetry"] = view["telemetry"] if status == 200 else {}
    return report


def run_replay(scenario: Scenario, runs: list[PolicyRun], out_dir: Path, **kwargs: Any) -> Path:
    report = replay_live(scenario, runs, **kwargs)
    path = write_report(report, out_dir)
    print(format_table(report))
    print(f"report: {path}")
    return path
