"""Open-loop load: a seeded arrival schedule, sent on time whatever the answers, every answer recorded.

Open loop matters: a closed-loop client slows down when the system does and hides the tail. Arrivals
are generated up front from the scenario and its seed (the same schedule for every policy compared),
bounded by `duration_s` and `max_requests`. Each request carries its routing hints in headers, so the
body per model is encoded once. A request with no HTTP answer within its deadline plus a grace period
is `lost`; the router's contract is that this never happens.
"""

from __future__ import annotations

import asyncio
import csv
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from scenarios.schema import ScenarioError, SiteLoad, Workload
from telemetry import wire


@dataclass(frozen=True, slots=True)
class Arrival:
    at_s: float
    site: str
    model: str
    priority: int
    deadline_ms: float


@dataclass(slots=True)
class Result:
    arrival: Arrival
    status: int | None  # None: no answer at all (lost)
    latency_ms: float
    node: str
    error: str = ""
    exec_ms: float = 0.0  # the node's slot time for it (x-edgeroute-exec-ms), 0 if not served
    queue_ms: float = 0.0  # its wait for a slot at the node (x-edgeroute-queue-ms)
    rows: int = 1  # rows of the batch it ran in (x-edgeroute-batch-rows): its share of the exec time
    stages: int = 1  # executions it took (a workflow's stages run; x-edgeroute-stages)
    cold: int = 0  # of those, how many waited for their model to load (x-edgeroute-cold-ms / -cold-stages)
    bytes_kept: int = 0  # a workflow's intermediate bytes used on the node that made them
    bytes_moved: int = 0  # ... and those a stage on another node needed


def _homogeneous(rng: random.Random, rate: float, start: float, stop: float) -> list[float]:
    out: list[float] = []
    if rate <= 0:
        return out
    t = start
    while True:
        t += rng.expovariate(rate)
        if t >= stop:
            return out
        out.append(t)


def arrival_times(site: SiteLoad, horizon_s: float, rng: random.Random) -> list[float]:
    """Arrival instants of one site's process within [start_s, min(stop_s, horizon))."""
    start = site.start_s
    stop = min(horizon_s, site.stop_s if site.stop_s is not None else horizon_s)
    if stop <= start:
        return []
    if site.arrival == "poisson":
        return _homogeneous(rng, site.rate_rps, start, stop)
    if site.arrival == "bursty":
        out: list[float] = []
        t, on = start, True
        while t < stop:
            length = site.on_s if on else site.off_s
            out += _homogeneous(rng, site.rate_rps if on else site.off_rate_rps, t, min(stop, t + length))
            t, on = t + length, not on
        return out
    if site.arrival == "diurnal":
        # thinning (Lewis-Shedler): candidates at the peak rate, kept with probability rate(t) / peak
        peak, low = site.rate_rps, site.min_rate_rps
        keep: list[float] = []
        for t in _homogeneous(rng, peak, start, stop):
            rate = low + (peak - low) * (1 - math.cos(2 * math.pi * (t - start) / site.period_s)) / 2
            if rng.random() * peak < rate:
                keep.append(t)
        return keep
    raise ValueError(f"arrival {site.arrival!r} has no generated times")


def read_trace(path: Path, site: SiteLoad, default_deadline_ms: float, horizon_s: float) -> list[Arrival]:
    """Rows `at_s,model,priority,deadline_ms` (header optional; priority and deadline may be blank)."""
    out: list[Arrival] = []
    with path.open(newline="") as fh:
        for lineno, row in enumerate(csv.reader(fh), 1):
            if not row or row[0].strip().startswith("#") or (lineno == 1 and row[0].strip() == "at_s"):
                continue
            try:
                at = float(row[0])
                model = row[1].strip()
                prio = int(row[2]) if len(row) > 2 and row[2].strip() else 0
                deadline = (
                    float(row[3])
                    if len(row) > 3 and row[3].strip()
                    else site.deadline_ms.get(prio, default_deadline_ms)
                )
            except (ValueError, IndexError):
                raise ScenarioError(f"{path}:{lineno}: expected at_s,model,priority,deadline_ms") from None
            if site.start_s <= at < min(horizon_s, site.stop_s or horizon_s):
                out.append(Arrival(at, site.site, model, prio, deadline))
    return out


def build_schedule(
    workload: Workload, seed: int, duration_s: float | None = None, base_dir: Path | None = None
) -> list[Arrival]:
    """Every arrival of the run, time-ordered; models and priorities drawn from each site's mix."""
    rng = random.Random(seed)
    horizon = duration_s if duration_s is not None else workload.duration_s
    out: list[Arrival] = []
    for site in workload.sites:
        if site.arrival == "trace":
            assert site.trace is not None
            path = Path(site.trace)
            out += read_trace(
                path if path.is_absolute() else (base_dir or Path.cwd()) / path,
                site,
                workload.default_deadline_ms,
                horizon,
            )
            continue
        models, model_w = list(site.models), list(site.models.values())
        prios, prio_w = list(site.priorities), list(site.priorities.values())
        for t in arrival_times(site, horizon, rng):
            prio = rng.choices(prios, prio_w)[0]
            deadline = site.deadline_ms.get(prio, workload.default_deadline_ms)
            out.append(Arrival(t, site.site, rng.choices(models, model_w)[0], prio, deadline))
    out.sort(key=lambda a: (a.at_s, a.site))
    return out[: workload.max_requests]


