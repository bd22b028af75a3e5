"""`edgeroute bench router`: the latency the router adds and the request rate it sustains against the
floor, on the trivial `echo` model, closed loop at each concurrency: a bare aiohttp echo server and a
bare aiohttp pass-through proxy (`FLOOR`, part of the benchmark, not of the product), the node called
directly, the proxy in front of it and the router in front of it, in interleaved rounds, with the CPU
each server spent per request; then the node and the router again with the same tensor in binary
form, over HTTP (Triton's binary tensor extension) and over gRPC (raw contents), the two front doors
side by side (the gRPC load comes from grpc.aio, the HTTP load from aiohttp, both in this process).
Everything (broker, node, router, this load generator) shares the machine, so the figures are ratios
for comparing builds on one host, not absolute capacity. A benchmark: it prints and writes JSON, and
asserts nothing.
"""

from __future__ import annotations

import asyncio
import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from scenarios.bench.common import interleaved, process_cpu_s, result, save
from scenarios.spec.schema import Scenario
from scenarios.stack.broker import free_port, terminate, wait_for_port
from scenarios.stack.launcher import Stack
from telemetry.kafka.signing import SIGN_ENV, VERIFY_ENV
from telemetry.measure.quantiles import nearest_rank

BODY = json.dumps(
    {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1.0, 2.0, 3.0, 4.0]}]}
).encode()


# the same tensor in binary form: Triton's binary tensor data over HTTP, raw_input_contents over gRPC
_RAW = struct.pack("<4f", 1.0, 2.0, 3.0, 4.0)
_HEAD = json.dumps(
    {
        "inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "parameters": {"binary_data_size": 16}}],
        "parameters": {"binary_data_output": True},
    }
).encode()
BINARY = (
    _HEAD + _RAW,
    {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(len(_HEAD))},
)


def grpc_request() -> bytes:
    from telemetry.oip.triton import pb

    req = pb.ModelInferRequest(model_name="echo")
    req.inputs.add(name="x", datatype="FP32", shape=[1, 4])
    req.raw_input_contents.append(_RAW)
    return req.SerializeToString()  # type: ignore[no-any-return]


async def closed_loop(url: str, concurrency: int, requests: int, warmup: int, form: str = "json") -> dict[str, Any]:
    """`form`: "json" (JSON tensor data), "binary" (the binary tensor extension) or "grpc" (`url` is then
    HOST:PORT of a gRPC service, raw contents; the request is serialised once, as a client would)."""
    connector = aiohttp.TCPConnector(limit=concurrency)
    latencies: list[float] = []
    failures = 0
    body, headers = BINARY if form == "binary" else (BODY, {"Content-Type": "application/json"})
    channel = None
    if form == "grpc":
        import grpc

        channel = grpc.aio.insecure_channel(url)
        infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        message = grpc_request()
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one(record: bool) -> None:
            nonlocal failures
            t0 = time.perf_counter()
            if channel is not None:
                try:
                    await infer(message, timeout=30)
                    ok = True
                except grpc.RpcError:
                    ok = False
            else:
                async with session.post(url, data=body, headers=headers) as resp:
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
    if channel is not None:
        await channel.close()
    latencies.sort()
    return {
        "concurrency": concurrency,
        "requests": per * concurrency,
        "failures": failures,
        "p50_ms": round(nearest_rank(latencies, 0.5, presorted=True), 3),
        "p99_ms": round(nearest_rank(latencies, 0.99, presorted=True), 3),
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


def _floor_process(mode: str, upstream: str = "") -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    args = [sys.executable, "-c", FLOOR, mode, str(port), *([upstream] if upstream else [])]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    wait_for_port("127.0.0.1", port, 30, proc)
    return proc, f"http://127.0.0.1:{port}"


def _baseline_router(
    stack: Stack, checkout: Path, overrides: dict[str, Any] | None = None, name: str = "baseline"
) -> tuple[subprocess.Popen[bytes], str]:
    """The router of another checkout of edgeroute (`checkout`: its top folder), run from there with
    this stack's router settings (and `overrides`) on ports of its own, reading the same telemetry:
    (process, URL)."""
    assert stack.router_config_path is not None and stack.router is not None
    cfg = yaml.safe_load(stack.router_config_path.read_text())
    port = stack.free_port()
    cfg.update(port=port, grpc_port=stack.free_port(), **(overrides or {}))
    path = stack.log_dir / f"router-{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {k: v for k, v in os.environ.items() if not k.startswith("EDGEROUTE_")}
    env.update({SIGN_ENV: stack.telemetry_key, VERIFY_ENV: stack.telemetry_key, "PYTHONPATH": str(checkout)})
    log = open(stack.log_dir / f"router-{name}.log", "ab")  # noqa: SIM115 - the child owns it
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "router", "--config", str(path), "--log-level", "WARNING"],
            cwd=checkout,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    finally:
        log.close()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:  # until it routes (its view holds the node)
        if proc.poll() is not None:
            raise RuntimeError(f"the baseline router exited with {proc.returncode}; see {stack.log_dir}")
        try:
            wait_for_port("127.0.0.1", port, 1.0, proc)
            got = asyncio.run(closed_loop(url + "/v2/models/echo/infer", 1, 1, 0))
            if not got["failures"]:
                return proc, url
        except (OSError, TimeoutError):
            pass
        if time.monotonic() > deadline:
            terminate(proc)
            raise RuntimeError(f"the baseline router did not route within 60 s; see {stack.log_dir}")
        time.sleep(0.5)


