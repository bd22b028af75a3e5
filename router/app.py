"""The router's app factory and its background tasks.

`create_app(config)` builds one `Router` (router.state) and an aiohttp application: the OIP routes
(router.http_api over router.director and router.fleet), the admin sub-application (router.admin),
`/metrics` and the status page. Every resource
(telemetry consumer thread, node client pool, peers publisher, copy planner, config watcher) is owned
by a `cleanup_ctx` generator and torn down in reverse order.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import shutil
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from router import admin, director, grpc_api, http_api, mqtt_api
from router.canary_app import canary_ctx
from router.capture_app import capture_ctx
from router.config import ConfigError, RouterConfig, telemetry_sources
from router.dataplane.haproxy import GRPC_HTTP1_SOCKET, GRPC_SOCKET, ROUTER_SOCKET
from router.early import EarlyDoor, peer_of
from router.lifecycle.saturation import TICK_MS
from router.loop_busy import LoopBusy
from router.node_client import HttpNodeClient, NodeClient, NodeError
from router.state import CLIENT, ROUTER, Router
from router.state import json_error as _error
from telemetry.kafka.bus import ensure_topic, now_ms
from telemetry.kafka.peers import PeerLoads, PeerPublisher
from telemetry.kafka.reader import TelemetrySource, TelemetrySources, TopicReader
from telemetry.oip import wire
from telemetry.oip.grpc import start_server as start_grpc
from telemetry.process import tracing
from telemetry.process.background import running
from telemetry.process.serving import default_max_connections, start_site, stop_serving

log = logging.getLogger("edgeroute.router")

OPEN_PATHS = frozenset({"/", "/v2", "/v2/health/live", "/v2/health/ready", "/metrics"})
ADMIN_PREFIX = "/admin/"
# loading and unloading models changes what the fleet holds in memory: an operator's act, not a client's
REPOSITORY_CONTROL = "/v2/repository/models/"
MAX_PROBES = 64  # node probes under way at once (router.lifecycle.evidence)


@web.middleware
async def front_door(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Authenticate every route but the open ones, rate-limit inference per client, and answer every
    error as JSON (an unexpected exception is a 500, never a dead process). One middleware, as it runs
    on every request."""
    try:
        if request.path in OPEN_PATHS or request.path.startswith(ADMIN_PREFIX):
            return await handler(request)  # open, or the admin sub-application's own authentication
        router = request.app[ROUTER]
        verdict = router.auth.check(
            request.headers.get("Authorization"),
            request.path.startswith(REPOSITORY_CONTROL),
            peer_of(router, request.headers, request.remote),
        )
        if verdict.status:
            headers = {"WWW-Authenticate": "Bearer"} if verdict.status == 401 else None
            return _error(verdict.status, verdict.reason, headers)
        request[CLIENT] = verdict.client
        if request.method == "POST" and request.path.endswith("/infer"):
            limited = director.admit(router, verdict.client, request.match_info.get("model", "unknown"))
            if limited is not None:
                return http_api.outcome_response(limited)
        elif request.path.endswith("/stats"):  # statistics ask every node: the client's rate holds for them too
            refused = router.limiter.admit(verdict.client, router.clock())
            if refused.status:
                return _error(refused.status, refused.reason, {"Retry-After": str(refused.retry_after_s)})
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        reason = exc.reason or "error"
        if exc.content_type == "application/json" and exc.text:  # our own error (telemetry.process.serving.read_body)
            try:
                reason = str(wire.loads(exc.text).get("error", reason))
            except (ValueError, AttributeError):
                pass
        resp = _error(exc.status, reason)
        if exc.keep_alive is False:  # (a body left half read: the connection cannot carry another request)
            resp.force_close()
        return resp
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return _error(500, "internal router error")


