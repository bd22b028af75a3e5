"""The Open Inference Protocol v2 handlers: health, metadata, readiness, inference, repository.

authenticate (middleware) -> validate -> admit (size, deadline) -> dispatch (router.dispatch drives the
request lifecycle) -> answer. Every accepted request gets exactly one answer: the node's result, or
`{"error": ...}` with 400 (malformed), 404 (unknown model), 413 (too large), 503 (no capable node) or
504 (deadline passed). A request is parsed once and only as far as routing needs; its body is
forwarded as the bytes that came in.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
import secrets
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from policies.api import RouteRequest
from policies.healthy import Healthy
from policies.pipeline import Pipeline
from router.dispatch import Outcome
from router.node_client import NodeError
from router.state import CLIENT, ROUTER, VERSION, Router
from router.state import json_error as _error
from router.workflows import WorkflowInputError, WorkflowRunner, decode_inputs
from telemetry.cluster.schema import NAME_PATTERN
from telemetry.oip import wire
from telemetry.oip.triton import EXTENSIONS
from telemetry.process.serving import read_body

log = logging.getLogger("edgeroute.router")


def panic_max_age_ms(pipeline: Pipeline) -> float:
    """How old a node's last report may be for the policy to route to it when no node is fresh (its
    `healthy` filter's panic age; 0 when the policy has no panic mode)."""
    for f in pipeline.filters:
        if isinstance(f, Healthy):
            return f.params.panic_max_age_ms
    return 0.0


async def live(request: web.Request) -> web.Response:
    return web.json_response({"live": True})


async def ready(request: web.Request) -> web.Response:
    """Readiness is "can route": some node is fresh, or, when none is, the policy's panic mode still
    routes to nodes heard from within its panic age. A router that has heard of no node is not ready;
    one whose nodes all went briefly quiet stays in the Service, exactly when it should keep serving."""
    router = request.app[ROUTER]
    now = router.clock()
    view = router.store.view
    fresh = len(view.fresh_nodes(now))
    if fresh:
        return web.json_response({"ready": True, "nodes": fresh, "panic": False})
    horizon = panic_max_age_ms(router.policies.current)
    recent = sum(1 for n in view if n.ready and view.age_ms(n.node_id, now) <= horizon)
    body = {"ready": recent > 0, "nodes": 0, "panic": recent > 0, "recent_nodes": recent}
    return web.json_response(body, status=200 if recent else 503)


async def server_metadata(request: web.Request) -> web.Response:
    return web.json_response({"name": "edgeroute", "version": VERSION, "extensions": EXTENSIONS})


def _model_nodes(router: Router, model: str) -> tuple[list[Any], bool]:
    """(fresh ready nodes serving `model`, whether any node at all ever reported it)."""
    view = router.store.view
    nodes = view.models(router.clock()).get(model, [])
    known = bool(nodes) or any(n.serves(model) for n in view)
    return nodes, known


def _unknown_or_unavailable(model: str, known: bool, any_node: bool = True) -> web.Response:
    if known:
        return _error(503, f"no ready node serves model '{model}'")
    if not any_node:
        return _error(503, wire.NO_TELEMETRY_YET, {"Retry-After": "1"})
    return _error(404, f"unknown model '{model}'")


async def _node_get(router: Router, model: str, suffix: str = "") -> tuple[int, bytes] | None:
    """A serving node's answer to `GET /v2/models/{model}{suffix}` (metadata, a version's readiness),
    least busy node first."""
    nodes, _ = _model_nodes(router, model)
    view = router.store.view
    for node in sorted(nodes, key=lambda n: (not ((m := n.model(model)) and m.resident), view.outstanding(n))):
        try:
            reply = await router.client.get(f"{node.endpoint}/v2/models/{model}{suffix}", 2.0)
        except NodeError:
            continue
        if reply.status < 500:
            return reply.status, reply.body
    return None


