"""The router's HTTP front door: the Open Inference Protocol v2 routes (KServe v2, as Triton serves
them) with Triton's configuration, statistics and repository extensions.

Each handler only adapts HTTP: it reads what the request carries (path names, headers, the body, read
once within the size and time bounds) and turns the transport-free result of router.director (an
inference's `Outcome`) or router.fleet (an `Answer`, `Stats`) into a response. Authentication and the
rate limit run before (router.app.front_door); every error is `{"error": ...}` with its status.
"""

from __future__ import annotations

from aiohttp import web

from router import director, fleet
from router.dispatch import Outcome
from router.state import CLIENT, ROUTER, VERSION, Router
from router.state import json_error as _error
from telemetry.oip import wire
from telemetry.oip.triton import EXTENSIONS, to_json
from telemetry.process.serving import read_body

STATS_MISSING = "Edgeroute-Stats-Missing"


def respond(answer: fleet.Answer) -> web.Response:
    """A fleet answer as HTTP: its JSON body (a node's as it came), or the router's own error."""
    if not answer.body:
        return _error(answer.status, answer.error, dict(answer.headers) or None)
    return web.Response(status=answer.status, body=answer.body, headers=answer.headers, content_type="application/json")


def outcome_response(outcome: Outcome) -> web.Response:
    headers = dict(outcome.headers)
    content_type = headers.pop("Content-Type", "application/json")
    return web.Response(status=outcome.status, body=outcome.body, headers=headers, content_type=content_type)


async def live(request: web.Request) -> web.Response:
    return web.json_response({"live": True})


async def ready(request: web.Request) -> web.Response:
    return respond(fleet.ready(request.app[ROUTER]))


async def server_metadata(request: web.Request) -> web.Response:
    return web.json_response({"name": "edgeroute", "version": VERSION, "extensions": EXTENSIONS})


async def model_metadata(request: web.Request) -> web.Response:
    info = request.match_info
    return respond(await fleet.model_metadata(request.app[ROUTER], info["model"], info.get("version")))


async def model_ready(request: web.Request) -> web.Response:
    info = request.match_info
    return respond(await fleet.model_ready(request.app[ROUTER], info["model"], info.get("version")))


async def model_config(request: web.Request) -> web.Response:
    info = request.match_info
    return respond(await fleet.model_config(request.app[ROUTER], info["model"], info.get("version")))


async def model_stats(request: web.Request) -> web.Response:
    info = request.match_info
    stats = await fleet.model_stats(request.app[ROUTER], info.get("model"), info.get("version"))
    if stats.status != 200:
        return _error(stats.status, stats.error)
    headers = {STATS_MISSING: ",".join(stats.missing)[:1024]} if stats.missing else None
    return web.json_response(to_json(stats.message), headers=headers)


async def infer(request: web.Request) -> web.Response:
    router = request.app[ROUTER]
    arrived = router.clock()
    info = request.match_info
    model, version = info["model"], info.get("version")
    refused = director.precheck(router, model, version, request.content_length, arrived)
    if refused is not None:
        return outcome_response(refused)
    try:
        body = await read_body(request, router.config.body_timeout_s)
    except web.HTTPRequestEntityTooLarge:
        limit = router.config.max_body_bytes
        return outcome_response(director.refuse(router, model, 413, f"request body exceeds {limit} bytes", arrived))
    except web.HTTPException as exc:  # 408 (body too slow), 400 (client gone): counted, then answered
        director.count(router, model, 0, "none", exc.status, arrived)
        raise
    subject = _certificate_tenant(request, router)
    call = director.InferCall(model, version, body, request.headers, request.get(CLIENT, ""), arrived, subject=subject)
    return outcome_response(await director.infer(router, call))


def _certificate_tenant(request: web.Request, router: Router) -> str | None:
    """The verified client certificate's subject field that names tenants (`tenants.from_certificate`),
    where the connection has one (mTLS: the server required and checked it); else None."""
    tenants = router.lifecycle.tenants.cfg
    if tenants is None or tenants.from_certificate is None or request.transport is None:
        return None
    cert = request.transport.get_extra_info("peercert")
    field = {"O": "organizationName", "OU": "organizationalUnitName", "CN": "commonName"}[tenants.from_certificate]
    for rdn in (cert or {}).get("subject", ()):
        for key, value in rdn:
            if key == field and isinstance(value, str):
                return value[:64]
    return None


async def repository_index(request: web.Request) -> web.Response:
    return web.json_response(fleet.repository_index(request.app[ROUTER]))


async def repository_load(request: web.Request) -> web.Response:
    """Cluster `POST /v2/repository/models/{m}/load`; `{"parameters": {"node": ID}}` names the node."""
    router = request.app[ROUTER]
    wanted = None
    raw = await read_body(request, router.config.body_timeout_s)
    if raw:
        try:
            doc = wire.loads(raw)
            wanted = (doc.get("parameters") or {}).get("node") if isinstance(doc, dict) else None
        except (ValueError, AttributeError):
            return _error(400, "malformed JSON body")
    status, body = await fleet.repository_load(router, request.match_info["model"], wanted)
    return web.json_response(body, status=status)


async def repository_unload(request: web.Request) -> web.Response:
    """Cluster `POST /v2/repository/models/{m}/unload`."""
    status, body = await fleet.repository_unload(request.app[ROUTER], request.match_info["model"])
    return web.json_response(body, status=status)


def add_routes(app: web.Application) -> None:
    """The OIP routes; inference first: aiohttp tries the routes under one prefix (`/v2/models`) in the
    order they were added, and an inference request met eight others before its own (resolving took
    4.7 us, now 1.8). `/v2/models/stats` before the metadata route (it is not a model's metadata)."""
    r = app.router
    r.add_post("/v2/models/{model}/infer", infer)
    r.add_post("/v2/models/{model}/versions/{version}/infer", infer)
    r.add_get("/v2/health/live", live)
    r.add_get("/v2/health/ready", ready)
    r.add_get("/v2", server_metadata)
    r.add_get("/v2/models/stats", model_stats)
    r.add_get("/v2/models/{model}/config", model_config)
    r.add_get("/v2/models/{model}/versions/{version}/config", model_config)
    r.add_get("/v2/models/{model}/stats", model_stats)
    r.add_get("/v2/models/{model}/versions/{version}/stats", model_stats)
    r.add_get("/v2/models/{model}", model_metadata)
    r.add_get("/v2/models/{model}/versions/{version}", model_metadata)
    r.add_get("/v2/models/{model}/ready", model_ready)
    r.add_get("/v2/models/{model}/versions/{version}/ready", model_ready)
    r.add_post("/v2/repository/index", repository_index)
    r.add_post("/v2/repository/models/{model}/load", repository_load)
    r.add_post("/v2/repository/models/{model}/unload", repository_unload)