class _LagTicker:
    """How late the loop gets to a timer due every TICK_MS, and how much of each tick it wanted the CPU
    (router.lifecycle.saturation): one `call_at` chain, no task; a tick costs a few microseconds."""

    def __init__(self, router: Router, loop: asyncio.AbstractEventLoop) -> None:
        self.router = router
        self.loop = loop
        self.busy = LoopBusy()
        self.due = loop.time() + TICK_MS / 1000.0
        self.handle: asyncio.TimerHandle | None = loop.call_at(self.due, self.tick)

    def tick(self) -> None:
        now = self.loop.time()
        self.router.saturation.tick((now - self.due) * 1000.0, self.busy.share())
        self.due = now + TICK_MS / 1000.0
        self.handle = self.loop.call_at(self.due, self.tick)

    def stop(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None
        self.busy.close()


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    router = app[ROUTER]
    if router.config.kafka is not None:
        # import kafka-python once here: its package init is not safe to run from two threads at once
        # (the telemetry consumer and the peers' topic creation)
        importlib.import_module("kafka")
    cfg = router.config.peers
    if cfg.enabled and router.config.kafka is not None:
        router.peers = PeerLoads(
            router.config.kafka, router.router_id, cfg.topic, cfg.stale_after_ms, router.clock, cfg.fetch_max_wait_ms
        )
        router.peers.verifier = router.verifier
        await asyncio.get_running_loop().run_in_executor(None, ensure_topic, router.config.kafka, cfg.topic)
        carrier = router.source.reader_for(router.config.kafka) if isinstance(router.source, TelemetrySources) else None
        if carrier is not None:
            carrier.carry(router.peers)  # one consumer, one fetch per poll for telemetry and peers
        router.peers.start()
    router.dispatcher.attach_to_loop(asyncio.get_running_loop())
    router.source.start(router.store)
    lag = _LagTicker(router, asyncio.get_running_loop())
    try:
        async with running(router.dispatcher.reroute_loop(), "reroute"):
            yield
    finally:
        lag.stop()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, router.source.stop)
        if router.peers is not None:
            await loop.run_in_executor(None, router.peers.stop)
        await router.client.close()


async def _peers(app: web.Application) -> AsyncIterator[None]:
    """Active-active: publish this router's in-flight per node; the other routers' are read with the
    telemetry (telemetry.kafka.peers, started in `_lifecycle`)."""
    router = app[ROUTER]
    loads = router.peers
    if loads is None:
        yield
        return
    cfg = router.config.peers
    assert router.config.kafka is not None
    publisher = PeerPublisher(
        router.config.kafka, router.router_id, cfg.topic, cfg.stale_after_ms / 3, router.config.signer()
    )
    router.lifecycle.tracker.remote = loads.remote
    router.lifecycle.tracker.remote_settled = loads.settled

    changed = asyncio.Event()
    router.lifecycle.tracker.on_change = changed.set

    async def publish() -> None:
        # at once on a change (then at most one message per interval), else a heartbeat
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), publisher.heartbeat_ms / 1000.0)
            changed.clear()
            msg = publisher.snapshot(*router.lifecycle.tracker.totals(), router.clock())
            if msg is not None:
                publisher.submit(msg)
            await asyncio.sleep(cfg.interval_ms / 1000.0)

    try:
        async with running(publish(), "peers-publisher"):
            yield
    finally:
        router.lifecycle.tracker.remote = None
        router.lifecycle.tracker.remote_settled = None
        router.lifecycle.tracker.on_change = None
        await asyncio.get_running_loop().run_in_executor(None, publisher.close)


async def _copies(app: web.Application) -> AsyncIterator[None]:
    """Copy scaling (router.lifecycle.copies): load one more warm copy of a model whose demand outgrows its
    copies, while `copies.enabled` (the config's, or `PUT /admin/copies`)."""
    router = app[ROUTER]
    pending: set[asyncio.Task[None]] = set()

    async def load(model: str, node_id: str) -> None:
        node = router.store.view.get(node_id)
        started = router.clock()
        result = "unreachable"
        try:
            if node is not None:
                reply = await router.client.post(
                    f"{node.endpoint}/v2/repository/models/{model}/load",
                    b"{}",
                    {"Content-Type": "application/json"},
                    30.0,
                    admin=True,
                )
                result = "loaded" if reply.status == 200 else f"refused {reply.status}"
        except NodeError:
            pass
        finally:
            router.lifecycle.copies.done(model)
        router.metrics.copies.labels(model, result.split()[0]).inc()
        router.copies_log.append(
            {
                "at_ms": round(started, 1),
                "model": model,
                "node": node_id,
                "result": result,
                "ms": round(router.clock() - started, 1),
            }  # fmt: skip
        )
        log.info("copy of %s on %s: %s", model, node_id, result)

    async def plan() -> None:
        while True:  # (the settings read each round: PUT /admin/copies swaps them)
            copies = router.lifecycle.copies
            await asyncio.sleep(copies.cfg.interval_ms / 1000.0)
            if not copies.cfg.enabled or copies is not router.lifecycle.copies:
                continue
            for model, node_id in copies.plan(router.store.view, router.clock(), router.lifecycle.tracker):
                task = asyncio.create_task(load(model, node_id), name=f"copy-{model}")
                pending.add(task)
                task.add_done_callback(pending.discard)

    try:
        async with running(plan(), "copy-planner"):
            yield
    finally:
        for task in list(pending):
            task.cancel()


