"""`edgeroute profile`: measure what the simulator needs on real nodes with the real zoo models.

Starts the embedded broker, one node serving every profiled model (one slot, speed 1) and a router,
then per model, closed loop at concurrency 1 so nothing queues:

- `exec_ms[batch]`: slot time of one execution at batch 1, 2, 4, 8 (the node's `x-edgeroute-exec-ms`);
- `overhead_ms`: client-measured latency through the router minus that request's execution time, i.e.
  everything that is not the model: HTTP both hops, parsing, validation, the policy, scheduling;
- `levels`: the same overhead, and execution times, under open-loop load at several request rates
  through two nodes, since every process shares this machine's cores;
- `telemetry_lag_ms`: send-to-receipt lag of telemetry through the broker, as a consumer sees it.
- `overhead_by_nodes` (`edgeroute profile --node-scaling`): the overhead at one rate on stacks of 2, 4
  and 6 nodes, since every node process shares the cores; the simulator shifts its overhead by the
  difference between the scenario's node count and the profile's 4.
- `handoff_ms`: the mean idle time of a slot between back-to-back executions on a busy node (the worker
  thread taking the next batch), which the simulator adds to each execution that follows another;
  `wakeup_ms`: the mean delay from an idle slot being given a batch to the run starting (a worker
  thread waking), which it adds to each execution that starts on an idle slot. Both are measured on
  the slow node and again at each load level (the level nearest the scenario's rate is used).

The profiler's nodes run every batch on a slot thread (`inline_max_ms: 0`): the emulated devices of
the scenarios always do (a run that holds its slot never runs on the event loop), and their
overhead, hand-off and wake-up are what the simulator models.

Each is stored as 101 quantiles (0, 1, ..., 100th percentile); the simulator samples them by inverse
CDF. Speed factors scale `exec_ms` for other device classes (a node with `speed: 0.1` takes 10x).
"""

from __future__ import annotations

import asyncio
import json
import platform
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
from pydantic import ValidationError

from scenarios.sim.profile import DEFAULT_PROFILE, ProfileDoc
from scenarios.spec.schema import NodeSpec, Scenario, Workload
from scenarios.spec.workload import Result
from scenarios.stack.launcher import Stack
from scenarios.stack.loadgen import Payload, build_schedule, example_payload, run_load
from scenarios.stack.procs import http_json
from telemetry.cluster.store import ViewStore
from telemetry.kafka.reader import KafkaTelemetrySource
from telemetry.measure.quantiles import grid_101
from telemetry.oip import wire
from telemetry.process.configfile import ConfigError, read_text

BATCHES = (1, 2, 4, 8)


def request_overhead_ms(r: Result, link_ms: float = 0.0) -> float:
    """What an answer cost beyond the node's execution and queue wait (and `link_ms` of link delay):
    HTTP on both hops, parsing, the router's decision."""
    return max(0.0, r.latency_ms - r.exec_ms - r.queue_ms - link_ms)


async def _measure(url: str, payload: Payload, n: int) -> list[tuple[float, float]]:
    """(latency ms, exec ms) for n sequential requests after a short warm-up."""
    headers = {"Content-Type": "application/json", wire.DEADLINE_MS: "10000"}
    if payload.header_length is not None:
        headers[wire.HEADER_LENGTH] = str(payload.header_length)
        headers["Content-Type"] = "application/octet-stream"
    out: list[tuple[float, float]] = []
    async with aiohttp.ClientSession() as session:
        for i in range(n + 10):
            t0 = time.perf_counter()
            async with session.post(url, data=payload.body, headers=headers) as resp:
                await resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"profiling {url}: {resp.status}")
                exec_ms = float(resp.headers.get(wire.EXEC_MS, "0"))
            if i >= 10:
                out.append(((time.perf_counter() - t0) * 1000.0, exec_ms))
    return out


LEVELS_RPS = (50.0, 100.0, 150.0, 200.0, 250.0, 300.0)
LEVEL_SECONDS = 12.0


