"""`edgeroute profile`: measure what the simulator needs on real nodes with the real zoo models.

Starts the embedded broker, one node serving every profiled model (one slot, speed 1) and a router,
then per model, closed loop at concurrency 1 so nothing queues:

- `exec_ms[batch]`: slot time of one execution at batch 1, 2, 4, 8 (the node's `x-edgeroute-exec-ms`);
- `overhead_ms`: client-measured latency through the router minus that request's execution time, i.e.
  everything that is not the model: HTTP both hops, parsing, validation, the policy, scheduling;
- `telemetry_lag_ms`: send-to-receipt lag of telemetry through the broker.

Each is stored as 101 quantiles (0, 1, ..., 100th percentile); the simulator samples them by inverse
CDF. Speed factors scale `exec_ms` for other device classes (a node with `speed: 0.1` takes 10x).
"""

from __future__ import annotations

import asyncio
import json
import platform
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from scenarios.launcher import Stack
from scenarios.loadgen import Payload, example_payload
from scenarios.schema import Scenario
from telemetry.bus import KafkaTelemetrySource
from telemetry.store import ViewStore

DEFAULT_PROFILE = Path(__file__).parent / "profiles" / "cpu.json"
BATCHES = (1, 2, 4, 8)


def quantiles(samples: list[float]) -> list[float]:
    if not samples:
        return [0.0] * 101
    return [round(float(v), 4) for v in np.percentile(np.asarray(samples), np.arange(101))]


async def _measure(url: str, payload: Payload, n: int) -> list[tuple[float, float]]:
    """(latency ms, exec ms) for n sequential requests after a short warm-up."""
    headers = {"Content-Type": "application/json", "x-edgeroute-deadline-ms": "10000"}
    if payload.header_length is not None:
        headers["Inference-Header-Content-Length"] = str(payload.header_length)
        headers["Content-Type"] = "application/octet-stream"
    out: list[tuple[float, float]] = []
    async with aiohttp.ClientSession() as session:
        for i in range(n + 10):
            t0 = time.perf_counter()
            async with session.post(url, data=payload.body, headers=headers) as resp:
                await resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"profiling {url}: {resp.status}")
                exec_ms = float(resp.headers.get("x-edgeroute-exec-ms", "0"))
            if i >= 10:
                out.append(((time.perf_counter() - t0) * 1000.0, exec_ms))
    return out


def profile(models: list[str], requests: int, out: Path, kafka: str | None = None) -> dict[str, Any]:
    scenario = Scenario.model_validate(
        {
            "name": "profile",
            "topology": {
                "partitions": ["lab"],
                "nodes": [
                    {"id": "profiler", "partition": "lab", "slots": 1, "max_queue": 64, "models": models}
                ],
            },
            "workload": {"sites": [{"site": "lab", "rate_rps": 1, "models": {m: 1 for m in models}}]},
            "router": {"default_deadline_ms": 10000},
            "policies": ["round_robin"],
        }
    )
    result: dict[str, Any] = {
        "device": "cpu",
        "host": {
            "machine": platform.machine(),
            "processor": platform.processor(),
            "python": platform.python_version(),
        },
        "at": datetime.now(UTC).isoformat(timespec="seconds"),
        "requests": requests,
        "models": {},
    }
    with Stack(scenario, kafka=kafka) as stack:
        node_url = stack.nodes["profiler"].url
        store = ViewStore()
        source = KafkaTelemetrySource(stack.bootstrap, stack.topic, lookback_ms=0)
        source.start(store)
        try:
            for model in models:
                meta = asyncio.run(_metadata(stack.router_url, model))
                base = example_payload(meta, 0)
                entry: dict[str, Any] = {"exec_ms": {}}
                for batch in BATCHES:
                    payload = base if batch == 1 else example_payload(meta, 0, batch=batch)
                    direct = asyncio.run(
                        _measure(f"{node_url}/v2/models/{model}/infer", payload, requests // 2)
                    )
                    entry["exec_ms"][str(batch)] = quantiles([e for _, e in direct])
                routed = asyncio.run(_measure(f"{stack.router_url}/v2/models/{model}/infer", base, requests))
                entry["overhead_ms"] = quantiles([max(0.0, lat - e) for lat, e in routed])
                entry["exec_ms"]["1"] = quantiles([e for _, e in routed])
                result["models"][model] = entry
                o = entry["overhead_ms"]
                print(
                    f"  {model:<18} exec p50 {entry['exec_ms']['1'][50]:7.3f} ms"
                    f"  p99 {entry['exec_ms']['1'][99]:7.3f}"
                    f"   overhead p50 {o[50]:6.3f} ms  p99 {o[99]:6.3f}",
                    flush=True,
                )
            result["telemetry_lag_ms"] = quantiles(list(store.lag_ms))
        finally:
            source.stop()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"written: {out}")
    return result


async def _metadata(router_url: str, model: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session, session.get(f"{router_url}/v2/models/{model}") as resp:
        doc: dict[str, Any] = await resp.json()
        return doc


def load_profile(path: Path | None = None) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((path or DEFAULT_PROFILE).read_text())
    return doc