@dataclass(frozen=True)
class Payload:
    """A ready-to-send request body; `header_length` set when it uses binary tensor data."""

    body: bytes
    header_length: int | None = None


def example_payload(metadata: dict[str, Any], seed: int, binary_over: int = 1024, batch: int = 1) -> Payload:
    """An OIP request for a model from its metadata, `batch` rows, seeded random data.

    Inputs with more than `binary_over` elements travel as binary tensor data (as a camera client
    would send a frame), smaller ones as JSON.
    """
    import json

    rng = np.random.default_rng(seed)
    inputs = []
    blobs: list[bytes] = []
    for spec in metadata["inputs"]:
        shape = [batch if d < 0 else d for d in spec["shape"]]
        dtype = wire.DATATYPES[spec["datatype"]]
        data = rng.random(shape).astype(dtype) if dtype.kind == "f" else rng.integers(0, 2, shape).astype(dtype)
        entry: dict[str, Any] = {"name": spec["name"], "shape": shape, "datatype": spec["datatype"]}
        if data.size > binary_over:
            blob = np.ascontiguousarray(data).astype(dtype.newbyteorder("<")).tobytes()
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            entry["data"] = data.reshape(-1).tolist()
        inputs.append(entry)
    head = json.dumps({"inputs": inputs}, separators=(",", ":")).encode()
    if not blobs:
        return Payload(head)
    return Payload(head + b"".join(blobs), len(head))


def _error_text(body: bytes) -> str:
    import json

    try:
        doc = json.loads(body)
        return str(doc["error"]) if isinstance(doc, dict) and "error" in doc else body[:200].decode()
    except (ValueError, UnicodeDecodeError):
        return body[:200].decode(errors="replace")


async def fetch_payloads(
    router_url: str, models: set[str], seed: int, headers: dict[str, str] | None = None
) -> dict[str, Payload]:
    out: dict[str, Payload] = {}
    async with aiohttp.ClientSession(headers=headers) as session:
        for model in sorted(models):
            async with session.get(f"{router_url}/v2/models/{model}") as resp:
                if resp.status != 200:
                    raise RuntimeError(f"metadata of {model}: {resp.status} {await resp.text()}")
                out[model] = example_payload(await resp.json(), seed)
    return out


async def run_load(
    router_url: str,
    schedule: list[Arrival],
    payloads: dict[str, Payload],
    grace_s: float = 5.0,
    progress: Any = None,
    headers: dict[str, str] | None = None,
) -> list[Result]:
    """Send `schedule` open-loop; one Result per arrival, in schedule order."""
    results: list[Result | None] = [None] * len(schedule)
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30)
    async with aiohttp.ClientSession(connector=connector, headers=headers) as session:

        async def send(i: int, a: Arrival) -> None:
            headers = {
                "Content-Type": "application/json",
                wire.PRIORITY: str(a.priority),
                wire.DEADLINE_MS: f"{a.deadline_ms:g}",
                wire.SITE: a.site,
            }
            payload = payloads[a.model]
            if payload.header_length is not None:
                headers[wire.HEADER_LENGTH] = str(payload.header_length)
                headers["Content-Type"] = "application/octet-stream"
            t0 = time.perf_counter()
            try:
                timeout = aiohttp.ClientTimeout(total=a.deadline_ms / 1000.0 + grace_s)
                async with session.post(
                    f"{router_url}/v2/models/{a.model}/infer",
                    data=payload.body,
                    headers=headers,
                    timeout=timeout,
                ) as resp:
                    answer = await resp.read()
                    err = "" if resp.status == 200 else _error_text(answer)
                    results[i] = Result(
                        a,
                        resp.status,
                        (time.perf_counter() - t0) * 1000.0,
                        resp.headers.get(wire.NODE, "none"),
                        err,
                        float(resp.headers.get(wire.EXEC_MS, 0.0)),
                        float(resp.headers.get(wire.QUEUE_MS, 0.0)),
                        max(1, int(resp.headers.get(wire.BATCH_ROWS, 1))),
                        int(resp.headers.get(wire.STAGES, 1)),
                        int(resp.headers.get(wire.COLD_STAGES, wire.COLD_MS in resp.headers)),
                        int(resp.headers.get(wire.BYTES_KEPT, 0)),
                        int(resp.headers.get(wire.BYTES_MOVED, 0)),
                    )
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                results[i] = Result(
                    a, None, (time.perf_counter() - t0) * 1000.0, "none", f"{type(exc).__name__}: {exc}"
                )

        loop = asyncio.get_running_loop()
        start = loop.time()
        tasks: list[asyncio.Task[None]] = []
        for i, a in enumerate(schedule):
            delay = start + a.at_s - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send(i, a)))
            if progress is not None:
                progress(i + 1, len(schedule))
        await asyncio.gather(*tasks)
    return [r for r in results if r is not None]
