"""Closed- and open-loop load generators as processes of their own (for `edgeroute bench gpu`): one
pre-encoded OIP body (binary tensors) sent again and again, aiohttp on uvloop, latencies of the
answers that came back 200 inside the measured window, every status counted. Part of the
benchmarks, not of the product."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

from telemetry.measure.quantiles import nearest_rank

# The load generator: a process of its own (several for high concurrency), aiohttp on uvloop, one
# pre-encoded body sent again and again; part of the benchmark, not of the product.
LOADGEN = r"""
import asyncio, json, sys, time
import aiohttp
try:
    import uvloop
    uvloop.install()
except ImportError:
    pass

url, body_path, header_length, mode, conc, seconds, warmup_s, interval_ms, headers_json = sys.argv[1:10]
body = open(body_path, "rb").read()
conc, seconds, warmup_s, interval_ms = int(conc), float(seconds), float(warmup_s), float(interval_ms)
headers = {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": header_length}
headers.update(json.loads(headers_json))

async def main():
    lat, statuses, queue_ms, exec_ms = [], {}, [], []
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = time.perf_counter()
        record_from, end = start + warmup_s, start + warmup_s + seconds

        async def one():
            t0 = time.perf_counter()
            try:
                async with session.post(url, data=body, headers=headers) as resp:
                    await resp.read()
                    status = resp.status
                    node_times = (resp.headers.get("x-edgeroute-queue-ms"), resp.headers.get("x-edgeroute-exec-ms"))
            except (aiohttp.ClientError, asyncio.TimeoutError):
                status = 0
            t1 = time.perf_counter()
            if t0 >= record_from and t1 <= end:
                statuses[status] = statuses.get(status, 0) + 1
                if status == 200:
                    lat.append((t1 - t0) * 1000.0)
                    if node_times[0] is not None and node_times[1] is not None:
                        queue_ms.append(float(node_times[0]))
                        exec_ms.append(float(node_times[1]))

        if mode == "closed":
            async def worker():
                while time.perf_counter() < end:
                    await one()
            await asyncio.gather(*(worker() for _ in range(conc)))
        else:
            tasks, i = set(), 0
            while True:
                at = start + i * interval_ms / 1000.0
                if at >= end:
                    break
                delay = at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                t = asyncio.ensure_future(one())
                tasks.add(t)
                t.add_done_callback(tasks.discard)
                i += 1
            if tasks:
                await asyncio.gather(*tasks)
    doc = {"latencies_ms": lat, "statuses": statuses, "seconds": seconds, "queue_ms": queue_ms, "exec_ms": exec_ms}
    print(json.dumps(doc))

asyncio.run(main())
"""


NONE = math.nan  # a quantile of no values: NaN, which no latency could be mistaken for


def start_load(
    url: str,
    body: tuple[Path, int],
    mode: str,
    concurrency: int,
    seconds: float,
    warmup_s: float,
    interval_ms: float = 0.0,
    headers: dict[str, str] | None = None,
    processes: int = 1,
) -> list[subprocess.Popen[bytes]]:
    """Start load-generator processes (closed loop: `concurrency` spread over `processes`; open loop:
    one arrival every `interval_ms` from each); their handles, for `collect_load`."""
    procs = []
    per = [concurrency // processes + (1 if i < concurrency % processes else 0) for i in range(processes)]
    for c in per:
        if c <= 0 and mode == "closed":
            continue
        args = [
            sys.executable,
            "-c",
            LOADGEN,
            url,
            str(body[0]),
            str(body[1]),
            mode,
            str(c),
            str(seconds),
            str(warmup_s),
            str(interval_ms),
            json.dumps(headers or {}),
        ]
        procs.append(subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    return procs


def collect_load(procs: list[subprocess.Popen[bytes]], timeout_s: float) -> dict[str, Any]:
    """Wait for the generators; their answers pooled: rate, p50, p99 of the 200s, statuses."""
    latencies: list[float] = []
    queue_ms: list[float] = []
    exec_ms: list[float] = []
    statuses: dict[str, int] = {}
    seconds = 0.0
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        try:
            doc = json.loads(out.decode().strip().splitlines()[-1])
        except (ValueError, IndexError):
            print(f"  load generator failed: {err.decode(errors='replace')[-500:]}", flush=True)
            continue
        latencies.extend(doc["latencies_ms"])
        queue_ms.extend(doc.get("queue_ms", []))
        exec_ms.extend(doc.get("exec_ms", []))
        for k, v in doc["statuses"].items():
            statuses[k] = statuses.get(k, 0) + v
        seconds = float(doc["seconds"])
    return {
        "answered_ok": len(latencies),
        "statuses": statuses,
        "rps": round(len(latencies) / seconds, 1) if seconds else 0.0,
        "p50_ms": round(nearest_rank(latencies, 0.5, empty=NONE), 3),
        "p99_ms": round(nearest_rank(latencies, 0.99, empty=NONE), 3),
        # what the node says of each answer: its queueing and its batch's execution (the rest of the
        # latency is HTTP, the event loops and the way there and back)
        "node_queue_p50_p99_ms": [
            round(nearest_rank(queue_ms, 0.5, empty=NONE), 3),
            round(nearest_rank(queue_ms, 0.99, empty=NONE), 3),
        ],
        "node_exec_p50_p99_ms": [
            round(nearest_rank(exec_ms, 0.5, empty=NONE), 3),
            round(nearest_rank(exec_ms, 0.99, empty=NONE), 3),
        ],
    }
