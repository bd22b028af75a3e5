"""Benchmarks: programs that print figures and write JSON; they assert nothing.

`edgeroute bench router`: the latency the router adds and the request rate it sustains, against
calling the node directly, on the trivial `echo` model, closed loop at each concurrency. Everything
(broker, node, router, this load generator) shares the machine, so the figures are for comparing
builds on one host, not absolute capacity.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp

from scenarios.launcher import Stack
from scenarios.report import percentile
from scenarios.schema import Scenario

BODY = json.dumps(
    {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1.0, 2.0, 3.0, 4.0]}]}
).encode()


async def closed_loop(url: str, concurrency: int, requests: int, warmup: int) -> dict[str, Any]:
    connector = aiohttp.TCPConnector(limit=concurrency)
    latencies: list[float] = []
    failures = 0
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one(record: bool) -> None:
            nonlocal failures
            t0 = time.perf_counter()
            async with session.post(url, data=BODY, headers={"Content-Type": "application/json"}) as resp:
                await resp.read()
                ok = resp.status == 200
            if record:
                if ok:
                    latencies.append((time.perf_counter() - t0) * 1000.0)
                else:
                    failures += 1

        async def worker(n: int, record: bool) -> None:
            for _ in range(n):
                await one(record)

        await asyncio.gather(*(worker(max(1, warmup // concurrency), False) for _ in range(concurrency)))
        per = requests // concurrency
        start = time.perf_counter()
        await asyncio.gather(*(worker(per, True) for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    latencies.sort()
    return {
        "concurrency": concurrency,
        "requests": per * concurrency,
        "failures": failures,
        "p50_ms": round(percentile(latencies, 50), 3),
        "p99_ms": round(percentile(latencies, 99), 3),
        "rps": round(len(latencies) / elapsed, 1),
    }


def bench_router(
    out_dir: Path, requests: int = 2000, concurrencies: tuple[int, ...] = (1, 32), kafka: str | None = None
) -> dict[str, Any]:
    scenario = Scenario.model_validate(
        {
            "name": "bench-router",
            "topology": {
                "partitions": ["edge-a"],
                "nodes": [
                    {
                        "id": "bench-node",
                        "partition": "edge-a",
                        "slots": 1,
                        "max_queue": 1024,
                        "models": ["echo"],
                    }
                ],
            },
            "workload": {"sites": [{"site": "edge-a", "rate_rps": 1, "models": {"echo": 1}}]},
            "router": {"default_deadline_ms": 10000},
            "policies": ["p2c"],
        }
    )
    rows: list[dict[str, Any]] = []
    with Stack(scenario, kafka=kafka) as stack:
        direct = f"{stack.nodes['bench-node'].url}/v2/models/echo/infer"
        routed = f"{stack.router_url}/v2/models/echo/infer"
        for c in concurrencies:
            for target, url in (("direct", direct), ("router", routed)):
                row = asyncio.run(closed_loop(url, c, requests, warmup=min(200, requests // 5)))
                row["target"] = target
                rows.append(row)
                print(
                    f"  {target:<7} c={c:<3} p50 {row['p50_ms']:7.3f} ms  p99 {row['p99_ms']:7.3f} ms  "
                    f"{row['rps']:8.1f} req/s  ({row['failures']} failed)",
                    flush=True,
                )
    summary = []
    for c in concurrencies:
        d = next(r for r in rows if r["target"] == "direct" and r["concurrency"] == c)
        r = next(r for r in rows if r["target"] == "router" and r["concurrency"] == c)
        summary.append(
            {
                "concurrency": c,
                "added_p50_ms": round(r["p50_ms"] - d["p50_ms"], 3),
                "added_p99_ms": round(r["p99_ms"] - d["p99_ms"], 3),
                "direct_rps": d["rps"],
                "router_rps": r["rps"],
            }
        )
    result = {
        "benchmark": "router",
        "model": "echo",
        "requests_per_run": requests,
        "host": {"machine": platform.machine(), "python": platform.python_version()},
        "at": datetime.now(UTC).isoformat(timespec="seconds"),
        "runs": rows,
        "summary": summary,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "router.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'concurrency':>11} {'added p50 ms':>13} {'added p99 ms':>13} {'direct req/s':>13} {'router req/s':>13}")
    for s in summary:
        print(
            f"{s['concurrency']:>11} {s['added_p50_ms']:>13.3f} {s['added_p99_ms']:>13.3f} "
            f"{s['direct_rps']:>13.1f} {s['router_rps']:>13.1f}"
        )
    print(f"written: {out_dir / 'router.json'}")
    return result


def sim_scenario(nodes: int, requests: int, policy: str, rate_rps: float) -> Scenario:
    """A synthetic cluster: `nodes` nodes over 10 edge sites and a cloud, three models each."""
    sites = [f"site-{i}" for i in range(10)]
    specs = []
    for i in range(nodes):
        part = "cloud" if i % 10 == 9 else sites[i % 10]
        specs.append(
            {
                "id": f"n{i:05d}",
                "partition": part,
                "tier": "cloud" if part == "cloud" else "edge",
                "slots": 2 if part == "cloud" else 1,
                "speed": 0.05,
                "max_queue": 64,
                "models": ["sensor_mlp", "mobilenet_s", "tiny_transformer"],
            }
        )
    duration = requests / rate_rps
    return Scenario.model_validate(
        {
            "name": "bench-sim",
            "topology": {"partitions": [*sites, "cloud"], "nodes": specs},
            "workload": {
                "duration_s": duration,
                "max_requests": requests,
                "sites": [
                    {
                        "site": s,
                        "rate_rps": rate_rps / len(sites),
                        "models": {"sensor_mlp": 0.5, "mobilenet_s": 0.3, "tiny_transformer": 0.2},
                        "priorities": {0: 0.9, 10: 0.1},
                        "deadline_ms": {0: 500, 10: 100},
                    }
                    for s in sites
                ],
            },
            "policies": [policy],
        }
    )


def bench_sim(
    out_dir: Path, nodes: int = 1000, requests: int = 1_000_000, policy: str = "p2c", rate_rps: float = 20_000.0
) -> dict[str, Any]:
    """Events per second of the simulator with a real policy in the loop; prints and writes JSON."""
    import resource

    from scenarios.profile import load_profile
    from scenarios.sim import Profile, Simulation
    from scenarios.workload import build_schedule

    scenario = sim_scenario(nodes, requests, policy, rate_rps)
    t0 = time.perf_counter()
    schedule = build_schedule(scenario.workload, scenario.seed, scenario.workload.duration_s + 1)
    schedule_s = time.perf_counter() - t0
    profile = Profile.from_json(load_profile())
    sim = Simulation(scenario, scenario.policies[0], schedule, profile)
    t0 = time.perf_counter()
    results = sim.run()
    wall = time.perf_counter() - t0
    ok = sum(1 for r in results if r.status == 200)
    result = {
        "benchmark": "sim",
        "policy": policy,
        "nodes": nodes,
        "requests": len(schedule),
        "completed": ok,
        "simulated_s": round(sim.now / 1000.0, 2),
        "events": sim.events,
        "wall_s": round(wall, 2),
        "events_per_s": round(sim.events / wall),
        "requests_per_s": round(len(schedule) / wall),
        "schedule_build_s": round(schedule_s, 2),
        "telemetry_messages": sim.store.messages,
        "max_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "host": {"machine": platform.machine(), "python": platform.python_version()},
        "at": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "sim.json").write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"{len(schedule):,} requests on {nodes:,} nodes with {policy}: {sim.events:,} events in {wall:.1f} s "
        f"= {result['events_per_s']:,} events/s ({result['requests_per_s']:,} requests/s), "
        f"{ok:,} completed, {sim.store.messages:,} telemetry messages, max RSS {result['max_rss_mb']} MB"
    )
    print(f"written: {out_dir / 'sim.json'}")
    return result


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


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process (Linux /proc; 0 where unreadable)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _routers_round(scenario: Scenario, routers: int, share: bool, schedule: list[Any]) -> dict[str, Any]:
    """One run of the bursts through `routers` router processes: the answers, node figures and CPU."""
    from scenarios.launcher import http_json
    from scenarios.loadgen import fetch_payloads, run_load

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
        cpu0 = {k: sum(_cpu_seconds(pid) for pid in v) for k, v in pids.items()}
        t0 = time.monotonic()
        results = asyncio.run(run_load(stack.router_url, schedule, payloads))
        wall = time.monotonic() - t0
        cpu = {k: round(100 * (sum(_cpu_seconds(pid) for pid in v) - cpu0[k]) / wall, 1) for k, v in pids.items()}
        stats = {n: http_json(f"{p.url}/admin/stats", headers=stack.node_headers)[1] for n, p in stack.nodes.items()}
        peers = http_json(f"{stack.router_url}/admin/view")[1].get("peers")
    measured = [r for r in results if r.arrival.at_s >= scenario.workload.warmup_s]
    return {
        "results": measured,
        "p99": percentile(sorted(r.latency_ms for r in measured if r.status == 200), 99),
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
    (telemetry.peers): p50/p99 latency and the largest queue any node reached. `rounds` rounds, the
    three set-ups interleaved in each (so a drift of the machine hits all three alike); quantiles are
    over every round's answers pooled, with each round's p99 alongside. Prints and writes JSON."""
    from scenarios.workload import build_schedule

    scenario = routers_scenario(nodes, rate_rps, duration_s, policy)
    schedule = build_schedule(scenario.workload, scenario.seed)
    setups = (("1 router", 1, True), ("2 routers, not sharing", 2, False), ("2 routers, sharing in-flight", 2, True))
    done: dict[str, list[dict[str, Any]]] = {label: [] for label, _, _ in setups}
    for i in range(rounds):
        for label, routers, share in setups:
            one = _routers_round(scenario, routers, share, schedule)
            done[label].append(one)
            print(
                f"round {i + 1}/{rounds}  {label:<30} p99 {one['p99']:7.1f} ms  "
                f"cpu % broker {one['cpu']['broker']:.0f} nodes {one['cpu']['nodes']:.0f} "
                f"routers {one['cpu']['routers']:.0f}",
                flush=True,
            )
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
                "p50_ms": round(percentile(ok, 50), 2),
                "p99_ms": round(percentile(ok, 99), 2),
                "p99_by_round_ms": [round(one["p99"], 2) for one in rounds_done],
                "max_node_queue": max(one["peak"] for one in rounds_done),
                "exec_mean_ms": round(sum(r.exec_ms for r in served) / max(1, len(served)), 3),  # CPU contention
                "queue_mean_ms": round(sum(r.queue_ms for r in served) / max(1, len(served)), 3),  # balance
                "slot_gap_ms": round(sum(one["gap"] for one in rounds_done) / len(rounds_done), 4),  # node idle
                "router_and_network_p50_ms": round(percentile(rest, 50), 3),
                "router_and_network_p99_ms": round(percentile(rest, 99), 3),
                "cpu_percent": {  # of one core, mean over rounds, while the load ran
                    k: round(sum(one["cpu"][k] for one in rounds_done) / len(rounds_done), 1)
                    for k in ("broker", "nodes", "routers")
                },
                "by_node": dict(sorted(by_node.items())),
                "peers": rounds_done[-1]["peers"],
            }
        )
    base = runs[0]
    print(f"pooled over {rounds} round(s):")
    for row in runs:
        if row is not base:
            row["p99_vs_one_router"] = round(row["p99_ms"] / base["p99_ms"], 3) if base["p99_ms"] else None
            row["max_queue_vs_one_router"] = (
                round(row["max_node_queue"] / base["max_node_queue"], 3) if base["max_node_queue"] else None
            )
        cpu = row["cpu_percent"]
        print(
            f"{row['run']:<30} p50 {row['p50_ms']:6.1f} ms  p99 {row['p99_ms']:6.1f} ms "
            f"(x{row.get('p99_vs_one_router', 1):.3f})  max node queue {row['max_node_queue']:2d}  node queue mean "
            f"{row['queue_mean_ms']:5.1f} ms  exec {row['exec_mean_ms']:.2f} + gap {row['slot_gap_ms']:.2f} ms  "
            f"router p50/p99 {row['router_and_network_p50_ms']:.1f}/{row['router_and_network_p99_ms']:.1f} ms  "
            f"cpu % {cpu['broker']:.0f}/{cpu['nodes']:.0f}/{cpu['routers']:.0f}  ok {row['completed']}/{row['sent']}",
            flush=True,
        )
    result = {
        "benchmark": "routers",
        "policy": policy,
        "nodes": nodes,
        "burst_rps": rate_rps,
        "duration_s": duration_s,
        "rounds": rounds,
        "runs": runs,
        "host": {"machine": platform.machine(), "python": platform.python_version(), "cpus": os.cpu_count()},
        "at": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "routers.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"written: {out_dir / 'routers.json'}")
    return result
