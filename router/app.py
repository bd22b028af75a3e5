"""The router: an Open Inference Protocol v2 front door that routes each request with a policy.

authenticate (later issue) -> validate -> admit (size, deadline) -> policy.choose -> forward -> retry.
Every accepted request gets exactly one answer: the node's result, or `{"error": ...}` with 400
(malformed), 404 (unknown model), 413 (too large), 503 (no capable node) or 504 (deadline passed).
Resources (telemetry consumer thread, client pool, config watcher) live in `cleanup_ctx` and are
torn down in reverse order.
"""

from __future__ import annotations

import asyncio
import contextlib
import html
import importlib
import json
import logging
import os
import socket
import uuid
import zlib
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from policies.api import RouteRequest
from policies.registry import PolicyConfigError, PolicySpec, build_policy
from router.admission import Authenticator, RateLimiter
from router.config import ConfigError, RouterConfig, lifecycle_settings, load_config
from router.dispatch import Dispatcher, Outcome, PolicyHolder
from router.metrics import RouterMetrics
from router.node_client import HttpNodeClient, NodeClient, NodeTimeout, NodeUnavailable
from router.workflows import WorkflowInputError, WorkflowRunner, decode_inputs
from telemetry.bus import KafkaTelemetrySource, TelemetrySource, TopicReader, ensure_topic, now_ms
from telemetry.peers import PeerLoads, PeerPublisher
from telemetry.store import ViewStore
from telemetry.view import NodeState

log = logging.getLogger("edgeroute.router")

VERSION = "0.1.0"
HEADER_LENGTH = "Inference-Header-Content-Length"
PRIORITY_HEADER = "x-edgeroute-priority"
DEADLINE_HEADER = "x-edgeroute-deadline-ms"
SITE_HEADER = "x-edgeroute-site"
CLIENT = "edgeroute.client"  # request key: the authenticated client's name


class Router:
    """Everything one router owns. Built once by `create_app`; policy swaps replace one reference."""

    def __init__(
        self,
        config: RouterConfig,
        source: TelemetrySource,
        client: NodeClient,
        clock: Callable[[], float],
        config_path: Path | None,
    ) -> None:
        self.config = config
        self.source = source
        self.client = client
        self.clock = clock
        self.config_path = config_path
        self.store = ViewStore(stale_after_ms=config.stale_after_ms)
        self.policies = PolicyHolder(build_policy(config.policy), config.policy)
        self.router_id = config.peers.router_id or f"{socket.gethostname()}-{os.getpid()}"
        # routers of one group must not draw the same random numbers: with the same view they would
        # break every tie the same way and herd onto the same node
        seed = config.seed if config.peers.router_id is None else config.seed ^ zlib.crc32(self.router_id.encode())
        self.dispatcher = Dispatcher(lifecycle_settings(config, seed), self.store, self.policies, client, clock)
        self.lifecycle = self.dispatcher.lifecycle
        self.metrics = RouterMetrics(self.store, clock)
        self.auth = Authenticator(config.auth)
        self.peers: PeerLoads | None = None
        self.limiter = RateLimiter(config.rate_limit)
        self.workflows = {w.name: WorkflowRunner(w, self.dispatcher, clock) for w in config.workflows}
        self.copies_log: deque[dict[str, Any]] = deque(maxlen=50)  # the latest copy loads, for /admin/view
        self.metrics.watch_workflows(self.workflows)

    def reload_policy(self, raw: Any, origin: str) -> PolicySpec:
        """Validate `raw` fully, then swap it in; on any error keep the old policy and raise."""
        try:
            spec = raw if isinstance(raw, PolicySpec) else PolicySpec.model_validate(raw)
            policy = build_policy(spec)
        except (PolicyConfigError, ValueError) as exc:
            self.metrics.policy_swaps.labels("rejected").inc()
            log.warning("policy reload from %s rejected, keeping %s: %s", origin, self.policies.current.name, exc)
            raise PolicyConfigError(str(exc).splitlines()[0] if str(exc) else "invalid policy") from None
        self.policies.swap(policy, spec)
        self.metrics.policy_swaps.labels("applied").inc()
        log.info("policy %s applied from %s", policy.name, origin)
        return spec

    def reload_file(self) -> None:
        if self.config_path is None:
            return
        try:
            cfg = load_config(self.config_path)
            self.reload_policy(cfg.policy, str(self.config_path))
        except (ConfigError, PolicyConfigError) as exc:
            log.warning("config reload rejected, keeping the running policy: %s", exc)