async def _workflow_metadata(router: Router, runner: WorkflowRunner) -> web.Response:
    """Like an ensemble's: the inputs as the stages' models declare them, outputs named STAGE.OUTPUT."""
    spec = runner.spec
    meta: dict[str, dict[str, Any]] = {}
    for stage in spec.stages:
        got = await _node_get(router, stage.model)
        if got is None or got[0] != 200:
            return _error(503, f"workflow '{spec.name}': no node answered metadata for model '{stage.model}'")
        try:
            meta[stage.name] = wire.loads(got[1])
            if not isinstance(meta[stage.name], dict):
                raise wire.MalformedBody("not an object")
        except wire.MalformedBody:
            return _error(502, f"workflow '{spec.name}': unreadable metadata for model '{stage.model}'")
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
    return await relay(router, model, request.match_info.get("version"), "", "metadata for")


async def relay(router: Router, model: str, version: str | None, tail: str, what: str) -> web.Response:
    """A serving node's answer to `GET /v2/models/{model}[/versions/{version}]{tail}` (metadata,
    configuration), relayed as it came; 404 for an odd version name or an unknown model, 503 when
    no node serves it or none answers."""
    if version is not None and not VERSION_NAME.match(version):
        return _error(404, f"model '{model}' has no version '{version}'")
    nodes, known = _model_nodes(router, model)
    if not nodes:
        return _unknown_or_unavailable(model, known, bool(len(router.store.view)))
    suffix = ("" if version is None else f"/versions/{version}") + tail
    got = await _node_get(router, model, suffix)
    if got is None:
        return _error(503, f"no node answered {what} model '{model}'")
    return web.Response(status=got[0], body=got[1], content_type="application/json")


async def model_ready(request: web.Request) -> web.Response:
    router = request.app[ROUTER]
    model = request.match_info["model"]
    version = request.match_info.get("version")
    runner = router.workflows.get(model)
    if version is not None and (not VERSION_NAME.match(version) or (runner is not None and version != "1")):
        return _error(404, f"model '{model}' has no version '{version}'")
    if runner is not None:
        absent = [m for m in runner.models() if not _model_nodes(router, m)[0]]
        if absent:
            return _error(503, f"workflow '{model}': no ready node serves {', '.join(absent)}")
        return web.json_response({"name": model, "ready": True, "models": runner.models()})
    nodes, known = _model_nodes(router, model)
    if not nodes:
        return _unknown_or_unavailable(model, known, bool(len(router.store.view)))
    if version is not None:  # which versions a node holds is the node's to say (a user's model repository)
        got = await _node_get(router, model, f"/versions/{version}/ready")
        if got is None:
            return _error(503, f"no node answered readiness for model '{model}' version '{version}'")
        return web.Response(status=got[0], body=got[1], content_type="application/json")
    return web.json_response({"name": model, "ready": True, "nodes": len(nodes)})


async def infer(request: web.Request) -> web.Response:
    router = request.app[ROUTER]
    arrived = router.clock()
    model = request.match_info["model"]
    version = request.match_info.get("version")
    if not NAME.match(model) or len(model) > 128 or (version is not None and not NAME.match(version)):
        count(router, "unknown", 0, "none", 400, arrived)
        return _error(400, "model and version names are letters, digits and '.', '_', ':' or '-'")
    cfg = router.config
    if request.content_length is not None and request.content_length > cfg.max_body_bytes:
        count(router, model, 0, "none", 413, arrived)
        return _error(413, f"request body of {request.content_length} bytes exceeds {cfg.max_body_bytes}")
    try:
        body = await read_body(request, router.config.body_timeout_s)
    except web.HTTPRequestEntityTooLarge:
        count(router, model, 0, "none", 413, arrived)
        return _error(413, f"request body exceeds {cfg.max_body_bytes} bytes")
    except web.HTTPException as exc:  # 408 (body too slow), 400 (client gone): counted, then answered
        count(router, model, 0, "none", exc.status, arrived)
        raise
    return await route(router, model, version, body, request.headers, request.get(CLIENT, ""), arrived)