async def _prober(app: web.Application) -> AsyncIterator[None]:
    """The router's own evidence for nodes whose telemetry went stale (router.lifecycle.evidence): every
    half probe interval, the probes the lifecycle asks for, `GET /v2/health/ready` each, at most
    `MAX_PROBES` under way. Nothing is probed while telemetry is fresh."""
    router = app[ROUTER]
    cfg = router.config.probes
    if not cfg.enabled:
        yield
        return
    lc = router.lifecycle
    gate = asyncio.Semaphore(MAX_PROBES)
    under_way: set[asyncio.Task[None]] = set()

    async def probe(node_id: str, endpoint: str) -> None:
        ok = False
        try:
            async with gate:
                reply = await router.client.get(f"{endpoint}/v2/health/ready", cfg.timeout_ms / 1000.0)
            ok = reply.status == 200
        except NodeError:
            pass
        lc.probed(node_id, ok, router.clock())

    async def rounds() -> None:
        while True:
            await asyncio.sleep(cfg.interval_ms / 2000.0)
            for node in lc.probes_due(router.clock()):
                task = asyncio.create_task(probe(node.node_id, node.endpoint), name="probe")
                under_way.add(task)
                task.add_done_callback(under_way.discard)

    try:
        async with running(rounds(), "prober"):
            yield
    finally:
        for task in list(under_way):
            task.cancel()


async def _config_watcher(app: web.Application) -> AsyncIterator[None]:
    router = app[ROUTER]
    path = router.config_path
    if path is None:
        yield
        return

    def mtime() -> float:
        try:
            return path.stat().st_mtime
        except OSError:
            return 0.0

    async def watch() -> None:
        seen = mtime()
        while True:
            await asyncio.sleep(1.0)
            current = mtime()
            if current != seen:
                seen = current
                await router.reload_file()

    async with running(watch(), "config-watcher"):
        yield


