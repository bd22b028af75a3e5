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
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp

from scenarios.launcher import Stack
from scenarios.report import percentile
from scenarios.schema import Scenario
from telemetry.broker import free_port, terminate, wait_for_port

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


# The floor the router is measured against: a bare aiohttp echo server and a bare aiohttp pass-through
# proxy, each its own process, a few dozen lines that are part of the benchmark, not of the product.
FLOOR = """
import os
import sys
from aiohttp import ClientSession, TCPConnector, web

mode, port, upstream = sys.argv[1], int(sys.argv[2]), (sys.argv[3] if len(sys.argv) > 3 else "")

async def echo(request):
    return web.Response(body=await request.read(), content_type="application/json")

async def proxy(request):
    body = await request.read()
    headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
    async with request.app["session"].post(upstream + request.path, data=body, headers=headers) as resp:
        return web.Response(status=resp.status, body=await resp.read(), content_type="application/json")

async def session_ctx(app):
    app["session"] = ClientSession(connector=TCPConnector(limit=0, limit_per_host=64))
    yield
    await app["session"].close()

if os.environ.get("EDGEROUTE_UVLOOP", "1") != "0":  # the same event loop as the node and the router
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
app = web.Application(client_max_size=16 << 20)
app.router.add_post("/v2/models/{m}/infer", echo if mode == "echo" else proxy)
if mode == "proxy":
    app.cleanup_ctx.append(session_ctx)
web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)
"""


def _cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a process so far (Linux /proc), or None where unknown."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _floor_process(mode: str, upstream: str = "") -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    args = [sys.executable, "-c", FLOOR, mode, str(port), *([upstream] if upstream else [])]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    wait_for_port("127.0.0.1", port, 30, proc)
    return proc, f"http://127.0.0.1:{port}"


def bench_router(
    out_dir: Path,
    requests: int = 2000,
    concurrencies: tuple[int, ...] = (1, 32),
    kafka: str | None = None,
    rounds: int = 3,
) -> dict[str, Any]:
    """The router against the floor, in one run on one machine: a bare aiohttp echo server, the
    edgeroute node (echo model) called directly, a bare aiohttp proxy in front of that node, and the
    router in front of it; at each concurrency, rounds interleaved (the median of each is reported),
    with the CPU each server process spent per request."""
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
    floors: list[subprocess.Popen[bytes]] = []
    with Stack(scenario, kafka=kafka) as stack:
        try:
            node = stack.nodes["bench-node"]
            echo_proc, echo_url = _floor_process("echo")
            floors.append(echo_proc)
            proxy_proc, proxy_url = _floor_process("proxy", node.url)
            floors.append(proxy_proc)
            assert stack.router is not None
            path = "/v2/models/echo/infer"
            targets = {
                "bare_echo": (echo_url + path, echo_proc.pid),
                "node": (node.url + path, node.popen.pid),
                "bare_proxy": (proxy_url + path, proxy_proc.pid),
                "router": (stack.router_url + path, stack.router.popen.pid),
            }
            for c in concurrencies:
                for rnd in range(rounds):
                    for target, (url, pid) in targets.items():
                        before = _cpu_s(pid)
                        row = asyncio.run(closed_loop(url, c, requests, warmup=min(200, requests // 5)))
                        after = _cpu_s(pid)
                        row.update(target=target, round=rnd)
                        if before is not None and after is not None and row["requests"]:
                            row["server_cpu_us_per_request"] = round((after - before) * 1e6 / row["requests"], 1)
                        rows.append(row)
                        print(
                            f"  {target:<10} c={c:<3} round {rnd}  p50 {row['p50_ms']:7.3f} ms  "
                            f"p99 {row['p99_ms']:7.3f} ms  {row['rps']:8.1f} req/s  "
                            f"cpu {row.get('server_cpu_us_per_request', '-')} us/req  ({row['failures']} failed)",
                            flush=True,
                        )
        finally:
            for proc in floors:
                terminate(proc)
    summary: list[dict[str, Any]] = []
    for c in concurrencies:

        def med(target: str, key: str, c: int = c) -> float:
            values = sorted(r[key] for r in rows if r["target"] == target and r["concurrency"] == c and key in r)
            return float(values[len(values) // 2]) if values else float("nan")

        fig = {t: {k: med(t, k) for k in ("p50_ms", "p99_ms", "rps", "server_cpu_us_per_request")} for t in targets}
        proxy_added = fig["bare_proxy"]["p50_ms"] - fig["node"]["p50_ms"]
        router_added = fig["router"]["p50_ms"] - fig["node"]["p50_ms"]
        summary.append(
            {
                "concurrency": c,
                "targets": fig,
                "router_added_p50_ms": round(router_added, 3),
                "proxy_added_p50_ms": round(proxy_added, 3),
                "router_vs_proxy_added_p50": round(router_added / proxy_added, 2) if proxy_added > 0 else None,
                "router_vs_proxy_rps": round(fig["router"]["rps"] / fig["bare_proxy"]["rps"], 3),
                "node_vs_bare_echo_rps": round(fig["node"]["rps"] / fig["bare_echo"]["rps"], 3),
            }
        )
    result = {
        "benchmark": "router",
        "model": "echo",
        "requests_per_run": requests,
        "rounds": rounds,
        "host": {"machine": platform.machine(), "python": platform.python_version(), "cpus": os.cpu_count()},
        "at": datetime.now(UTC).isoformat(timespec="seconds"),
        "runs": rows,
        "summary": summary,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "router.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'c':>3} {'target':<10} {'p50 ms':>8} {'p99 ms':>8} {'req/s':>8} {'cpu us/req':>10}")
    for srow in summary:
        for t, f in srow["targets"].items():
            print(
                f"{srow['concurrency']:>3} {t:<10} {f['p50_ms']:>8.3f} {f['p99_ms']:>8.3f} {f['rps']:>8.1f} "
                f"{f['server_cpu_us_per_request']:>10.1f}"
            )
        print(
            f"    router adds {srow['router_added_p50_ms']:.3f} ms p50 ({srow['router_vs_proxy_added_p50']}x the bare "
            f"proxy's {srow['proxy_added_p50_ms']:.3f} ms); router/proxy req/s {srow['router_vs_proxy_rps']}; "
            f"node/bare echo req/s {srow['node_vs_bare_echo_rps']}"
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