async def route(
    router: Router,
    model: str,
    version: str | None,
    body: bytes,
    hints: Mapping[str, str],
    client: str,
    arrived: float,
) -> web.Response:
    """An inference request read whole (its OIP body; `hints`: its headers, or the gRPC front door's
    equivalent), checked, routed by the policy (or run as a workflow), answered."""
    cfg = router.config
    try:
        doc = _parse_header(body, hints.get(wire.HEADER_LENGTH))
        params = doc.get("parameters")
        params = {} if params is None else params
        if not isinstance(params, dict):
            raise wire.BadHint("'parameters' must be an object")
        priority = wire.priority_hint(hints.get(wire.PRIORITY, params.get("priority")))
        deadline = wire.number_hint(hints.get(wire.DEADLINE_MS, params.get("deadline_ms")), "deadline_ms")
        if deadline is None and params.get("timeout") is not None:
            # Triton clients send their request timeout as `parameters.timeout` in microseconds
            timeout_us = wire.number_hint(params.get("timeout"), "timeout")
            deadline = None if timeout_us is None else timeout_us / 1000.0
        if deadline is not None and deadline <= 0:
            raise wire.BadHint("'deadline_ms' must be positive")
        site = hints.get(wire.SITE, params.get("site"))
        if site is not None and not isinstance(site, str):
            raise wire.BadHint("'site' must be a string")
        if site is None and cfg.auth is not None:  # the site of the client's key
            site = cfg.auth.sites.get(client)
        if site is not None and not _known_site(router, site):
            # sites key per-site state (delay timers, ejection paths): only the fleet's own are taken
            raise wire.BadHint(f"unknown site '{site[:64]}': not a partition of any node, nor an end of a link")
        batch = _batch_of(doc)
    except wire.BadHint as exc:
        count(router, model, 0, "none", 400, arrived)
        return _error(400, str(exc))
    runner = router.workflows.get(model)
    if runner is not None:
        return await _run_workflow(router, runner, hints, body, doc, int(priority or 0), deadline, site, arrived)
    if not router.store.view.serving(model):
        if not len(router.store.view):  # nothing heard yet (broker down or just started): not the client's fault
            count(router, model, int(priority or 0), "none", 503, arrived)
            return _error(503, wire.NO_TELEMETRY_YET, {"Retry-After": "1"})
        count(router, model, int(priority or 0), "none", 404, arrived)
        return _error(404, f"unknown model '{model}'")
    budget = min(deadline if deadline is not None else cfg.default_deadline_ms, cfg.max_deadline_ms)
    req_id = str(doc.get("id") or _new_id())
    prio = int(priority or 0)
    headers = {
        "Content-Type": hints.get("Content-Type", "application/json"),
        wire.PRIORITY: str(prio),
    }
    if wire.HEADER_LENGTH in hints:
        headers[wire.HEADER_LENGTH] = hints[wire.HEADER_LENGTH]
    outcome: Outcome = await router.dispatcher.dispatch(
        RouteRequest(model, prio, budget, site, batch, req_id),
        _infer_path(model, version),
        body,
        headers,
        arrived + budget,
    )
    # counted once the answer is on its way (the next turn of the loop), not before it
    asyncio.get_running_loop().call_soon(_counted, router, model, prio, outcome, arrived)
    out_headers = dict(outcome.headers)
    if outcome.status == 429 and outcome.node == "none":
        router.metrics.early_rejections.labels(model).inc()
    if outcome.status == 429 and "Retry-After" not in out_headers:
        out_headers["Retry-After"] = "1"  # refused early: no node could serve it in time
    out_headers[wire.NODE] = outcome.node
    out_headers[wire.ATTEMPTS] = str(outcome.attempts)
    content_type = out_headers.pop("Content-Type", "application/json").split(";")[0]
    return web.Response(status=outcome.status, body=outcome.body, headers=out_headers, content_type=content_type)


