"""The node: an Open Inference Protocol v2 server over ONNX Runtime that publishes its load.

Request path: validate against the model's metadata -> wait for one of `slots` execution slots (at
most `max_queue` waiting, else 503; the remaining deadline bounds the wait, else 504) -> run the
ONNX Runtime session on a slot thread, or on the event loop itself when the model's measured run at
that batch size is within `inline_max_ms` (nodes.executor) -> answer. Per-model EWMA latency by batch size, queue
depth by priority and in-flight counts are published to Kafka every `interval_ms`, and at once when
outstanding work moves by `change_threshold`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import platform
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from nodes import grpc_service
from nodes.config import NodeConfig
from nodes.describe import Unanswerable, served
from nodes.describe import add_routes as add_model_routes
from nodes.describe import error as _error
from nodes.gpu import nvml_for_cuda_device
from nodes.inference import Decoded, Done, admin_refusal, load_or_refuse
from nodes.inference import infer as run_inference
from nodes.protocol import InferRequest, decode_request, encode_response, split_body
from nodes.repository import resolve as resolve_repository
from nodes.residency import Residency
from nodes.runtime import LoadedModel, choose_providers, load_model, model_file_size
from nodes.state import CONFIG, ENDPOINT, RUNTIME, VERSION, NodeRuntime, load_failure
from telemetry.cluster.schema import DeviceInfo
from telemetry.kafka.bus import TelemetryPublisher
from telemetry.measure.quantiles import nearest_rank
from telemetry.oip import grpc_http1, wire
from telemetry.oip.grpc import start_server as start_grpc
from telemetry.oip.triton import EXTENSIONS
from telemetry.process import tracing
from telemetry.process.background import running
from telemetry.process.serving import default_max_connections, read_body, start_site, stop_serving

log = logging.getLogger("edgeroute.node")


async def _runtime_ctx(app: web.Application) -> AsyncIterator[None]:
    cfg = app[CONFIG]
    providers, kind, name = choose_providers(cfg.device)
    # one thread beyond the slots: the priority lane's (nodes.executor), used only where it is open
    executor = ThreadPoolExecutor(max_workers=cfg.slots + 1, thread_name_prefix=f"ort-{cfg.node_id}")
    loop = asyncio.get_running_loop()
    models: dict[str, LoadedModel] = {}
    failed: dict[str, tuple[float, str]] = {}
    residency = Residency(cfg.memory_budget_bytes)
    rt: NodeRuntime | None = None
    try:
        for spec in cfg.models:  # in config order, while they fit; the rest load on first use
            try:
                size = await loop.run_in_executor(executor, model_file_size, spec, cfg.zoo_dir)
                if residency.used_bytes + size > cfg.memory_budget_bytes:
                    log.info("node %s: %s does not fit the memory budget now; loads on demand", cfg.node_id, spec.name)
                    continue
                models[spec.name] = await loop.run_in_executor(
                    executor,
                    load_model,
                    spec,
                    providers,
                    cfg.threads_per_slot,
                    cfg.zoo_dir,
                    cfg.device,
                    *cfg.gpu_settings(),
                )
            except Exception as exc:  # noqa: BLE001 - a broken or missing file fails that model alone
                failed[spec.name] = load_failure(exc)
                log.error(
                    "node %s: model %s cannot be loaded (requests for it answer 500): %s", cfg.node_id, spec.name, exc
                )
                continue
            residency.add(spec.name, models[spec.name].size_bytes)
            log.info("node %s loaded %s in %.0f ms", cfg.node_id, spec.name, models[spec.name].load_ms)
        if kind == "cuda" and models and all(m.device == "cpu" for m in models.values()):
            log.warning("node %s: CUDA is visible but no model's session got it; reporting the CPU", cfg.node_id)
            kind, name = "cpu", platform.processor() or platform.machine()
        rt = NodeRuntime(cfg, models, executor, DeviceInfo(kind=kind, name=name), providers, residency)
        if kind == "cuda":
            rt.gpu = nvml_for_cuda_device()
            rt.device = rt.device_now()  # the GPU's own name where NVML reads it
        rt.failed.update(failed)
        app[RUNTIME] = rt
        yield
    finally:
        executor.shutdown(wait=True, cancel_futures=True)
        if rt is not None:
            rt.loader.shutdown(wait=True, cancel_futures=True)


async def _telemetry_ctx(app: web.Application) -> AsyncIterator[None]:
    cfg = app[CONFIG]
    if cfg.kafka is None:
        yield
        return
    rt = app[RUNTIME]
    publisher = TelemetryPublisher(cfg.kafka, cfg.topic, cfg.signer())
    pub_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"telemetry-{cfg.node_id}")
    loop = asyncio.get_running_loop()

    async def publish_loop() -> None:
        last = time.perf_counter()
        last_busy = rt.engine.busy_ms
        last_error = -math.inf
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(rt.publish_now.wait(), cfg.interval_ms / 1000.0)
            rt.publish_now.clear()
            endpoint = app[ENDPOINT][0] if app[ENDPOINT] else None
            if endpoint is None:
                continue
            now = time.perf_counter()
            try:
                msg = rt.snapshot(endpoint, rt.engine.busy_ms - last_busy, (now - last) * 1000.0)
                last, last_busy = now, rt.engine.busy_ms
                await loop.run_in_executor(pub_executor, publisher.publish, msg)
            except Exception:  # noqa: BLE001 - one failed report must not end the node's telemetry
                if now - last_error >= 60.0:  # logged once a minute at most
                    log.exception("node %s: telemetry report failed", cfg.node_id)
                    last_error = now

    try:
        async with running(publish_loop(), f"telemetry-{cfg.node_id}"):
            yield
    finally:
        # Tell routers at once that this node is going away, then close the producer.
        rt.draining = True
        if app[ENDPOINT]:
            final = rt.snapshot(app[ENDPOINT][0], 0.0, 1.0)
            await loop.run_in_executor(pub_executor, publisher.publish, final)
        await loop.run_in_executor(pub_executor, publisher.close)
        pub_executor.shutdown(wait=True)


def _served(request: web.Request) -> str | web.Response:
    """The node's own name for the requested model and version (nodes.describe.served), or 404."""
    try:
        return served(request.app[RUNTIME], request.match_info["model"], request.match_info.get("version"))
    except Unanswerable as exc:
        return _error(exc.status, exc.message)