async def metrics(request: web.Request) -> web.Response:
    router = request.app[ROUTER]
    return web.Response(body=generate_latest(router.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


def create_app(
    config: RouterConfig,
    *,
    source: TelemetrySource | None = None,
    client: NodeClient | None = None,
    clock: Callable[[], float] = now_ms,
    config_path: Path | None = None,
) -> web.Application:
    """The router application. Without `source`, telemetry comes from Kafka: `telemetry_sources`, else
    `config.kafka`."""
    if source is None:
        clusters = telemetry_sources(config)
        if not clusters:
            raise ConfigError("router needs 'kafka' (a bootstrap HOST:PORT), 'telemetry_sources' or a telemetry source")
        source = TelemetrySources.of(clusters, config.lookback_ms, config.fetch_max_wait_ms, clock)
    if client is None:
        client = HttpNodeClient(
            config.pool_per_node,
            config.connect_timeout_ms / 1000.0,
            max_answer_bytes=config.max_answer_bytes,
            admin_token=config.node_admin_token,
            node_token=config.node_token,
            ssl_context=None if config.node_tls is None else config.node_tls.context(),
        )
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=[front_door])
    app[ROUTER] = Router(config, source, client, clock, config_path)
    if isinstance(source, (TopicReader, TelemetrySources)):
        source.verifier = app[ROUTER].verifier
    app.cleanup_ctx.append(_lifecycle)
    app.cleanup_ctx.append(_peers)
    app.cleanup_ctx.append(_copies)
    app.cleanup_ctx.append(_config_watcher)
    app.cleanup_ctx.append(_prober)
    app.cleanup_ctx.append(capture_ctx)  # (before the MQTT door: its last answers are recorded too)
    app.cleanup_ctx.append(canary_ctx)
    app.cleanup_ctx.append(mqtt_api.mqtt_door)
    http_api.add_routes(app)
    r = app.router
    r.add_get("/metrics", metrics)
    r.add_get("/", admin.status_page)
    app.add_subapp("/admin", admin.create_admin_app(app[ROUTER]))
    return app


async def serve(
    config: RouterConfig,
    stop: asyncio.Event,
    config_path: Path | None = None,
    on_bound: Callable[[int], None] | None = None,
    reuse_port: bool = False,
    on_grpc: Callable[[int], None] | None = None,
    on_data_plane: Callable[[str, str | None], None] | None = None,
) -> None:
    if config.tracing is not None:  # (process-wide: a process that embeds a router sets its own up)
        tracing.configure(config.tracing, "edgeroute-router")
    app = create_app(config, config_path=config_path)
    runner, site, cap = await start_site(
        app,
        config.host,
        config.port,
        ssl_context=None if config.tls is None else config.tls.context(),
        reuse_port=reuse_port,
        max_connections=config.connection_limits(default_max_connections())[0],
        idle_timeout_s=config.idle_timeout_s,
        protocol=lambda server: EarlyDoor(server, app[ROUTER]),
    )
    app[ROUTER].metrics.watch_connections(cap)
    grpc_server = grpc_port = None
    stack = contextlib.AsyncExitStack()
    try:
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        if on_bound is not None:
            on_bound(port)
        private = await _private_door(runner, stack) if config.data_plane.enabled else None
        if config.grpc_port is not None:
            grpc_server, grpc_port = await start_grpc(
                grpc_api.add_to(app),
                config.host,
                config,
                config.max_body_bytes,
                reuse_port,
                None if private is None else f"unix:{private / GRPC_SOCKET}",
            )
            if on_grpc is not None:
                on_grpc(grpc_port)
        if private is not None:
            await stack.enter_async_context(_data_plane(app[ROUTER], private, grpc_port is not None, on_data_plane))
        loop = asyncio.get_running_loop()
        with contextlib.suppress(NotImplementedError, RuntimeError):
            import signal

            reloads: set[asyncio.Task[None]] = set()  # (held until done: the loop keeps only weak references)

            def reload() -> None:
                task = loop.create_task(app[ROUTER].reload_file())
                reloads.add(task)
                task.add_done_callback(reloads.discard)

            loop.add_signal_handler(signal.SIGHUP, reload)
        await stop.wait()
    finally:
        await stack.aclose()
        await stop_serving(runner, grpc_server, config.tracing is not None)


async def _private_door(runner: web.AppRunner, stack: contextlib.AsyncExitStack) -> Path | None:
    """The folder the router serves its proxy from (router.dataplane.control.private_folder), its HTTP
    already on a socket there; None, with one line why, where it cannot (the router serves alone)."""
    from router.dataplane.control import private_folder

    folder = private_folder()
    stack.callback(shutil.rmtree, folder, True)
    try:
        await web.UnixSite(runner, str(folder / ROUTER_SOCKET)).start()
    except OSError as exc:  # (a path past the socket limit: TMPDIR too long)
        print(f"edgeroute router: data plane off: cannot serve it on {folder}: {exc}", file=sys.stderr, flush=True)
        return None
    return folder


@contextlib.asynccontextmanager
async def _data_plane(
    router: Router, private: Path, grpc: bool, on_started: Callable[[str, str | None], None] | None
) -> AsyncIterator[None]:
    """The native proxy in front of this router while it serves (router.dataplane), reaching it on the
    sockets in `private`, with a gRPC door where the router has one. Where it cannot start (no binary,
    a refused configuration) one line says why and the router serves alone."""
    from router.dataplane.control import DataPlane, DataPlaneError

    dp = DataPlane(router, private, grpc)
    h1 = await grpc_api.proxy_door(router, private / GRPC_HTTP1_SOCKET) if grpc else None
    if h1 is not None:
        dp.python_grpc_http1 = str(private / GRPC_HTTP1_SOCKET)
    try:
        await dp.start()
    except (DataPlaneError, OSError, ValueError) as exc:
        await dp.stop()
        if h1 is not None:
            await h1.stop()
        print(f"edgeroute router: data plane off: {exc}", file=sys.stderr, flush=True)
        yield
        return
    router.dataplane = dp
    unwatch = router.metrics.watch_data_plane(dp)
    if on_started is not None:
        on_started(dp.url, dp.grpc_address)
    try:
        async with running(dp.run(), "data-plane"):
            yield
    finally:
        unwatch()
        router.dataplane = None
        await dp.stop()
        if h1 is not None:
            await h1.stop()
