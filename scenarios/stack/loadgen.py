"""Open-loop load: a seeded arrival schedule, sent on time whatever the answers, every answer recorded.

Open loop matters: a closed-loop client slows down when the system does and hides the tail. Arrivals
are generated up front from the scenario and its seed (the same schedule for every policy compared),
bounded by `duration_s` and `max_requests`. Each request carries its routing hints in headers, so the
body per model is encoded once. A request with no HTTP answer within its deadline plus a grace period
is `lost`; the router's contract is that this never happens.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import numpy as np

from scenarios.spec.workload import Arrival, Result, build_schedule

__all__ = ["Arrival", "Payload", "Result", "build_schedule", "example_payload", "fetch_payloads", "run_load"]
from telemetry.oip import wire
from telemetry.process.serving import tuned_gc


@dataclass(frozen=True)
class Payload:
    """A ready-to-send request body; `header_length` set when it uses binary tensor data."""

    body: bytes
    header_length: int | None = None


CASCADE_VARIANTS = 32  # payloads sent to a cascade in turn (request i: payload i mod 32), so answers differ


def example_arrays(metadata: dict[str, Any], seed: int, batch: int = 1) -> dict[str, np.ndarray]:
    """The seeded random tensors of `example_payload` (what a model is sent), by input name."""
    rng = np.random.default_rng(seed)
    out = {}
    for spec in metadata["inputs"]:
        shape = [batch if d < 0 else d for d in spec["shape"]]
        dtype = wire.DATATYPES[spec["datatype"]]
        out[spec["name"]] = (
            rng.random(shape).astype(dtype) if dtype.kind == "f" else rng.integers(0, 2, shape).astype(dtype)
        )
    return out


def example_payload(metadata: dict[str, Any], seed: int, binary_over: int = 1024, batch: int = 1) -> Payload:
    """An OIP request for a model from its metadata, `batch` rows, seeded random data.

    Inputs with more than `binary_over` elements travel as binary tensor data (as a camera client
    would send a frame), smaller ones as JSON.
    """
    import json

    arrays = example_arrays(metadata, seed, batch)
    inputs = []
    blobs: list[bytes] = []
    for spec in metadata["inputs"]:
        data = arrays[spec["name"]]
        dtype = data.dtype
        shape = list(data.shape)
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


# What is sent for a model the router does not know (a trace may name one): a well-formed request with
# one small tensor, so that the router answers what it answers for the model (404), as the simulator
# answers such a request, and not the body's form.
UNKNOWN_MODEL_PAYLOAD = Payload(b'{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[0.0]}]}')


async def fetch_payloads(
    router_url: str,
    models: set[str],
    seed: int,
    headers: dict[str, str] | None = None,
    unknown: Payload | None = None,
    variants: frozenset[str] = frozenset(),
) -> dict[str, Payload | list[Payload]]:
    """A request body per model, built from the router's metadata of it; for the models in `variants`
    (cascades) CASCADE_VARIANTS of them, seeds `seed`, `seed + 1`..., sent in turn. A model the router
    answers 404 for gets `unknown` where one is given (its requests are sent and answered 404, as the
    simulator answers them); otherwise, and for any other failure, RuntimeError."""
    out: dict[str, Payload | list[Payload]] = {}
    async with aiohttp.ClientSession(headers=headers) as session:
        for model in sorted(models):
            async with session.get(f"{router_url}/v2/models/{model}") as resp:
                if resp.status == 404 and unknown is not None:
                    out[model] = unknown
                    continue
                if resp.status != 200:
                    raise RuntimeError(f"metadata of {model}: {resp.status} {await resp.text()}")
                meta = await resp.json()
                if model in variants:
                    out[model] = [example_payload(meta, seed + k) for k in range(CASCADE_VARIANTS)]
                else:
                    out[model] = example_payload(meta, seed)
    return out


async def run_load(
    router_url: str | Mapping[str, str],
    schedule: list[Arrival],
    payloads: Mapping[str, Payload | list[Payload]],
    grace_s: float = 5.0,
    progress: Any = None,
    headers: dict[str, str] | None = None,
    lags_ms: list[float] | None = None,
    tenant_header: str = wire.TENANT,
) -> list[Result]:
    """Send `schedule` open-loop; one Result per arrival, in schedule order. `router_url` is one router,
    or each site's own (an arrival goes to its site's router). `lags_ms` gets how late each request left
    against its schedule (the load generator's own lag: scenarios.replay.trust). An arrival of a tenant
    names it in `tenant_header` (the router's `tenants.header`).

    The client runs with a server's garbage collector setting (telemetry.process.serving.tuned_gc): what it
    keeps grows with every request sent (results, tasks), and with Python's default setting a full
    collection of all of it in the middle of mixed-priority's 40 s stopped the client for about
    60 ms, added to the latency of every request in flight then (none during the load since)."""
    results: list[Result | None] = [None] * len(schedule)
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30)
    with tuned_gc():
        async with aiohttp.ClientSession(connector=connector, headers=headers) as session:
            await _send_all(session, router_url, schedule, payloads, results, grace_s, progress, lags_ms, tenant_header)
    return [r for r in results if r is not None]


async def _send_all(
    session: aiohttp.ClientSession,
    router_url: str | Mapping[str, str],
    schedule: list[Arrival],
    payloads: Mapping[str, Payload | list[Payload]],
    results: list[Result | None],
    grace_s: float,
    progress: Any,
    lags_ms: list[float] | None = None,
    tenant_header: str = wire.TENANT,
) -> None:
    """Each arrival's request at its time (as a task), its answer into `results[i]`."""

    async def send(i: int, a: Arrival) -> None:
        headers = {
            "Content-Type": "application/json",
            wire.PRIORITY: str(a.priority),
            wire.DEADLINE_MS: f"{a.deadline_ms:g}",
            wire.SITE: a.site,
        }
        if a.tenant:
            headers[tenant_header] = a.tenant
        chosen = payloads[a.model]
        payload = chosen[i % len(chosen)] if isinstance(chosen, list) else chosen
        if payload.header_length is not None:
            headers[wire.HEADER_LENGTH] = str(payload.header_length)
            headers["Content-Type"] = "application/octet-stream"
        t0 = time.perf_counter()
        try:
            timeout = aiohttp.ClientTimeout(total=a.deadline_ms / 1000.0 + grace_s)
            base = router_url if isinstance(router_url, str) else router_url[a.site]
            async with session.post(
                f"{base}/v2/models/{a.model}/infer",
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
                    resp.headers.get(wire.CASCADE, ""),
                    wire.stage_starts(resp.headers.get(wire.STAGE_STARTS)),
                    wire.job_ms(resp.headers.get(wire.JOB_MS)),
                )
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            results[i] = Result(a, None, (time.perf_counter() - t0) * 1000.0, "none", f"{type(exc).__name__}: {exc}")

    loop = asyncio.get_running_loop()
    start = loop.time()
    tasks: list[asyncio.Task[None]] = []
    for i, a in enumerate(schedule):
        delay = start + a.at_s - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        if lags_ms is not None:
            lags_ms.append((loop.time() - start - a.at_s) * 1000.0)
        tasks.append(asyncio.create_task(send(i, a)))
        if progress is not None:
            progress(i + 1, len(schedule))
    await asyncio.gather(*tasks)