async def live(request: web.Request) -> web.Response:
    return web.json_response({"live": True})


async def ready(request: web.Request) -> web.Response:
    rt = request.app.get(RUNTIME)
    ok = rt is not None and not rt.draining
    return web.json_response({"ready": ok}, status=200 if ok else 503)


async def server_metadata(request: web.Request) -> web.Response:
    return web.json_response(
        {
            "name": "edgeroute-node",
            "version": VERSION,
            "extensions": EXTENSIONS,
        }
    )


async def repository_index(request: web.Request) -> web.Response:
    rt = request.app[RUNTIME]
    # (reads the repository's folders: off the event loop, and not behind a model load on the loader)
    return web.json_response(await asyncio.get_running_loop().run_in_executor(None, rt.repository_index))


async def repository_load(request: web.Request) -> web.Response:
    """Triton's `POST /v2/repository/models/{m}/load`: make the model resident (evicting idle ones)."""
    name = _served(request)
    if isinstance(name, web.Response):
        return name
    model = await load_or_refuse(request.app[RUNTIME], name, retry=True)  # an operator's load tries again at once
    if isinstance(model, Done):
        return _error(model.status, model.reason)
    return web.json_response({"name": model.served_name, "state": "READY", "load_ms": round(model.load_ms, 1)})


async def repository_unload(request: web.Request) -> web.Response:
    """`POST /v2/repository/models/{m}/unload`: free its memory; 409 while requests use it."""
    rt = request.app[RUNTIME]
    name = _served(request)
    if isinstance(name, web.Response):
        return name
    busy = await rt.unload(name)
    if busy:
        return _error(409, f"model '{name}' has {busy} request(s) in progress")
    return web.json_response({"name": rt.specs[name].served_name, "state": "UNAVAILABLE"})


