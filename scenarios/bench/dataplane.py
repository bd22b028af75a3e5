"""`edgeroute bench dataplane`: the native data plane (router.dataplane, HAProxy) against the node
called directly and the Python router, in one run on one machine: closed loop at c=1 (added p50) and
c=32 (throughput, CPU per request of each server), rounds interleaved; then how fast the proxy's state
follows: a node killed until the proxy holds it down, a policy swap until the proxy carries no request
natively. Everything shares the machine (broker, node, router, proxy, this load generator): ratios,
not capacity. A benchmark: it prints and writes JSON, and asserts nothing.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

from scenarios.bench.common import cpu_s, interleaved, result, save
from scenarios.bench.router import closed_loop
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


def bench_dataplane(out_dir: Path, requests: int = 3000, rounds: int = 3, kafka: str | None = None) -> dict[str, Any]:
    nodes = [{"id": f"n{i}", "partition": "edge-a", "slots": 1, "max_queue": 1024, "models": ["echo"]} for i in (1, 2)]
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
        targets = {
            "direct": (f"{node.url}/v2/models/echo/infer", [node.popen.pid]),
            "native": (f"{stack.router.dataplane}/v2/models/echo/infer", [node.popen.pid, *proxy_pids]),
            "router": (f"{stack.router.url}/v2/models/echo/infer", [node.popen.pid, router_pid]),
        }
        proxy_only = {"native": proxy_pids, "router": [router_pid]}
        for c in (1, 32):

            def run(target: str, rnd: int, c: int = c) -> dict[str, Any]:
                url, pids = targets[target]
                own = proxy_only.get(target, [])
                before, before_own = cpu_s(pids), cpu_s(own)
                r = asyncio.run(closed_loop(url, c, requests if c > 1 else requests // 3, 200))
                r["cpu_us_per_request"] = round((cpu_s(pids) - before) / max(1, r["requests"]) * 1e6, 1)
                r["proxy_cpu_us_per_request"] = round((cpu_s(own) - before_own) / max(1, r["requests"]) * 1e6, 1)
                r["target"], r["round"] = target, rnd
                return r

            for runs in interleaved(rounds, list(targets), run).values():
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
        stack.set_policy({"preset": "slo_priority"})
        swap_s = _until(lambda: not (http_json(view_url)[1].get("data_plane") or {}).get("native", True), 5)
        stack.set_policy({"preset": "p2c"})

    def med(target: str, c: int, key: str) -> float:
        return float(statistics.median(r[key] for r in rows if r["target"] == target and r["concurrency"] == c))

    summary = {
        "added_p50_us_c1": {
            t: round((med(t, 1, "p50_ms") - med("direct", 1, "p50_ms")) * 1000, 1) for t in ("native", "router")
        },
        "rps_ratio_c32": {t: round(med(t, 32, "rps") / med("direct", 32, "rps"), 3) for t in ("native", "router")},
        "proxy_cpu_us_c32": {t: med(t, 32, "proxy_cpu_us_per_request") for t in ("native", "router")},
        "cpu_ratio_native_over_router_c32": round(
            med("native", 32, "proxy_cpu_us_per_request") / max(1e-9, med("router", 32, "proxy_cpu_us_per_request")), 3
        ),
        "node_killed_to_down_s": None if kill_s is None else round(kill_s, 3),
        "policy_swap_to_proxy_s": None if swap_s is None else round(swap_s, 3),
    }
    doc = result("dataplane", rounds=rounds, requests=requests, rows=rows, summary=summary)
    lines = [f"{'target':8} {'c':>3} {'p50 ms':>8} {'p99 ms':>8} {'rps':>8} {'cpu us/req':>11} {'proxy us/req':>13}"]
    for c in (1, 32):
        for t in targets:
            lines.append(
                f"{t:8} {c:>3} {med(t, c, 'p50_ms'):>8.3f} {med(t, c, 'p99_ms'):>8.3f} {med(t, c, 'rps'):>8.0f} "
                f"{med(t, c, 'cpu_us_per_request'):>11.0f} {med(t, c, 'proxy_cpu_us_per_request'):>13.0f}"
            )
    lines += [f"{k}: {v}" for k, v in summary.items()]
    save(out_dir, doc, lines)
    return doc