async def _run_workflow(
    router: Router,
    runner: WorkflowRunner,
    hints: Mapping[str, str],
    body: bytes,
    doc: dict[str, Any],
    priority: int,
    deadline: float | None,
    site: str | None,
    arrived: float,
) -> web.Response:
    """A workflow job: every stage routed by the policy, tensors passed between them (router.workflows)."""
    name = runner.spec.name
    header_length = hints.get(wire.HEADER_LENGTH)
    tail = body[int(header_length) :] if header_length is not None else b""
    try:
        inputs = decode_inputs(doc, tail)
        missing = [n for n in runner.spec.inputs if n not in inputs]
        if missing:
            raise WorkflowInputError(f"workflow '{name}' needs input(s) {', '.join(missing)}")
    except WorkflowInputError as exc:
        count(router, name, priority, "none", 400, arrived)
        return _error(400, str(exc))
    budget = min(deadline if deadline is not None else runner.spec.slo_ms, router.config.max_deadline_ms)
    job_id = str(doc.get("id") or _new_id())
    outcome = await runner.run(inputs, priority, budget, site, job_id, arrived, {wire.PRIORITY: str(priority)})
    count(router, name, priority, "workflow", outcome.status, arrived)
    headers = {k: v for k, v in outcome.headers.items() if k.startswith("x-edgeroute-")}
    headers.update({"x-edgeroute-node": outcome.node, wire.WORKFLOW: name})
    if outcome.status == 429:
        headers["Retry-After"] = "1"
    return web.Response(status=outcome.status, body=outcome.body, headers=headers, content_type="application/json")


_ID_PREFIX = secrets.token_hex(4) + "-"  # ids for requests that bring none: unique per process, and cheap
_ids = itertools.count(1)


def _new_id() -> str:
    return f"{_ID_PREFIX}{next(_ids):x}"


PRIORITY_LABELS = range(-100, 101)  # priorities outside are labelled "<-100" / ">100"


NAME = re.compile(NAME_PATTERN)
VERSION_NAME = re.compile(r"^[0-9]{1,9}$")  # model versions are numbers (Triton's repository layout)


def _known_site(router: Router, site: str) -> bool:
    """A partition some node reports, an end of a configured link, or a site given to a client's key."""
    if router.store.view.has_partition(site) or site in router.lifecycle.links.sites:
        return True
    return router.config.auth is not None and site in router.config.auth.sites.values()


def _infer_path(model: str, version: str | None) -> str:
    """The path a request is forwarded on, rebuilt from its validated model and version names (the
    client's own path may carry encoded slashes that would reach other routes at the node)."""
    return f"/v2/models/{model}/infer" if version is None else f"/v2/models/{model}/versions/{version}/infer"


def _counted(router: Router, model: str, prio: int, outcome: Outcome, arrived: float) -> None:
    """An answered inference's metrics: its decisions' times, its retries, the answer."""
    for seconds in router.dispatcher.decision_seconds:
        router.metrics.decision.observe(seconds)
    router.dispatcher.decision_seconds.clear()
    if outcome.attempts > 1:
        router.metrics.retries.labels(model).inc(outcome.attempts - 1)
    count(router, model, prio, outcome.node, outcome.status, arrived, served=True)


def count(
    router: Router, model: str, priority: int, node: str, status: int, arrived: float, served: bool = False
) -> None:
    """Count one answer. Label values come from clients, so they are bounded: a model no node or
    workflow serves is "unknown" (`served`: the caller found nodes serving it), a priority outside
    [-100, 100] is "<-100" or ">100"."""
    outcome = "ok" if status < 400 else str(status)
    if not served and model not in router.workflows and not router.store.view.serving(model):
        model = "unknown"
    prio = str(priority) if priority in PRIORITY_LABELS else (">100" if priority > 0 else "<-100")
    now = router.clock()
    latency_ms = max(0.0, now - arrived)
    router.metrics.requests.labels(model, prio, node, outcome).inc()
    router.metrics.latency.labels(model, prio).observe(latency_ms / 1000)
    router.metrics.recent.add(model, now, latency_ms, status < 400)


def _parse_header(body: bytes, header_length: str | None) -> dict[str, Any]:
    try:
        doc, _ = wire.split_body(body, header_length)
    except wire.MalformedBody as exc:
        raise wire.BadHint(str(exc)) from None
    inputs = doc.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise wire.BadHint("'inputs' must be a non-empty list")
    return doc


def _batch_of(doc: dict[str, Any]) -> int:
    first = doc["inputs"][0]
    shape = first.get("shape") if isinstance(first, dict) else None
    if isinstance(shape, list) and shape and isinstance(shape[0], int) and shape[0] > 0:
        return shape[0]
    return 1