async def infer(request: web.Request) -> web.Response:
    """POST /v2/models/{m}[/versions/{v}]/infer over nodes.inference: the body is read (within its size
    and time bounds) only once the model is known and resident; priority and deadline from the
    router's headers, else the request's parameters (the same rules as the router's: a node reached
    directly must not queue, and report in its telemetry, a priority no router would send)."""
    rt = request.app[RUNTIME]
    arrived = time.perf_counter()

    async def decode(model: LoadedModel) -> Decoded:
        body = await read_body(request, request.app[CONFIG].body_timeout_s)
        doc, tail = split_body(body, request.headers.get(wire.HEADER_LENGTH))
        req = decode_request(doc, tail, model.inputs, model.output_names)
        params = req.parameters
        priority = wire.priority_hint(request.headers.get(wire.PRIORITY, params.get("priority"))) or 0
        budget_ms = wire.deadline_hint(request.headers.get(wire.DEADLINE_MS), params)  # (Triton's timeout too)
        if budget_ms is not None and budget_ms <= 0 and wire.DEADLINE_MS not in request.headers:
            # the client's own, in its body, as the router's intake refuses it (a router's header says
            # what is left, and none left is a 504 here)
            raise wire.BadHint("'deadline_ms' must be positive")
        tenant = wire.tenant_hint(request.headers.get(wire.TENANT))  # the router's only, never the body's
        if tenant is None:
            return Decoded(req, priority, budget_ms)
        return Decoded(req, priority, budget_ms, tenant, wire.weight_hint(request.headers.get(wire.TENANT_WEIGHT)))

    info = request.match_info
    rid = request.headers.get(wire.REQUEST_ID)
    done = await run_inference(rt, info["model"], info.get("version"), decode, _encode, rid, arrived, request.headers)
    # the attempt's id goes back with its answer, so a router never takes a late duplicate on a reused
    # connection for the answer to its next request (router.http1's `echo`)
    echo = {} if rid is None else {wire.REQUEST_ID: rid}
    if done.status != 200 or done.payload is None:
        # a refusal (queue full, or too late here) is cheap and says when to come back
        retry = {"Retry-After": "1"} if done.refused else {}
        return _error(done.status, done.reason, {**retry, **echo})
    payload, header_len = done.payload
    limit = _answer_limit(request.headers.get(wire.MAX_ANSWER))
    if limit is not None and len(payload) > limit:
        # the router could not carry it: refused here, its bytes never sent (the request's own doing,
        # not this node's fault; the router answers its client 413)
        return _error(413, f"the answer is {len(payload)} bytes, over the caller's limit of {limit}", echo)
    headers = {
        **echo,
        wire.NODE: rt.config.node_id,
        wire.EXEC_MS: f"{done.exec_ms:.3f}",
        wire.QUEUE_MS: f"{done.queue_ms:.3f}",
        wire.BATCH_ROWS: str(done.batch_rows),
    }
    if done.cold_ms is not None:
        headers[wire.COLD_MS] = f"{done.cold_ms:.3f}"
    if header_len is None:
        return web.Response(body=payload, content_type="application/json", headers=headers)
    headers[wire.HEADER_LENGTH] = str(header_len)
    return web.Response(body=payload, content_type="application/octet-stream", headers=headers)


def _answer_limit(value: str | None) -> int | None:
    """The caller's answer limit (`x-edgeroute-max-answer-bytes`), or None (none, or not a number)."""
    if value is None or not value.isascii() or not value.isdigit() or len(value) > 15:
        return None
    return int(value)


def _encode(model: LoadedModel, req: InferRequest, outputs: dict[str, Any]) -> tuple[bytes, int | None]:
    return encode_response(model.served_name, model.version, req, model.outputs, outputs)