ROUTER = web.AppKey("router", Router)


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers)


class BadHint(ValueError):
    pass


def _number(value: Any, key: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool):
        raise BadHint(f"'{key}' must be a number")
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise BadHint(f"'{key}' must be a number") from None
    if out != out or out in (float("inf"), float("-inf")):
        raise BadHint(f"'{key}' must be finite")
    return out


OPEN_PATHS = frozenset({"/", "/v2", "/v2/health/live", "/v2/health/ready", "/metrics"})


@web.middleware
async def admission(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Authenticate every route but the open ones; rate-limit inference per client."""
    if request.path in OPEN_PATHS:
        return await handler(request)
    router = request.app[ROUTER]
    verdict = router.auth.check(
        request.headers.get("Authorization"), request.path.startswith("/admin"), request.remote or "unknown"
    )
    if verdict.status:
        headers = {"WWW-Authenticate": "Bearer"} if verdict.status == 401 else None
        return _error(verdict.status, verdict.reason, headers)
    request[CLIENT] = verdict.client
    if request.method == "POST" and request.path.endswith("/infer"):
        limited = router.limiter.admit(verdict.client, router.clock())
        if limited.status:
            model = request.match_info.get("model", "unknown")
            _count(router, model, 0, "none", 429, router.clock())
            return _error(429, limited.reason, {"Retry-After": str(limited.retry_after_s)})
    return await handler(request)


@web.middleware
async def json_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Every error leaves as JSON; an unexpected exception is a 500, never a dead process."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _error(exc.status, exc.reason or "error")
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return _error(500, "internal router error")


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
        await asyncio.get_running_loop().run_in_executor(None, ensure_topic, router.config.kafka, cfg.topic)
        if isinstance(router.source, TopicReader) and router.source.bootstrap == router.config.kafka:
            router.source.carry(router.peers)  # one consumer, one fetch per poll for telemetry and peers
        router.peers.start()
    router.dispatcher.attach_to_loop(asyncio.get_running_loop())
    router.source.start(router.store)
    try:
        yield
    finally:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, router.source.stop)
        if router.peers is not None:
            await loop.run_in_executor(None, router.peers.stop)
        await router.client.close()


@contextlib.asynccontextmanager
async def _running(coro: Coroutine[Any, Any, None], name: str) -> AsyncIterator[None]:
    """Run `coro` as a background task for the duration of the block; cancel it on the way out."""
    task = asyncio.create_task(coro, name=name)
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _peers(app: web.Application) -> AsyncIterator[None]:
    """Active-active: publish this router's in-flight per node; the other routers' are read with the
    telemetry (telemetry.peers, started in `_lifecycle`)."""
    router = app[ROUTER]
    loads = router.peers
    if loads is None:
        yield
        return
    cfg = router.config.peers
    assert router.config.kafka is not None
    publisher = PeerPublisher(router.config.kafka, router.router_id, cfg.topic, cfg.stale_after_ms / 3)
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
        async with _running(publish(), "peers-publisher"):
            yield
    finally:
        router.lifecycle.tracker.remote = None
        router.lifecycle.tracker.remote_settled = None
        router.lifecycle.tracker.on_change = None
        await asyncio.get_running_loop().run_in_executor(None, publisher.close)


async def _copies(app: web.Application) -> AsyncIterator[None]:
    """Copy scaling (router.lifecycle.copies): load one more warm copy of a model whose demand outgrows its copies."""
    router = app[ROUTER]
    cfg = router.config.copies
    if not cfg.enabled:
        yield
        return
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
                )
                result = "loaded" if reply.status == 200 else f"refused {reply.status}"
        except (NodeUnavailable, NodeTimeout):
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
        while True:
            await asyncio.sleep(cfg.interval_ms / 1000.0)
            for model, node_id in router.lifecycle.copies.plan(router.store.view, router.clock()):
                task = asyncio.create_task(load(model, node_id), name=f"copy-{model}")
                pending.add(task)
                task.add_done_callback(pending.discard)

    try:
        async with _running(plan(), "copy-planner"):
            yield
    finally:
        for task in list(pending):
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
                router.reload_file()

    async with _running(watch(), "config-watcher"):
        yield


# --- OIP v2 -------------------------------------------------------------------------------------


async def live(request: web.Request) -> web.Response:
    return web.json_response({"live": True})


async def ready(request: web.Request) -> web.Response:
    router = request.app[ROUTER]
    n = len(router.store.view.fresh_nodes(router.clock()))
    return web.json_response({"ready": n > 0, "nodes": n}, status=200 if n else 503)


async def server_metadata(request: web.Request) -> web.Response:
    return web.json_response(
        {"name": "edgeroute", "version": VERSION, "extensions": ["binary_tensor_data", "model_repository"]}
    )


def _model_nodes(router: Router, model: str) -> tuple[list[Any], bool]:
    """(fresh ready nodes serving `model`, whether any node at all ever reported it)."""
    view = router.store.view
    nodes = view.models(router.clock()).get(model, [])
    known = bool(nodes) or any(n.serves(model) for n in view)
    return nodes, known


def _unknown_or_unavailable(model: str, known: bool) -> web.Response:
    if known:
        return _error(503, f"no ready node serves model '{model}'")
    return _error(404, f"unknown model '{model}'")


async def _node_metadata(router: Router, model: str, suffix: str = "") -> tuple[int, bytes] | None:
    """A serving node's answer to `GET /v2/models/{model}{suffix}`, least busy node first."""
    nodes, _ = _model_nodes(router, model)
    view = router.store.view
    for node in sorted(nodes, key=lambda n: (not ((m := n.model(model)) and m.resident), view.outstanding(n))):
        try:
            reply = await router.client.get(f"{node.endpoint}/v2/models/{model}{suffix}", 2.0)
        except (NodeUnavailable, NodeTimeout):
            continue
        if reply.status < 500:
            return reply.status, reply.body
    return None


async def _workflow_metadata(router: Router, runner: WorkflowRunner) -> web.Response:
    """Like an ensemble's: the inputs as the stages' models declare them, outputs named STAGE.OUTPUT."""
    spec = runner.spec
    meta: dict[str, dict[str, Any]] = {}
    for stage in spec.stages:
        got = await _node_metadata(router, stage.model)
        if got is None or got[0] != 200:
            return _error(503, f"workflow '{spec.name}': no node answered metadata for model '{stage.model}'")
        meta[stage.name] = json.loads(got[1])
    inputs: dict[str, dict[str, Any]] = {}
    for stage in spec.stages:
        declared = {t["name"]: t for t in meta[stage.name].get("inputs", [])}
        for model_input, src in stage.inputs.items():
            ref = src if isinstance(src, str) else src.crop
            if ref in spec.inputs and ref not in inputs and model_input in declared:
                inputs[ref] = {**declared[model_input], "name": ref}
    if isinstance(spec.outputs, list):
        wanted = set(spec.outputs)
    else:
        wanted = {f"{s}.{t['name']}" for s in spec.sinks() for t in meta[s].get("outputs", [])}
    outputs = [{**t, "name": f"{s.name}.{t['name']}"} for s in spec.stages for t in meta[s.name].get("outputs", [])]
    return web.json_response(
        {
            "name": spec.name,
            "versions": ["1"],
            "platform": "edgeroute_workflow",
            "inputs": [inputs.get(n, {"name": n, "datatype": "FP32", "shape": [-1]}) for n in spec.inputs],
            "outputs": [o for o in outputs if o["name"] in wanted],
            "parameters": {"slo_ms": spec.slo_ms, "stages": [s.model_dump(exclude_none=True) for s in spec.stages]},
        }
    )


async def model_metadata(request: web.Request) -> web.Response:
    router = request.app[ROUTER]
    model = request.match_info["model"]
    runner = router.workflows.get(model)
    if runner is not None:
        return await _workflow_metadata(router, runner)
    nodes, known = _model_nodes(router, model)
    if not nodes:
        return _unknown_or_unavailable(model, known)
    suffix = request.path.split(f"/v2/models/{model}", 1)[1]
    got = await _node_metadata(router, model, suffix)
    if got is None:
        return _error(503, f"no node answered metadata for model '{model}'")
    return web.Response(status=got[0], body=got[1], content_type="application/json")


async def model_ready(request: web.Request) -> web.Response:
    router = request.app[ROUTER]
    model = request.match_info["model"]
    version = request.match_info.get("version")
    if version is not None and version != "1":
        return _error(404, f"model '{model}' has no version '{version}'")
    runner = router.workflows.get(model)
    if runner is not None:
        absent = [m for m in runner.models() if not _model_nodes(router, m)[0]]
        if absent:
            return _error(503, f"workflow '{model}': no ready node serves {', '.join(absent)}")
        return web.json_response({"name": model, "ready": True, "models": runner.models()})
    nodes, known = _model_nodes(router, model)
    if not nodes:
        return _unknown_or_unavailable(model, known)
    return web.json_response({"name": model, "ready": True, "nodes": len(nodes)})


async def repository_index(request: web.Request) -> web.Response:
    router = request.app[ROUTER]
    view = router.store.view
    serving = view.models(router.clock())
    names = sorted({m for n in view for m in n.load.models})
    warm = {m for m, nodes in serving.items() for n in nodes if (st := n.model(m)) is not None and st.resident}

    def state(m: str) -> dict[str, str]:
        if m in warm:
            return {"state": "READY"}
        if m in serving:
            return {"state": "UNAVAILABLE", "reason": "not resident on any node; loads on first use"}
        return {"state": "UNAVAILABLE", "reason": "no fresh ready node serves it"}

    index = [{"name": m, "version": "1", **state(m)} for m in names]
    for name, runner in router.workflows.items():
        absent = [m for m in runner.models() if m not in serving]
        index.append({"name": name, "version": "1", "state": "UNAVAILABLE" if absent else "READY",
                      **({"reason": f"no fresh ready node serves {', '.join(absent)}"} if absent else {})})  # fmt: skip
    return web.json_response(index)


def _fresh_serving(router: Router, model: str) -> list[NodeState]:
    now = router.clock()
    return [n for n in router.store.view.serving(model) if n.ready and router.store.view.is_fresh(n, now)]


async def repository_load(request: web.Request) -> web.Response:
    """Cluster `POST /v2/repository/models/{m}/load`: make the model resident on a node.

    Already resident on a fresh node: nothing to do. Otherwise the node that serves it with the most
    free memory loads it (or the node named in `{"parameters": {"node": ID}}`); its answer is relayed.
    """
    router = request.app[ROUTER]
    model = request.match_info["model"]
    nodes = _fresh_serving(router, model)
    if not nodes:
        return _error(404, f"no fresh node serves model '{model}'")
    wanted = None
    raw = await request.read()
    if raw:
        try:
            doc = json.loads(raw)
            wanted = (doc.get("parameters") or {}).get("node") if isinstance(doc, dict) else None
        except (ValueError, AttributeError):
            return _error(400, "malformed JSON body")
    if wanted is not None:
        nodes = [n for n in nodes if n.node_id == wanted]
        if not nodes:
            return _error(404, f"node '{wanted}' is not a fresh node serving '{model}'")
    else:
        warm = [n.node_id for n in nodes if (st := n.model(model)) is not None and st.resident]
        if warm:
            return web.json_response({"name": model, "state": "READY", "nodes": warm})
    target = max(nodes, key=lambda n: n.load.memory_budget_bytes - n.load.memory_used_bytes)
    reply = await router.client.post(
        f"{target.endpoint}/v2/repository/models/{model}/load", b"{}", {"Content-Type": "application/json"}, 60.0
    )
    if reply.status != 200:
        return web.Response(status=reply.status, body=reply.body, content_type="application/json")
    return web.json_response({"name": model, "state": "READY", "nodes": [target.node_id]})


async def repository_unload(request: web.Request) -> web.Response:
    """Cluster `POST /v2/repository/models/{m}/unload`: every node holding it lets it go (409 from a
    node with requests in progress is relayed per node)."""
    router = request.app[ROUTER]
    model = request.match_info["model"]
    nodes = _fresh_serving(router, model)
    if not nodes:
        return _error(404, f"no fresh node serves model '{model}'")
    results: dict[str, int] = {}
    for n in nodes:
        reply = await router.client.post(
            f"{n.endpoint}/v2/repository/models/{model}/unload", b"{}", {"Content-Type": "application/json"}, 10.0
        )
        results[n.node_id] = reply.status
    status = 200 if all(code == 200 for code in results.values()) else 409
    return web.json_response({"name": model, "state": "UNAVAILABLE" if status == 200 else "BUSY", "nodes": results},
                             status=status)  # fmt: skip


async def infer(request: web.Request) -> web.Response:
    router = request.app[ROUTER]
    arrived = router.clock()
    model = request.match_info["model"]
    cfg = router.config
    if request.content_length is not None and request.content_length > cfg.max_body_bytes:
        _count(router, model, 0, "none", 413, arrived)
        return _error(413, f"request body of {request.content_length} bytes exceeds {cfg.max_body_bytes}")
    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        _count(router, model, 0, "none", 413, arrived)
        return _error(413, f"request body exceeds {cfg.max_body_bytes} bytes")
    try:
        doc = _parse_header(body, request.headers.get(HEADER_LENGTH))
        params = doc.get("parameters")
        params = {} if params is None else params
        if not isinstance(params, dict):
            raise BadHint("'parameters' must be an object")
        priority = _number(request.headers.get(PRIORITY_HEADER, params.get("priority")), "priority")
        if priority is not None and priority != int(priority):
            raise BadHint("'priority' must be an integer")
        deadline = _number(request.headers.get(DEADLINE_HEADER, params.get("deadline_ms")), "deadline_ms")
        if deadline is None and params.get("timeout") is not None:
            # Triton clients send their request timeout as `parameters.timeout` in microseconds
            timeout_us = _number(params.get("timeout"), "timeout")
            deadline = None if timeout_us is None else timeout_us / 1000.0
        if deadline is not None and deadline <= 0:
            raise BadHint("'deadline_ms' must be positive")
        site = request.headers.get(SITE_HEADER, params.get("site"))
        if site is not None and not isinstance(site, str):
            raise BadHint("'site' must be a string")
        if site is None and cfg.auth is not None:  # the site of the client's key
            site = cfg.auth.sites.get(request.get(CLIENT, ""))
        batch = _batch_of(doc)
    except BadHint as exc:
        _count(router, model, 0, "none", 400, arrived)
        return _error(400, str(exc))
    runner = router.workflows.get(model)
    if runner is not None:
        return await _run_workflow(router, runner, request, body, doc, int(priority or 0), deadline, site, arrived)
    if not router.store.view.serving(model):
        _count(router, model, int(priority or 0), "none", 404, arrived)
        return _error(404, f"unknown model '{model}'")
    budget = min(deadline if deadline is not None else cfg.default_deadline_ms, cfg.max_deadline_ms)
    req_id = str(doc.get("id") or uuid.uuid4().hex[:16])
    prio = int(priority or 0)
    headers = {
        "Content-Type": request.headers.get("Content-Type", "application/json"),
        PRIORITY_HEADER: str(prio),
    }
    if HEADER_LENGTH in request.headers:
        headers[HEADER_LENGTH] = request.headers[HEADER_LENGTH]
    outcome: Outcome = await router.dispatcher.dispatch(
        RouteRequest(model, prio, budget, site, batch, req_id), request.path, body, headers, arrived + budget
    )
    for seconds in router.dispatcher.decision_seconds:
        router.metrics.decision.observe(seconds)
    router.dispatcher.decision_seconds.clear()
    if outcome.attempts > 1:
        router.metrics.retries.labels(model).inc(outcome.attempts - 1)
    _count(router, model, prio, outcome.node, outcome.status, arrived)
    out_headers = dict(outcome.headers)
    if outcome.status == 429 and "Retry-After" not in out_headers:
        out_headers["Retry-After"] = "1"  # refused early: no node could serve it in time
    out_headers["x-edgeroute-node"] = outcome.node
    out_headers["x-edgeroute-attempts"] = str(outcome.attempts)
    content_type = out_headers.pop("Content-Type", "application/json").split(";")[0]
    return web.Response(status=outcome.status, body=outcome.body, headers=out_headers, content_type=content_type)


async def _run_workflow(
    router: Router,
    runner: WorkflowRunner,
    request: web.Request,
    body: bytes,
    doc: dict[str, Any],
    priority: int,
    deadline: float | None,
    site: str | None,
    arrived: float,
) -> web.Response:
    """A workflow job: every stage routed by the policy, tensors passed between them (router.workflows)."""
    name = runner.spec.name
    header_length = request.headers.get(HEADER_LENGTH)
    tail = body[int(header_length) :] if header_length is not None else b""
    try:
        inputs = decode_inputs(doc, tail)
        missing = [n for n in runner.spec.inputs if n not in inputs]
        if missing:
            raise WorkflowInputError(f"workflow '{name}' needs input(s) {', '.join(missing)}")
    except WorkflowInputError as exc:
        _count(router, name, priority, "none", 400, arrived)
        return _error(400, str(exc))
    budget = min(deadline if deadline is not None else runner.spec.slo_ms, router.config.max_deadline_ms)
    job_id = str(doc.get("id") or uuid.uuid4().hex[:16])
    outcome = await runner.run(inputs, priority, budget, site, job_id, arrived, {PRIORITY_HEADER: str(priority)})
    _count(router, name, priority, "workflow", outcome.status, arrived)
    headers = {k: v for k, v in outcome.headers.items() if k.startswith("x-edgeroute-")}
    headers.update({"x-edgeroute-node": outcome.node, "x-edgeroute-workflow": name})
    if outcome.status == 429:
        headers["Retry-After"] = "1"
    return web.Response(status=outcome.status, body=outcome.body, headers=headers, content_type="application/json")


def _count(router: Router, model: str, priority: int, node: str, status: int, arrived: float) -> None:
    outcome = "ok" if status < 400 else str(status)
    router.metrics.requests.labels(model, str(priority), node, outcome).inc()
    router.metrics.latency.labels(model, str(priority)).observe(max(0.0, router.clock() - arrived) / 1000)


def _parse_header(body: bytes, header_length: str | None) -> dict[str, Any]:
    head = body
    if header_length is not None:
        try:
            n = int(header_length)
        except ValueError:
            raise BadHint(f"{HEADER_LENGTH} is not an integer") from None
        if not 0 <= n <= len(body):
            raise BadHint(f"{HEADER_LENGTH} {n} is outside the body of {len(body)} bytes")
        head = body[:n]
    try:
        doc = json.loads(head)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadHint(f"malformed JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise BadHint("request body must be a JSON object")
    inputs = doc.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise BadHint("'inputs' must be a non-empty list")
    return doc


def _batch_of(doc: dict[str, Any]) -> int:
    first = doc["inputs"][0]
    shape = first.get("shape") if isinstance(first, dict) else None
    if isinstance(shape, list) and shape and isinstance(shape[0], int) and shape[0] > 0:
        return shape[0]
    return 1


# --- admin and observability ---------------------------------------------------------------------


async def get_policy(request: web.Request) -> web.Response:
    router = request.app[ROUTER]
    spec = router.policies.spec
    body = spec.model_dump(exclude_none=True) if isinstance(spec, PolicySpec) else {}
    return web.json_response(
        {"name": router.policies.current.name, "spec": body, "state": router.policies.current.state()}
    )


async def put_policy(request: web.Request) -> web.Response:
    router = request.app[ROUTER]
    try:
        raw = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return _error(400, f"malformed JSON: {exc}")
    try:
        spec = router.reload_policy(raw, "PUT /admin/policy")
    except PolicyConfigError as exc:
        return _error(400, f"policy rejected, keeping '{router.policies.current.name}': {exc}")
    return web.json_response({"name": router.policies.current.name, "spec": spec.model_dump(exclude_none=True)})


async def get_links(request: web.Request) -> web.Response:
    return web.json_response(request.app[ROUTER].lifecycle.links.as_json())


async def put_link(request: web.Request) -> web.Response:
    """`{"a": A, "b": B, "cut": bool}`: cut or restore an emulated link (fault injection)."""
    router = request.app[ROUTER]
    try:
        doc = await request.json()
        a, b, cut = str(doc["a"]), str(doc["b"]), bool(doc["cut"])
    except (ValueError, KeyError, TypeError):
        return _error(400, 'body must be {"a": partition, "b": partition, "cut": bool}')
    try:
        router.lifecycle.set_link(a, b, cut)
    except KeyError as exc:
        return _error(404, str(exc.args[0]))
    log.warning("link %s-%s %s", a, b, "cut" if cut else "restored")
    return web.json_response(router.lifecycle.links.as_json())


async def get_view(request: web.Request) -> web.Response:
    router = request.app[ROUTER]
    now = router.clock()
    view = router.lifecycle.tracker.overlay(router.store.view)
    return web.json_response(
        {
            "nodes": [
                {
                    "node_id": n.node_id,
                    "endpoint": n.endpoint,
                    "partition": n.partition,
                    "tier": n.load.tier,
                    "status": n.load.status,
                    "fresh": view.is_fresh(n, now),
                    "age_ms": round(view.age_ms(n.node_id, now), 1),
                    "outstanding": view.outstanding(n),
                    "capacity": n.capacity,
                    "models": sorted(n.load.models),
                }
                for n in view
            ],
            "telemetry": telemetry_summary(router.store),
            "hedging": {
                "sent": router.lifecycle.hedges_sent,
                "won": router.lifecycle.hedge_wins,
                "cancelled": router.lifecycle.hedge_cancels,
            },
            "health": router.lifecycle.health.state(now),
            "router_id": router.router_id,
            "peers": None
            if router.peers is None
            else {
                "routers": router.peers.peers,
                "messages": router.peers.messages,
                "malformed": router.peers.malformed,
                "remote_in_flight": sum(router.peers.remote(n.node_id) for n in view),
                "lag_ms": {q: round(router.peers.lag_quantile(f), 2) for q, f in (("p50", 0.5), ("p99", 0.99))},
            },
            "workflows": {name: runner.stats.as_json() for name, runner in router.workflows.items()},
            "copies": {"loading": sorted(router.lifecycle.copies.loading), "recent": list(router.copies_log)},
            "holds": {
                "held": router.lifecycle.holds,
                "held_ms_total": round(router.lifecycle.held_ms_total, 1),
                "waiting": router.dispatcher.waiting,
            },
        }
    )


def telemetry_summary(store: ViewStore) -> dict[str, Any]:
    return store.summary()


async def status_page(request: web.Request) -> web.Response:
    """A human-readable page: the policy, every node with its freshness and load, telemetry health."""
    router = request.app[ROUTER]
    now = router.clock()
    view = router.lifecycle.tracker.overlay(router.store.view)
    tel = telemetry_summary(router.store)
    rows = "".join(
        "<tr class='{cls}'><td>{id}</td><td>{part}</td><td>{tier}</td><td>{status}</td><td>{age:.0f}</td>"
        "<td>{out}/{cap}</td><td>{models}</td></tr>".format(
            cls="ok" if view.is_fresh(n, now) and n.ready else "bad",
            id=html.escape(n.node_id),
            part=html.escape(n.partition),
            tier=n.load.tier,
            status=n.load.status if view.is_fresh(n, now) else "stale",
            age=view.age_ms(n.node_id, now),
            out=view.outstanding(n),
            cap=n.capacity,
            models=html.escape(", ".join(sorted(n.load.models))),
        )
        for n in sorted(view, key=lambda n: (n.partition, n.node_id))
    )
    page = f"""<!doctype html><html><head><meta charset="utf-8"><meta http-equiv="refresh" content="2">
<title>edgeroute</title><style>body{{font:14px system-ui,sans-serif;margin:2em}}
table{{border-collapse:collapse}}td,th{{padding:4px 10px;border-bottom:1px solid #ddd;text-align:left}}
tr.bad td{{color:#a00}}</style></head><body>
<h1>edgeroute router</h1>
<p>policy <b>{html.escape(router.policies.current.name)}</b> &middot; {len(view)} nodes known,
{len(view.fresh_nodes(now))} fresh (stale after {router.config.stale_after_ms:.0f} ms) &middot;
telemetry {tel["messages"]} messages, {tel["malformed"]} malformed, lag p50 {tel["lag_ms"]["p50"]:.1f} ms
p99 {tel["lag_ms"]["p99"]:.1f} ms</p>
<table><tr><th>node</th><th>partition</th><th>tier</th><th>status</th><th>age ms</th>
<th>outstanding/slots</th><th>models</th></tr>{rows}</table>
<p><a href="/metrics">/metrics</a> &middot; <a href="/admin/view">/admin/view</a> &middot;
<a href="/admin/policy">/admin/policy</a></p></body></html>"""
    return web.Response(text=page, content_type="text/html")


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
    """The router application. Without `source`, telemetry comes from Kafka at `config.kafka`."""
    if source is None:
        if config.kafka is None:
            raise ConfigError("router needs 'kafka' (a bootstrap HOST:PORT) or an explicit telemetry source")
        source = KafkaTelemetrySource(config.kafka, config.topic, config.lookback_ms, config.fetch_max_wait_ms, clock)
    if client is None:
        client = HttpNodeClient(config.pool_per_node, config.connect_timeout_ms / 1000.0)
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=[json_errors, admission])
    app[ROUTER] = Router(config, source, client, clock, config_path)
    app.cleanup_ctx.append(_lifecycle)
    app.cleanup_ctx.append(_peers)
    app.cleanup_ctx.append(_copies)
    app.cleanup_ctx.append(_config_watcher)
    r = app.router
    r.add_get("/v2/health/live", live)
    r.add_get("/v2/health/ready", ready)
    r.add_get("/v2", server_metadata)
    r.add_get("/v2/models/{model}", model_metadata)
    r.add_get("/v2/models/{model}/versions/{version}", model_metadata)
    r.add_get("/v2/models/{model}/ready", model_ready)
    r.add_get("/v2/models/{model}/versions/{version}/ready", model_ready)
    r.add_post("/v2/models/{model}/infer", infer)
    r.add_post("/v2/models/{model}/versions/{version}/infer", infer)
    r.add_post("/v2/repository/index", repository_index)
    r.add_post("/v2/repository/models/{model}/load", repository_load)
    r.add_post("/v2/repository/models/{model}/unload", repository_unload)
    r.add_get("/admin/policy", get_policy)
    r.add_put("/admin/policy", put_policy)
    r.add_get("/admin/view", get_view)
    r.add_get("/admin/links", get_links)
    r.add_put("/admin/links", put_link)
    r.add_get("/metrics", metrics)
    r.add_get("/", status_page)
    return app


async def serve(
    config: RouterConfig,
    stop: asyncio.Event,
    config_path: Path | None = None,
    on_bound: Callable[[int], None] | None = None,
    reuse_port: bool = False,
) -> None:
    app = create_app(config, config_path=config_path)
    runner = web.AppRunner(app, handle_signals=False, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, config.host, config.port, reuse_port=reuse_port or None)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        if on_bound is not None:
            on_bound(port)
        loop = asyncio.get_running_loop()
        with contextlib.suppress(NotImplementedError, RuntimeError):
            import signal

            loop.add_signal_handler(signal.SIGHUP, app[ROUTER].reload_file)
        await stop.wait()
    finally:
        await runner.cleanup()
