"""`edgeroute bench routers`: the same bursts through one router, two routers that do not share their
load and two that do (telemetry.kafka.peers), in interleaved rounds; latency, the largest node queue and the
CPU of the broker, nodes and routers. A benchmark: it prints and writes JSON, and asserts nothing."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from scenarios.bench.common import cpu_s, interleaved, result, save
from scenarios.spec.schema import Scenario
from scenarios.stack.launcher import Stack
from telemetry.measure.quantiles import nearest_rank


def routers_scenario(nodes: int, rate_rps: float, duration_s: float, policy: str) -> Scenario:
    """Identical slow nodes behind the routers; telemetry every 100 ms only (change_threshold high, as a
    large fleet would run it), so between two reports a router knows only what it dispatched itself."""
    return Scenario.model_validate(
        {
            "name": "bench-routers",
            "seed": 21,
            "topology": {
                "partitions": ["site-a"],
                "nodes": [
                    {
                        "id": f"n{i + 1}",
                        "partition": "site-a",
                        "slots": 1,
                        "speed": 0.005,
                        "max_queue": 512,
                        "change_threshold": 1000,
                        "models": ["mobilenet_s"],
                    }
                    for i in range(nodes)
                ],
            },
            "workload": {
                "duration_s": duration_s,
                "warmup_s": 1,
                "sites": [
                    {
                        "site": "site-a",
                        "arrival": "bursty",
                        "rate_rps": rate_rps,
                        "on_s": 3,
                        "off_rate_rps": rate_rps / 6,
                        "off_s": 2,
                        "models": {"mobilenet_s": 1.0},
                        "deadline_ms": {0: 5000},
                    }
                ],
            },
            "policies": [policy],
        }
    )


def _routers_round(scenario: Scenario, routers: int, share: bool, schedule: list[Any]) -> dict[str, Any]:
    """One run of the bursts through `routers` router processes: the answers, node figures and CPU."""
    from scenarios.stack.loadgen import fetch_payloads, run_load
    from scenarios.stack.procs import http_json

    stack = Stack(scenario, routers=routers, share_load=share)
    with stack:
        payloads = asyncio.run(fetch_payloads(stack.router_url, {"mobilenet_s"}, scenario.seed))
        time.sleep(1.5)  # peers find each other
        for proc in stack.nodes.values():
            http_json(f"{proc.url}/admin/stats?reset=1", headers=stack.node_headers)
        assert stack.broker is not None and stack.broker.proc is not None
        pids = {
            "broker": [stack.broker.proc.pid],
            "nodes": [p.popen.pid for p in stack.nodes.values()],
            "routers": [p.popen.pid for p in stack.peers],
        }
        cpu0 = {k: cpu_s(v) for k, v in pids.items()}
        t0 = time.monotonic()
        results = asyncio.run(run_load(stack.router_url, schedule, payloads))
        wall = time.monotonic() - t0
        cpu = {k: round(100 * (cpu_s(v) - cpu0[k]) / wall, 1) for k, v in pids.items()}
        stats = {n: http_json(f"{p.url}/admin/stats", headers=stack.node_headers)[1] for n, p in stack.nodes.items()}
        peers = http_json(f"{stack.router_url}/admin/view")[1].get("peers")
    measured = [r for r in results if r.arrival.at_s >= scenario.workload.warmup_s]
    return {
        "results": measured,
        "p99": nearest_rank(sorted(r.latency_ms for r in measured if r.status == 200), 0.99, presorted=True),
        "peak": max(st["peak_outstanding"] for st in stats.values()),
        "gap": sum(
            st["handoff_ms_mean"] * st["handoffs"] + st["wakeup_ms_mean"] * st["wakeups"] for st in stats.values()
        )
        / max(1, sum(st["handoffs"] + st["wakeups"] for st in stats.values())),
        "cpu": cpu,
        "peers": peers,
    }


def bench_routers(
    out_dir: Path,
    nodes: int = 4,
    rate_rps: float = 120.0,
    duration_s: float = 15.0,
    policy: str = "least_outstanding",
    rounds: int = 5,
) -> dict[str, Any]:
    """The same bursts through one router, two routers that do not share their load, and two that do
    (telemetry.kafka.peers): p50/p99 latency and the largest queue any node reached. `rounds` rounds, the
    three set-ups interleaved in each (so a drift of the machine hits all three alike); quantiles are
    over every round's answers pooled, with each round's p99 alongside. Prints and writes JSON."""
    from scenarios.spec.workload import build_schedule

    scenario = routers_scenario(nodes, rate_rps, duration_s, policy)
    schedule = build_schedule(scenario.workload, scenario.seed)
    setups = (("1 router", 1, True), ("2 routers, not sharing", 2, False), ("2 routers, sharing in-flight", 2, True))
    shapes = {label: (routers, share) for label, routers, share in setups}

    def run(label: str, i: int) -> dict[str, Any]:
        one = _routers_round(scenario, *shapes[label], schedule)
        print(
            f"round {i + 1}/{rounds}  {label:<30} p99 {one['p99']:7.1f} ms  "
            f"cpu % broker {one['cpu']['broker']:.0f} nodes {one['cpu']['nodes']:.0f} "
            f"routers {one['cpu']['routers']:.0f}",
            flush=True,
        )
        return one

    done = interleaved(rounds, list(shapes), run)
    runs: list[dict[str, Any]] = []
    for label, routers, share in setups:
        rounds_done = done[label]
        measured = [r for one in rounds_done for r in one["results"]]
        served = [r for r in measured if r.status == 200]
        ok = sorted(r.latency_ms for r in served)
        rest = sorted(r.latency_ms - r.exec_ms - r.queue_ms for r in served)
        by_node: dict[str, int] = {}
        for r in served:
            by_node[r.node] = by_node.get(r.node, 0) + 1
        runs.append(
            {
                "run": label,
                "routers": routers,
                "sharing": share and routers > 1,
                "sent": len(measured),
                "completed": len(ok),
                "p50_ms": round(nearest_rank(ok, 0.5, presorted=True), 2),
                "p99_ms": round(nearest_rank(ok, 0.99, presorted=True), 2),
                "p99_by_round_ms": [round(one["p99"], 2) for one in rounds_done],
                "max_node_queue": max(one["peak"] for one in rounds_done),
                "exec_mean_ms": round(sum(r.exec_ms for r in served) / max(1, len(served)), 3),  # CPU contention
                "queue_mean_ms": round(sum(r.queue_ms for r in served) / max(1, len(served)), 3),  # balance
                "slot_gap_ms": round(sum(one["gap"] for one in rounds_done) / len(rounds_done), 4),  # node idle
                "router_and_network_p50_ms": round(nearest_rank(rest, 0.5, presorted=True), 3),
                "router_and_network_p99_ms": round(nearest_rank(rest, 0.99, presorted=True), 3),
                "cpu_percent": {  # of one core, mean over rounds, while the load ran
                    k: round(sum(one["cpu"][k] for one in rounds_done) / len(rounds_done), 1)
                    for k in ("broker", "nodes", "routers")
                },
                "by_node": dict(sorted(by_node.items())),
                "peers": rounds_done[-1]["peers"],
            }
        )
    base = runs[0]
    lines = [f"pooled over {rounds} round(s):"]
    for row in runs:
        if row is not base:
            row["p99_vs_one_router"] = round(row["p99_ms"] / base["p99_ms"], 3) if base["p99_ms"] else None
            row["max_queue_vs_one_router"] = (
                round(row["max_node_queue"] / base["max_node_queue"], 3) if base["max_node_queue"] else None
            )
        cpu = row["cpu_percent"]
        lines.append(
            f"{row['run']:<30} p50 {row['p50_ms']:6.1f} ms  p99 {row['p99_ms']:6.1f} ms "
            f"(x{row.get('p99_vs_one_router', 1):.3f})  max node queue {row['max_node_queue']:2d}  node queue mean "
            f"{row['queue_mean_ms']:5.1f} ms  exec {row['exec_mean_ms']:.2f} + gap {row['slot_gap_ms']:.2f} ms  "
            f"router p50/p99 {row['router_and_network_p50_ms']:.1f}/{row['router_and_network_p99_ms']:.1f} ms  "
            f"cpu % {cpu['broker']:.0f}/{cpu['nodes']:.0f}/{cpu['routers']:.0f}  ok {row['completed']}/{row['sent']}"
        )
    doc = result(
        "routers", policy=policy, nodes=nodes, burst_rps=rate_rps, duration_s=duration_s, rounds=rounds, runs=runs
    )
    save(out_dir, doc, lines)
    return doc
