"""`edgeroute bench dataplane`: the native data plane (router.dataplane, HAProxy) against the node
called directly and the Python router, in one run on one machine, over HTTP and gRPC: closed loop at
c=1 (added p50) and c=32 (throughput, CPU per request of each server, counted against the requests
the node ran), rounds interleaved; the load from Triton's perf_analyzer where it is found, else from
Python closed loops. Then how fast the proxy's state follows: a node killed until the proxy holds it
down, a policy swap until the proxy carries no request natively, and with that policy (`compass`,
which only the router runs) what the proxy passes to the router against the router's own doors at
c=32 (the router's CPU per request each way). Everything shares the machine
(broker, node, router, proxy, the load generator): ratios, not capacity. A benchmark: it prints and
writes JSON, and asserts nothing.
"""

from __future__ import annotations

import asyncio
import os
import re
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from scenarios.bench.common import cpu_s, interleaved, result, save
from scenarios.bench.router import closed_loop
from scenarios.bench.triton import find_perf_analyzer
from scenarios.spec.schema import NodeSpec, Scenario
from scenarios.stack.launcher import Stack
from scenarios.stack.procs import http_json


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    out = [int(p) for p in text.split()]
    return out + [c for p in out for c in _children(p)]


def _until(predicate: Any, timeout_s: float) -> float | None:
    began = time.perf_counter()
    while time.perf_counter() - began < timeout_s:
        if predicate():
            return time.perf_counter() - began
        time.sleep(0.002)
    return None


def _served(node_url: str, model: str) -> int:
    """Inferences the node has run of `model` (its statistics extension)."""
    status, doc = http_json(f"{node_url}/v2/models/{model}/stats")
    return int(doc["model_stats"][0].get("inference_count", 0)) if status == 200 else 0


def _perf_analyzer(binary: str, target: str, protocol: str, c: int, window_ms: int) -> dict[str, Any]:
    """One perf_analyzer run (p50 as its stability measure): requests/s, p50 and p99 in ms."""
    lib = Path(binary).parent / "lib"  # (the installer's libcudart; no GPU is used)
    env = {**os.environ, "LD_LIBRARY_PATH": f"{lib}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
    args = [binary, "-m", "echo", "-u", target, "-i", protocol, "-p", str(window_ms), "-s", "50"]
    args += ["--max-trials", "10", "--concurrency-range", str(c), "--percentile", "50"]
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=120, env=env)
    except subprocess.TimeoutExpired:
        return {"failures": 1, "error": "timed out"}
    rps = re.findall(r"Throughput: ([0-9.]+) infer/sec", done.stdout)
    p50 = re.findall(r"p50 latency: (\d+) usec", done.stdout)
    p99 = re.findall(r"p99 latency: (\d+) usec", done.stdout)
    if done.returncode != 0 or not (rps and p50 and p99):
        return {"failures": 1, "error": " | ".join((done.stdout + done.stderr).strip().splitlines()[-3:])[:500]}
    return {"failures": 0, "rps": float(rps[-1]), "p50_ms": int(p50[-1]) / 1000, "p99_ms": int(p99[-1]) / 1000}