class _NullReceiver:
    """An OTLP trace receiver (the collector's gRPC service) that answers and keeps nothing."""

    def __init__(self) -> None:
        from concurrent import futures

        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 - the service's name
                return trace_service_pb2.ExportTraceServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self.server)  # type: ignore[no-untyped-call]
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def stop(self) -> None:
        self.server.stop(0)


def _null_receiver() -> _NullReceiver:
    return _NullReceiver()


# a router's tenants for `bench_router(tenants=True)`: three tenants, the requests (no tenant named)
# the default's, under quotas of every kind too high to refuse any of them
BENCH_TENANTS = {
    "default": "public",
    "named": {
        "public": {"quota": {"rps": 1_000_000, "in_flight": 100_000, "gpu_s_per_s": 100_000}},
        "acme": {"weight": 2},
        "beta": {},
    },
}


def bench_router(
    out_dir: Path,
    requests: int = 2000,
    concurrencies: tuple[int, ...] = (1, 32),
    kafka: str | None = None,
    rounds: int = 3,
    baseline: Path | None = None,
    tracing: tuple[float, ...] = (),
    capture: bool = False,
    tenants: bool = False,
) -> dict[str, Any]:
    """The router against the floor, in one run on one machine: a bare aiohttp echo server, the
    edgeroute node (echo model) called directly, a bare aiohttp proxy in front of that node, and the
    router in front of it; at each concurrency, rounds interleaved (the median of each is reported),
    with the CPU each server process spent per request. With `baseline` (another checkout of
    edgeroute), that checkout's router runs beside this one in front of the same node, in the same
    interleaved rounds: the comparison of two builds in one harness. With `tracing` (sampling ratios),
    a router of this checkout per ratio with tracing on, exporting over OTLP to a receiver in this
    process that keeps nothing: the router's cost of its spans, beside the same router without. With
    `capture`, the same two routers of this checkout beside each other, capture off and on (every
    request recorded to disk): capture's cost, and its bytes per request. With `tenants`, a router of
    this checkout with tenants on (its requests the default tenant's, under quotas of every kind set
    too high to refuse, so every check runs) beside the plain one: the tenants' cost per request."""
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
    closers: list[Any] = []
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
                "bare_echo": (echo_url + path, echo_proc.pid, "json"),
                "node": (node.url + path, node.popen.pid, "json"),
                "bare_proxy": (proxy_url + path, proxy_proc.pid, "json"),
                "router": (stack.router_url + path, stack.router.popen.pid, "json"),
                # the same tensor in binary form, over HTTP and over gRPC (the router's two front doors)
                "node_binary": (node.url + path, node.popen.pid, "binary"),
                "node_grpc": (node.grpc, node.popen.pid, "grpc"),
                "router_binary": (stack.router_url + path, stack.router.popen.pid, "binary"),
                "router_grpc": (stack.router.grpc, stack.router.popen.pid, "grpc"),
            }
            if baseline is not None:
                base_proc, base_url = _baseline_router(stack, baseline)
                floors.append(base_proc)
                targets["router_baseline"] = (base_url + path, base_proc.pid, "json")
            if tracing:
                receiver = _null_receiver()
                closers.append(receiver)
                for ratio in tracing:
                    traced = {"tracing": {"endpoint": f"http://127.0.0.1:{receiver.port}", "sample": ratio}}
                    here = Path(__file__).resolve().parents[2]
                    proc, traced_url = _baseline_router(stack, here, traced, f"traced-{ratio:g}")
                    floors.append(proc)
                    targets[f"router_traced_{ratio:g}"] = (traced_url + path, proc.pid, "json")
            capture_dir = stack.log_dir / "capture"
            variants: list[tuple[str, dict[str, Any]]] = [
                *([("captured", {"capture": {"enabled": True, "dir": str(capture_dir)}})] if capture else []),
                *([("tenanted", {"tenants": BENCH_TENANTS})] if tenants else []),
            ]
            if variants:  # (all started alike, so only the variant's setting tells them apart)
                here = Path(__file__).resolve().parents[2]
                for name, overrides in [("plain", {}), *variants]:
                    proc, url = _baseline_router(stack, here, overrides, name)
                    floors.append(proc)
                    targets[f"router_{name}"] = (url + path, proc.pid, "json")
            for c in concurrencies:

                def run(target: str, rnd: int, c: int = c) -> dict[str, Any]:
                    url, pid, form = targets[target]
                    before = process_cpu_s(pid)
                    row = asyncio.run(closed_loop(url, c, requests, min(200, requests // 5), form))
                    after = process_cpu_s(pid)
                    row.update(target=target, round=rnd)
                    if before is not None and after is not None and row["requests"]:
                        row["server_cpu_us_per_request"] = round((after - before) * 1e6 / row["requests"], 1)
                    print(
                        f"  {target:<13} c={c:<3} round {rnd}  p50 {row['p50_ms']:7.3f} ms  "
                        f"p99 {row['p99_ms']:7.3f} ms  {row['rps']:8.1f} req/s  "
                        f"cpu {row.get('server_cpu_us_per_request', '-')} us/req  ({row['failures']} failed)",
                        flush=True,
                    )
                    return row

                for runs in interleaved(rounds, list(targets), run).values():
                    rows.extend(runs)
        finally:
            for proc in floors:
                terminate(proc)
            for closer in closers:
                closer.stop()
        # on disk, gzip'd: every record the captured router wrote (read before the stack's folder goes)
        written = sum(p.stat().st_size for p in capture_dir.glob("*.jsonl.gz")) if capture_dir.is_dir() else 0
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
                "router_grpc_vs_binary_rps": round(fig["router_grpc"]["rps"] / fig["router_binary"]["rps"], 3),
                "node_grpc_vs_binary_rps": round(fig["node_grpc"]["rps"] / fig["node_binary"]["rps"], 3),
            }
        )
        for ratio in tracing:
            t = fig[f"router_traced_{ratio:g}"]
            summary[-1][f"traced_{ratio:g}"] = {
                "added_p50_ms": round(t["p50_ms"] - fig["node"]["p50_ms"], 3),
                "rps_vs_untraced": round(t["rps"] / fig["router"]["rps"], 3),
                "cpu_vs_untraced": round(
                    t["server_cpu_us_per_request"] / fig["router"]["server_cpu_us_per_request"], 3
                ),
            }
        for name in [n for n, on in (("captured", capture), ("tenanted", tenants)) if on]:
            plain, varied = fig["router_plain"], fig[f"router_{name}"]
            summary[-1][name] = {
                "rps_vs_plain": round(varied["rps"] / plain["rps"], 3),
                "cpu_vs_plain": round(varied["server_cpu_us_per_request"] / plain["server_cpu_us_per_request"], 3),
            }
        if baseline is not None:
            base_added = fig["router_baseline"]["p50_ms"] - fig["node"]["p50_ms"]
            summary[-1].update(
                baseline_added_p50_ms=round(base_added, 3),
                router_vs_baseline_added_p50=round(router_added / base_added, 2) if base_added > 0 else None,
                router_vs_baseline_rps=round(fig["router"]["rps"] / fig["router_baseline"]["rps"], 3),
                router_vs_baseline_cpu=round(
                    fig["router"]["server_cpu_us_per_request"] / fig["router_baseline"]["server_cpu_us_per_request"], 3
                ),
            )
    capture_bytes = None
    if capture:  # over the requests it served
        served = sum(r["requests"] for r in rows if r["target"] == "router_captured")
        capture_bytes = round(written / served, 1) if served else None
    doc = result(
        "router",
        capture_bytes_per_request=capture_bytes,
        model="echo",
        requests_per_run=requests,
        rounds=rounds,
        baseline=None if baseline is None else str(baseline),
        runs=rows,
        summary=summary,
    )
    lines = [f"{'c':>3} {'target':<13} {'p50 ms':>8} {'p99 ms':>8} {'req/s':>8} {'cpu us/req':>10}"]
    for srow in summary:
        for t, f in srow["targets"].items():
            lines.append(
                f"{srow['concurrency']:>3} {t:<13} {f['p50_ms']:>8.3f} {f['p99_ms']:>8.3f} {f['rps']:>8.1f} "
                f"{f['server_cpu_us_per_request']:>10.1f}"
            )
        lines.append(
            f"    router adds {srow['router_added_p50_ms']:.3f} ms p50 ({srow['router_vs_proxy_added_p50']}x the bare "
            f"proxy's {srow['proxy_added_p50_ms']:.3f} ms); router/proxy req/s {srow['router_vs_proxy_rps']}; "
            f"node/bare echo req/s {srow['node_vs_bare_echo_rps']}; gRPC/HTTP binary req/s: router "
            f"{srow['router_grpc_vs_binary_rps']}, node {srow['node_grpc_vs_binary_rps']}"
        )
        for key, t in srow.items():
            if key.startswith("traced_"):
                lines.append(
                    f"    tracing sampled at {key.removeprefix('traced_')}: req/s {t['rps_vs_untraced']}x the untraced "
                    f"router's, CPU per request {t['cpu_vs_untraced']}x, adds {t['added_p50_ms']:.3f} ms p50"
                )
        if "captured" in srow:
            cap = srow["captured"]
            lines.append(
                f"    capture on: req/s {cap['rps_vs_plain']}x the same router without, CPU per request "
                f"{cap['cpu_vs_plain']}x; {capture_bytes} bytes a request on disk (gzip'd)"
            )
        if "tenanted" in srow:
            ten = srow["tenanted"]
            lines.append(
                f"    tenants on: req/s {ten['rps_vs_plain']}x the same router without, CPU per request "
                f"{ten['cpu_vs_plain']}x"
            )
        if "router_vs_baseline_rps" in srow:
            lines.append(
                f"    against the baseline router: req/s {srow['router_vs_baseline_rps']}x, added p50 "
                f"{srow['router_vs_baseline_added_p50']}x ({srow['router_added_p50_ms']:.3f} against "
                f"{srow['baseline_added_p50_ms']:.3f} ms), CPU per request {srow['router_vs_baseline_cpu']}x"
            )
    save(out_dir, doc, lines)
    return doc