async def metrics(request: web.Request) -> web.Response:
    """Prometheus exposition of this node (nodes.metrics)."""
    body = generate_latest(request.app[RUNTIME].metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def stats(request: web.Request) -> web.Response:
    """Counters for operators and tests: served, cancelled, queued, executing, and the peak of queued +
    executing since start or the last `?reset=1` (which starts a new peak). `?samples=1` adds the
    latest wake-up times themselves (up to 4096, oldest first), for the profiler; `?executed=1` the
    router ids of the requests executed since the last reset (the newest 65,536), for replays to check
    that no request ran twice."""
    rt = request.app[RUNTIME]
    engine = rt.engine
    body = {
        "served": engine.served,
        "cancelled": engine.cancelled,
        "queued": engine.scheduler.queued,
        "in_flight": engine.in_flight,
        "peak_outstanding": engine.peak_outstanding,
        "resident": rt.residency.resident,
        "memory_used_bytes": rt.residency.used_bytes,
        "memory_budget_bytes": rt.residency.budget_bytes,
        "loads": rt.loads,
        "evictions": rt.evictions,
        "model_requests": rt.model_requests,
        "cold_requests": rt.cold_requests,
        "by_model": rt.per_model.as_json(),  # the four counts above per model (nodes.residency.ModelCounts)
        "handoffs": engine.handoffs,
        "handoff_ms_mean": round(engine.handoff_ms_total / engine.handoffs, 4) if engine.handoffs else 0.0,
        "inline_runs": engine.inline_runs,
        "wakeups": engine.wakeups,
        "wakeup_ms_mean": round(engine.wakeup_ms_total / engine.wakeups, 4) if engine.wakeups else 0.0,
        "wakeup_ms_p50_p99": [round(nearest_rank(engine.wakeup_recent, q), 4) for q in (0.5, 0.99)],
        "scheduler": engine.scheduler.mode,
        "device": rt.device_now().summary(),
        "model_devices": {name: m.device for name, m in rt.models.items()},  # where each session really runs
        # the tenants the router named (its fair share here, nodes.fairshare): requests seen, queued now
        "tenants": {
            "requests": dict(rt.tenant_requests),
            "queued": dict(engine.scheduler.fair.tenants) if engine.scheduler.fair is not None else {},
        },
    }
    if request.query.get("samples") == "1":
        body["wakeup_samples_ms"] = [round(v, 4) for v in engine.wakeup_recent]
    if request.query.get("executed") == "1":
        body["executed_ids"] = list(engine.executed)
    if request.query.get("reset") == "1":
        engine.peak_outstanding = engine.scheduler.queued + engine.in_flight
        engine.executed.clear()
    return web.json_response(body)


async def cancel(request: web.Request) -> web.Response:
    """`DELETE /admin/requests/{id}`: take a queued request out (a hedge lost, a try timed out, the
    router moves it elsewhere); it answers 499. 404 once it has started: then it runs here."""
    rt = request.app[RUNTIME]
    rid = request.match_info["id"]
    if rt.engine.cancel(rid):
        return web.json_response({"cancelled": rid})
    return _error(404, f"no queued request '{rid}' (unknown, running or done)")


async def put_speed(request: web.Request) -> web.Response:
    """`{"speed": x}`: change the emulated device speed (fault injection: a slowed node)."""
    rt = request.app[RUNTIME]
    try:
        speed = float(wire.loads(await read_body(request, request.app[CONFIG].body_timeout_s))["speed"])
        if not 0 < speed <= 1000:
            raise ValueError
    except (ValueError, KeyError, TypeError):
        return _error(400, 'body must be {"speed": number in (0, 1000]}')
    rt.engine.speed = speed
    log.warning("node %s speed set to %g", rt.config.node_id, speed)
    return web.json_response({"speed": speed})


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def admin_guard(token: str | None, what: str = "admin") -> Callable[[Handler], Handler]:
    """Wraps an `/admin/*` or repository handler in the node's admin check (nodes.inference.admin_refusal),
    or, with `what` "inference", an inference handler in the inference token's. Metadata, health and
    `/metrics` are not wrapped and stay open; being per route, a guard costs what it wraps nothing when
    its token is not set."""

    def wrap(handler: Handler) -> Handler:
        if token is None:
            return handler

        async def guarded(request: web.Request) -> web.StreamResponse:
            refusal = admin_refusal(token, request.headers.get("Authorization"), what)
            if refusal is not None:
                status, reason = refusal
                return _error(status, reason, {"WWW-Authenticate": "Bearer"} if status == 401 else None)
            return await handler(request)

        return guarded

    return wrap


def create_app(config: NodeConfig) -> web.Application:
    """The node's app; a config naming a model repository is resolved here (nodes.repository), so a
    repository that cannot be read stops the node before it serves (ConfigError)."""
    config = resolve_repository(config)
    app = web.Application(client_max_size=config.max_body_bytes)
    app[CONFIG] = config
    app[ENDPOINT] = [config.endpoint] if config.endpoint else []
    app.cleanup_ctx.append(_runtime_ctx)
    app.cleanup_ctx.append(_telemetry_ctx)
    guard = admin_guard(config.admin_token)
    # inference first: aiohttp tries the routes in the order they were added
    infer_guard = admin_guard(config.infer_token, "inference")
    app.router.add_post("/v2/models/{model}/infer", infer_guard(infer))
    app.router.add_post("/v2/models/{model}/versions/{version}/infer", infer_guard(infer))
    app.router.add_get("/v2/health/live", live)
    app.router.add_get("/v2/health/ready", ready)
    app.router.add_get("/v2", server_metadata)
    add_model_routes(app)  # metadata, readiness, Triton's configuration and statistics
    app.router.add_post("/v2/repository/index", guard(repository_index))
    app.router.add_post("/v2/repository/models/{model}/load", guard(repository_load))
    app.router.add_post("/v2/repository/models/{model}/unload", guard(repository_unload))
    app.router.add_put("/admin/speed", guard(put_speed))
    app.router.add_delete("/admin/requests/{id}", guard(cancel))
    app.router.add_get("/admin/stats", guard(stats))
    app.router.add_get("/metrics", metrics)
    return app


async def serve(config: NodeConfig, stop: asyncio.Event, on_bound: Any = None, on_grpc: Any = None) -> None:
    """Run the node until `stop` is set; the bound port is reported through `on_bound(port)`, the gRPC
    service's (with `grpc_port` set) through `on_grpc(port)`."""
    if config.tracing is not None:  # (process-wide: a process that embeds a node sets its own up)
        tracing.configure(config.tracing, "edgeroute-node")
    app = create_app(config)
    ssl_context = None if config.tls is None else config.tls.context()
    runner, site, _ = await start_site(
        app,
        config.host,
        config.port,
        ssl_context=ssl_context,
        max_connections=config.connection_limits(default_max_connections())[0],
        idle_timeout_s=config.idle_timeout_s,
    )
    grpc_server = None
    h1_server = None
    try:
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        if not app[ENDPOINT]:
            scheme = "http" if ssl_context is None else "https"
            app[ENDPOINT].append(f"{scheme}://{config.host}:{port}")
        if on_bound is not None:
            on_bound(port)
        if config.grpc_port is not None:
            grpc_server, grpc_port = await start_grpc(
                grpc_service.add_to(app[RUNTIME]), config.host, config, config.max_body_bytes
            )
            if on_grpc is not None:
                on_grpc(grpc_port)
            advertised = urlsplit(app[ENDPOINT][0])
            host = f"[{advertised.hostname}]" if ":" in (advertised.hostname or "") else advertised.hostname
            app[RUNTIME].grpc_endpoint = f"{advertised.scheme}://{host}:{grpc_port}"
            if config.grpc_http1_port is not None:
                h1_server = await grpc_http1.start_for(
                    grpc_service.NodeService(app[RUNTIME]),
                    config,
                    config.max_body_bytes,
                    config.host,
                    config.grpc_http1_port,
                    ssl_context=ssl_context,
                )
                app[RUNTIME].grpc_http1_endpoint = f"{advertised.scheme}://{host}:{h1_server.port}"
            app[RUNTIME].publish_now.set()
        await stop.wait()
        if RUNTIME in app:
            app[RUNTIME].draining = True
    finally:
        if h1_server is not None:
            await h1_server.stop()
        await stop_serving(runner, grpc_server, config.tracing is not None)