def bench_dataplane(
    out_dir: Path,
    requests: int = 3000,
    rounds: int = 3,
    kafka: str | None = None,
    load: str = "auto",
    window_ms: int = 1000,
) -> dict[str, Any]:
    """`load`: "perf_analyzer" (Triton's, C++: the load generator takes less of the machine), "python"
    (aiohttp and grpc.aio closed loops, `requests` per round) or "auto" (perf_analyzer where found)."""
    binary = find_perf_analyzer() if load in ("auto", "perf_analyzer") else None
    if load == "perf_analyzer" and binary is None:
        raise RuntimeError("perf_analyzer not found ($EDGEROUTE_PERF_ANALYZER, PATH, ~/.cache/edgeroute)")
    load = "perf_analyzer" if binary is not None else "python"
    nodes = [
        {"id": f"n{i}", "partition": "edge-a", "slots": 1, "max_queue": 1024, "queue_target_ms": 0, "models": ["echo"]}
        for i in (1, 2)
    ]
    scenario = Scenario.model_validate(
        {
            "name": "bench-dataplane",
            "topology": {"partitions": ["edge-a"], "nodes": nodes[:1]},
            "workload": {"sites": [{"site": "edge-a", "rate_rps": 1, "models": {"echo": 1}}]},
            "router": {"default_deadline_ms": 10000},
            "policies": ["p2c"],
        }
    )
    rows: list[dict[str, Any]] = []
    with Stack(scenario, kafka=kafka, data_plane=True) as stack:
        assert stack.router is not None and stack.router.dataplane
        view_url = f"{stack.router.url}/admin/view"
        if _until(lambda: "echo" in (http_json(view_url)[1].get("data_plane") or {}).get("models", []), 20) is None:
            raise RuntimeError(f"the data plane never carried echo; logs in {stack.log_dir}")
        node = stack.nodes["n1"]
        router_pid = stack.router.popen.pid
        proxy_pids = _children(router_pid)
        where = {
            "http": {"direct": node.url, "native": stack.router.dataplane, "router": stack.router.url},
            "grpc": {"direct": node.grpc, "native": stack.router.dataplane_grpc, "router": stack.router.grpc},
        }
        proxy_only = {"native": proxy_pids, "router": [router_pid]}
        pids = {
            "direct": [node.popen.pid],
            "native": [node.popen.pid, *proxy_pids],
            "router": [node.popen.pid, router_pid],
        }
        for protocol, c in (("http", 1), ("grpc", 1), ("http", 32), ("grpc", 32)):

            def run(target: str, rnd: int, c: int = c, protocol: str = protocol) -> dict[str, Any]:
                address = where[protocol][target]
                own = proxy_only.get(target, [])
                before, before_own, served = cpu_s(pids[target]), cpu_s(own), _served(node.url, "echo")
                if binary is not None:
                    r = _perf_analyzer(binary, address.removeprefix("http://"), protocol, c, window_ms)
                else:
                    url = address if protocol == "grpc" else f"{address}/v2/models/echo/infer"
                    form = "grpc" if protocol == "grpc" else "json"
                    r = asyncio.run(closed_loop(url, c, requests if c > 1 else requests // 3, 200, form))
                done = max(1, _served(node.url, "echo") - served)  # (every request the run made, warm-up too)
                r["cpu_us_per_request"] = round((cpu_s(pids[target]) - before) / done * 1e6, 1)
                r["proxy_cpu_us_per_request"] = round((cpu_s(own) - before_own) / done * 1e6, 1)
                r.update(target=target, round=rnd, protocol=protocol, concurrency=c, load=load)
                return r

            for runs in interleaved(rounds, list(where[protocol]), run).values():
                rows.extend(runs)
        # how fast the proxy follows: a node killed, a policy swap
        stack.use_nodes([*stack.node_specs.values(), NodeSpec.model_validate(nodes[1])])

        def proxy_says(node_id: str, prefix: str) -> bool:
            state = http_json(view_url)[1].get("data_plane") or {}
            return str(state.get("nodes", {}).get(node_id, {}).get("proxy", "")).startswith(prefix)

        _until(lambda: proxy_says("n2", "UP"), 30)
        t0 = time.perf_counter()
        stack.kill_node("n2")
        kill_s = _until(lambda: proxy_says("n2", "DOWN"), 5)
        kill_s = None if kill_s is None else time.perf_counter() - t0  # (from the kill, its own wait counted)
        stack.set_policy({"preset": "compass"})
        swap_s = _until(lambda: not (http_json(view_url)[1].get("data_plane") or {}).get("native", True), 5)
        # what the proxy passes to the router (a policy only the router runs), against the router's own doors
        passed = {"http": stack.router.dataplane, "grpc": stack.router.dataplane_grpc}
        for protocol in ("http", "grpc"):
            targets = {"passed": passed[protocol], "router_compass": where[protocol]["router"]}

            def run_passed(target: str, rnd: int, protocol: str = protocol, targets: Any = targets) -> dict[str, Any]:
                before, before_router, served = (
                    cpu_s(_children(router_pid)),
                    cpu_s([router_pid]),
                    _served(node.url, "echo"),
                )
                if binary is not None:
                    r = _perf_analyzer(binary, targets[target].removeprefix("http://"), protocol, 32, window_ms)
                else:
                    url = targets[target] if protocol == "grpc" else f"{targets[target]}/v2/models/echo/infer"
                    r = asyncio.run(closed_loop(url, 32, requests, 200, "grpc" if protocol == "grpc" else "json"))
                done = max(1, _served(node.url, "echo") - served)
                r["router_cpu_us_per_request"] = round((cpu_s([router_pid]) - before_router) / done * 1e6, 1)
                r["proxy_cpu_us_per_request"] = round((cpu_s(_children(router_pid)) - before) / done * 1e6, 1)
                r.update(target=target, round=rnd, protocol=protocol, concurrency=32, load=load, policy="compass")
                return r

            for runs in interleaved(rounds, list(targets), run_passed).values():
                rows.extend(runs)
        stack.set_policy({"preset": "p2c"})

    def med(target: str, c: int, key: str, protocol: str = "http") -> float:
        vals = [
            r[key] for r in rows if (r["target"], r["concurrency"], r["protocol"]) == (target, c, protocol) and key in r
        ]
        return float(statistics.median(vals)) if vals else float("nan")

    summary: dict[str, Any] = {"load": load}
    for protocol in ("http", "grpc"):
        summary[protocol] = {
            "added_p50_us_c1": {
                t: round((med(t, 1, "p50_ms", protocol) - med("direct", 1, "p50_ms", protocol)) * 1000, 1)
                for t in ("native", "router")
            },
            "rps_ratio_c32": {
                t: round(med(t, 32, "rps", protocol) / med("direct", 32, "rps", protocol), 3)
                for t in ("native", "router")
            },
            "proxy_cpu_us_c32": {t: med(t, 32, "proxy_cpu_us_per_request", protocol) for t in ("native", "router")},
            "cpu_ratio_native_over_router_c32": round(
                med("native", 32, "proxy_cpu_us_per_request", protocol)
                / max(1e-9, med("router", 32, "proxy_cpu_us_per_request", protocol)),
                3,
            ),
        }
    summary["grpc_over_http_rps_native_c32"] = round(med("native", 32, "rps", "grpc") / med("native", 32, "rps"), 3)
    summary["passed_to_router_c32"] = {  # (compass: the proxy passes every request to the router)
        protocol: {
            "rps_over_router_door": round(
                med("passed", 32, "rps", protocol) / med("router_compass", 32, "rps", protocol), 3
            ),
            "router_cpu_us": {
                t: med(t, 32, "router_cpu_us_per_request", protocol) for t in ("passed", "router_compass")
            },
        }
        for protocol in ("http", "grpc")
    }
    summary["failed_runs"] = sum(1 for r in rows if r.get("failures") and "rps" not in r)
    summary["node_killed_to_down_s"] = None if kill_s is None else round(kill_s, 3)
    summary["policy_swap_to_proxy_s"] = None if swap_s is None else round(swap_s, 3)
    doc = result("dataplane", rounds=rounds, requests=requests, load=load, rows=rows, summary=summary)
    head = f"{'proto':5} {'target':14} {'c':>3} {'p50 ms':>8} {'p99 ms':>8} {'rps':>8}"
    lines = [f"load: {load}", f"{head} {'cpu us/req':>11} {'front us/req':>13}"]
    for protocol in ("http", "grpc"):
        for c in (1, 32):
            for t in ("direct", "native", "router"):
                lines.append(
                    f"{protocol:5} {t:14} {c:>3} {med(t, c, 'p50_ms', protocol):>8.3f} "
                    f"{med(t, c, 'p99_ms', protocol):>8.3f} {med(t, c, 'rps', protocol):>8.0f} "
                    f"{med(t, c, 'cpu_us_per_request', protocol):>11.0f} "
                    f"{med(t, c, 'proxy_cpu_us_per_request', protocol):>13.0f}"
                )
    lines.append("with compass (the router runs it), c=32: the router's CPU per request, and the proxy's")
    head = f"{'proto':5} {'target':14} {'p50 ms':>8} {'p99 ms':>8} {'rps':>8}"
    lines.append(f"{head} {'router us/req':>14} {'proxy us/req':>13}")
    for protocol in ("http", "grpc"):
        for t, label in (("passed", "proxy->router"), ("router_compass", "router alone")):
            proxy = med(t, 32, "proxy_cpu_us_per_request", protocol) if t == "passed" else float("nan")
            lines.append(
                f"{protocol:5} {label:14} {med(t, 32, 'p50_ms', protocol):>8.3f} "
                f"{med(t, 32, 'p99_ms', protocol):>8.3f} {med(t, 32, 'rps', protocol):>8.0f} "
                f"{med(t, 32, 'router_cpu_us_per_request', protocol):>14.0f} {proxy:>13.0f}"
            )
    lines += [f"{k}: {v}" for k, v in summary.items() if k != "load"]
    save(out_dir, doc, lines)
    return doc