def profile(
    models: list[str],
    requests: int,
    out: Path,
    kafka: str | None = None,
    levels: tuple[float, ...] = LEVELS_RPS,
    new_reference: bool = False,
) -> dict[str, Any]:
    """Measure and write the profile; see the module docstring.

    The idle execution times are also the reference the live nodes' speed emulation stretches (a node
    of `speed: 0.02` holds its slot 49 x the reference longer), so they define every scenario's
    emulated devices and offered load; a busier day measures them 10-20% slower. So unless
    `new_reference`, an existing profile at `out` keeps its models' execution times (and says since
    when: `reference_exec_at`), and its node-count rows; everything else is measured afresh."""
    scenario = Scenario.model_validate(
        {
            "name": "profile",
            "topology": {
                "partitions": ["lab"],
                "nodes": [
                    {
                        "id": f"profiler-{x}",
                        "partition": "lab",
                        "slots": 2,
                        "max_queue": 256,
                        "inline_max_ms": 0,
                        "models": models,
                    }
                    for x in "abcd"
                ],
            },
            "workload": {"sites": [{"site": "lab", "rate_rps": 1, "models": {m: 1 for m in models}}]},
            "router": {"default_deadline_ms": 10000},
            "policies": ["least_outstanding"],
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
        "levels": [],
    }
    with Stack(scenario, kafka=kafka) as stack:
        node_url = stack.nodes["profiler-a"].url
        payloads: dict[str, Payload] = {}
        for model in models:
            meta = asyncio.run(_metadata(stack.router_url, model))
            payloads[model] = base = example_payload(meta, 0)
            entry: dict[str, Any] = {"exec_ms": {}}
            for batch in BATCHES:
                payload = base if batch == 1 else example_payload(meta, 0, batch=batch)
                direct = asyncio.run(_measure(f"{node_url}/v2/models/{model}/infer", payload, requests // 2))
                entry["exec_ms"][str(batch)] = grid_101([e for _, e in direct])
            routed = asyncio.run(_measure(f"{stack.router_url}/v2/models/{model}/infer", base, requests))
            entry["overhead_ms"] = grid_101([max(0.0, lat - e) for lat, e in routed])
            entry["exec_ms"]["1"] = grid_101([e for _, e in routed])
            result["models"][model] = entry
            o = entry["overhead_ms"]
            print(
                f"  {model:<18} exec p50 {entry['exec_ms']['1'][50]:7.3f} ms"
                f"  p99 {entry['exec_ms']['1'][99]:7.3f}   overhead p50 {o[50]:6.3f} ms  p99 {o[99]:6.3f}",
                flush=True,
            )
        # Under load the machine's cores are shared by client, router, nodes and broker: measure the
        # overhead and execution times again at several open-loop rates (uniform model mix).
        for rate in levels:
            level = measure_level(stack, rate, models, payloads)
            result["levels"].append(level)
            over = level["overhead_ms"]
            print(
                f"  at {rate:5.0f} req/s: overhead p50 {over[50]:6.3f} ms  p99 {over[99]:6.3f}"
                f"  wake-up {level['wakeup_ms']:.3f} ms  handoff {level['handoff_ms']:.3f} ms"
                f"  ({level['completed']}/{level['sent']} ok)",
                flush=True,
            )
        if "mobilenet_s" in models:
            result["emulation_jitter_ms"] = _emulation_jitter(stack, result)
        # telemetry lag on an idle machine, as the router's consumer sees it (poll wait included)
        store = ViewStore()
        source = KafkaTelemetrySource(stack.bootstrap, stack.topic, lookback_ms=0)
        source.verifier = stack.verifier()
        source.start(store)
        try:
            time.sleep(4.0)
        finally:
            source.stop()
        result["telemetry_lag_ms"] = grid_101(list(store.lag_ms))
    if not new_reference and out.exists():
        kept = keep_reference(result, json.loads(out.read_text()))
        if kept:
            print(f"kept the reference execution times of {', '.join(kept)} from {result['reference_exec_at']}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"written: {out}")
    return result


def keep_reference(result: dict[str, Any], old: dict[str, Any]) -> list[str]:
    """Carry an older profile's reference execution times (models in both) and node-count rows into
    `result`; returns the models kept. See `profile`."""
    kept = [m for m in result["models"] if m in old.get("models", {})]
    for m in kept:
        result["models"][m]["exec_ms"] = old["models"][m]["exec_ms"]
    if kept:
        result["reference_exec_at"] = old.get("reference_exec_at", old.get("at"))
    for key in ("profile_nodes", "overhead_by_nodes"):
        if key in old:
            result[key] = old[key]
    return kept


NODE_COUNTS = (2, 4, 6)
PROFILE_NODES = 4  # the stack `profile` measures its levels on


def profile_node_scaling(
    out: Path, models: list[str], counts: tuple[int, ...] = NODE_COUNTS, rate: float = 150.0, kafka: str | None = None
) -> dict[str, Any]:
    """Add to an existing profile how the per-request overhead grows with the number of node processes
    sharing the machine: the same open-loop level at `rate` on stacks of `counts` nodes. The simulator
    shifts its overhead by the difference between the scenario's node count and the profile's (4),
    interpolated. Written into the profile without touching its other measurements."""
    doc = load_profile(out)
    rows = []
    for n in counts:
        scenario = Scenario.model_validate(
            {
                "name": "profile-nodes",
                "topology": {
                    "partitions": ["lab"],
                    "nodes": [
                        {
                            "id": f"profiler-{i}",
                            "partition": "lab",
                            "slots": 2,
                            "max_queue": 256,
                            "inline_max_ms": 0,
                            "models": models,
                        }  # fmt: skip
                        for i in range(n)
                    ],
                },
                "workload": {"sites": [{"site": "lab", "rate_rps": 1, "models": {m: 1 for m in models}}]},
                "router": {"default_deadline_ms": 10000},
                "policies": ["least_outstanding"],
            }
        )
        with Stack(scenario, kafka=kafka) as stack:
            payloads = {m: example_payload(asyncio.run(_metadata(stack.router_url, m)), 0) for m in models}
            measure_level(stack, rate, models, payloads)  # warm the path up first
            level = measure_level(stack, rate, models, payloads)
        rows.append({"nodes": n, "rate_rps": rate, "overhead_ms": level["overhead_ms"]})
        print(f"  {n} nodes at {rate:.0f} req/s: overhead p50 {level['overhead_ms'][50]:6.3f} ms", flush=True)
    doc["profile_nodes"] = PROFILE_NODES
    doc["overhead_by_nodes"] = rows
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"written: {out}")
    return doc


def _node_stats(stack: Stack, samples: bool = False) -> dict[str, dict[str, Any]]:
    """Every node's /admin/stats (with its latest wake-up times when `samples`)."""
    query = "?samples=1" if samples else ""
    return {n: http_json(f"{p.url}/admin/stats{query}", headers=stack.node_headers)[1] for n, p in stack.nodes.items()}


def _node_counters(stats: dict[str, dict[str, Any]]) -> tuple[float, int, float, int]:
    """Summed over the nodes: wake-up ms and count, handoff ms and count."""
    w_ms = h_ms = 0.0
    w_n = h_n = 0
    for st in stats.values():
        w_n += int(st.get("wakeups", 0))
        h_n += int(st.get("handoffs", 0))
        w_ms += float(st.get("wakeup_ms_mean", 0.0)) * int(st.get("wakeups", 0))
        h_ms += float(st.get("handoff_ms_mean", 0.0)) * int(st.get("handoffs", 0))
    return w_ms, w_n, h_ms, h_n


def _wakeup_samples(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]]) -> list[float]:
    """The nodes' slot wake-up times between two stats readings (`after` with samples), pooled."""
    samples: list[float] = []
    for n, st in after.items():
        new = int(st.get("wakeups", 0)) - int(before.get(n, {}).get("wakeups", 0))
        recent = st.get("wakeup_samples_ms") or []
        samples += recent[len(recent) - min(len(recent), new) :] if new > 0 else []
    return samples


def measure_level(
    stack: Stack,
    rate: float,
    models: list[str] | dict[str, float],
    payloads: dict[str, Payload],
    *,
    site: str = "lab",
    seconds: float = LEVEL_SECONDS,
    headers: dict[str, str] | None = None,
    real_exec: Callable[[Result], float] | None = None,
    key: Callable[[str], str] | None = None,
    results_out: list[Result] | None = None,
) -> dict[str, Any]:
    """Open-loop load at `rate` (`models`: a mix, or a list for a uniform one) through the router:
    overhead (pooled and per model), execution, and the nodes' slot wake-up (mean and distribution)
    and handoff times, all as the loaded machine has them. `site` must be one the router knows (the
    profiler's own stack is all in partition "lab"). `real_exec` takes a slow node's emulated
    stretch out of an execution time (scenarios.calibrate.host); `key` names each model as the profile does
    (its zoo architecture), pooling models that share one; `results_out` receives every answer."""
    mix = models if isinstance(models, dict) else {m: 1.0 for m in models}
    workload = Workload.model_validate(
        {"duration_s": seconds, "sites": [{"site": site, "rate_rps": rate, "models": mix}]}
    )
    stats_before = _node_stats(stack)
    results = asyncio.run(run_load(stack.router_url, build_schedule(workload, int(rate)), payloads, headers=headers))
    stats_after = _node_stats(stack, samples=True)
    before, after = _node_counters(stats_before), _node_counters(stats_after)
    samples = _wakeup_samples(stats_before, stats_after)
    if results_out is not None:
        results_out.extend(results)
    ok = [r for r in results if r.status == 200]
    wakeups, handoffs = after[1] - before[1], after[3] - before[3]

    def overhead(rs: list[Any]) -> list[float]:
        return grid_101([request_overhead_ms(r) for r in rs])

    name = key or (lambda m: m)
    execution = real_exec or (lambda r: r.exec_ms)
    by_model: dict[str, list[Result]] = {}
    for m in mix:
        by_model.setdefault(name(m), []).extend(r for r in ok if r.arrival.model == m)
    return {
        "rate_rps": rate,
        "overhead_ms": overhead(ok),
        "overhead_ms_by_model": {m: overhead(rs) for m, rs in by_model.items() if len(rs) >= 20},
        "exec_ms": {m: grid_101([execution(r) for r in rs]) for m, rs in by_model.items() if rs},
        "wakeup_ms": round((after[0] - before[0]) / wakeups, 4) if wakeups else 0.0,
        "wakeup_ms_q": grid_101(samples) if len(samples) >= 20 else None,
        "handoff_ms": round((after[2] - before[2]) / handoffs, 4) if handoffs else 0.0,
        "completed": len(ok),
        "sent": len(results),
    }


def _emulation_jitter(stack: Stack, result: dict[str, Any], speed: float = 0.02) -> list[float]:
    """How much longer than asked a speed-emulated slot really is, on a node near 80% busy.

    The node holds its slot until `reference / speed` after the run began by sleeping; under load the
    sleeping thread wakes late by a little, which near saturation matters. Measured as slot time minus
    that target, on MobileNet, straight to the node.
    """
    model = "mobilenet_s"
    spec = NodeSpec(id="profiler-slow", partition="lab", slots=1, speed=speed, max_queue=512, models=[model])
    stack.node_specs[spec.id] = spec
    stack.start_node(spec)
    stack.wait_ready(60)
    reference = stack.baselines.get(model, {}).get(1, float(result["models"][model]["exec_ms"]["1"][50]))
    target = reference / speed
    rate = 0.8 * 1000.0 / target
    workload = Workload.model_validate(
        {"duration_s": LEVEL_SECONDS, "sites": [{"site": "lab", "rate_rps": rate, "models": {model: 1}}]}
    )
    payloads = {model: example_payload(asyncio.run(_metadata(stack.router_url, model)), 0)}
    results = asyncio.run(run_load(stack.nodes[spec.id].url, build_schedule(workload, 7), payloads))
    jitter = [r.exec_ms - target for r in results if r.status == 200]
    q = grid_101(jitter)
    print(f"  emulation jitter at {rate:.0f} req/s on one slow node: p50 {q[50]:6.3f} ms  p99 {q[99]:6.3f}", flush=True)
    stats = http_json(f"{stack.nodes[spec.id].url}/admin/stats", headers=stack.node_headers)[1]
    result["handoff_ms"] = float(stats.get("handoff_ms_mean", 0.0))
    result["wakeup_ms"] = float(stats.get("wakeup_ms_mean", 0.0))
    print(
        f"  slot handoff between back-to-back executions: {result['handoff_ms']:.3f} ms; "
        f"an idle slot's wake-up: {result['wakeup_ms']:.3f} ms",
        flush=True,
    )
    return q


async def _metadata(router_url: str, model: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session, session.get(f"{router_url}/v2/models/{model}") as resp:
        doc: dict[str, Any] = await resp.json()
        return doc


def load_profile(path: Path | None = None) -> dict[str, Any]:
    """A profile JSON, read within the config files' size bound and checked against `ProfileDoc`
    (ConfigError naming the file and the field otherwise)."""
    where = path or DEFAULT_PROFILE
    text = read_text(where, str(where))

    def no_constant(name: str) -> Any:
        raise ValueError(f"{name} is not a number a profile holds")

    try:
        doc = json.loads(text, parse_constant=no_constant)
    except ValueError as exc:
        raise ConfigError(f"{where}: not a profile (invalid JSON: {exc})") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{where}: not a profile (a JSON object is)")
    try:
        ProfileDoc.model_validate(doc)
    except ValidationError as exc:
        first = exc.errors()[0]
        at = ".".join(str(x) for x in first.get("loc", ())) or "profile"
        raise ConfigError(f"{where}: {at}: {first.get('msg', 'invalid')}") from None
    return doc
