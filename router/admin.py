"""The admin sub-application (`/admin/...`, admin tokens only) and the status page.

Routes: `GET/PUT /admin/policy` (validated, then swapped whole), `GET /admin/view` (nodes, overlay,
health, holds, hedges, moves, copies, workflows), `GET/PUT /admin/links` (cut or restore an emulated
link), `GET/PUT /admin/reroute` (the re-routing settings, validated, then swapped whole), `GET/PUT
/admin/copies` (copy scaling's, the same way),
`GET/PUT /admin/tenants` (the tenants: weights, clients, quotas; validated, then swapped in).
The sub-application has its own authentication middleware: every route needs an admin token when
auth is configured. The status page (`/`) is rendered from `templates/status.html`.
"""

from __future__ import annotations

import asyncio
import contextlib
import html
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from string import Template
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from policies import PolicyConfigError, PolicySpec
from router.canary_app import delete_canary, delete_model_canary, get_canary, put_model_canary, start_from_request
from router.capture_app import get_capture
from router.lifecycle import Lifecycle
from router.lifecycle.copies import CopyConfig, CopyState
from router.lifecycle.reroute import RerouteConfig
from router.lifecycle.tenants import TenantsConfig
from router.state import ROUTER, Router, validate_policy
from router.state import json_error as _error
from telemetry.cluster.store import ViewStore
from telemetry.kafka.signing import Verifier
from telemetry.oip import wire
from telemetry.process.serving import read_body
from telemetry.process.settings import first_error

VIEW_RECOUNT_S = 1.0  # how long /admin/view waits for the data plane's counts as of now

log = logging.getLogger("edgeroute.router")


async def get_policy(request: web.Request) -> web.Response:
    router = request.app[ROUTER]
    spec = router.policies.spec
    body = spec.model_dump(exclude_none=True) if isinstance(spec, PolicySpec) else {}
    return web.json_response(
        {"name": router.policies.current.name, "spec": body, "state": router.policies.current.state()}
    )


MAX_POLICY_BYTES = 64 << 10  # a policy spec is a few hundred bytes; a 6 MB one held the loop for 10 s


async def put_policy(request: web.Request) -> web.Response:
    """Replace the policy: a body of at most `MAX_POLICY_BYTES` (413), parsed and validated in a worker
    thread (the event loop keeps serving meanwhile), then swapped in on the loop."""
    router = request.app[ROUTER]
    if request.content_length is not None and request.content_length > MAX_POLICY_BYTES:
        return _error(413, f"a policy spec is at most {MAX_POLICY_BYTES} bytes")
    body = await read_body(request, router.config.body_timeout_s)
    if len(body) > MAX_POLICY_BYTES:
        return _error(413, f"a policy spec is at most {MAX_POLICY_BYTES} bytes")
    try:
        raw = wire.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        return _error(400, str(exc))
    if isinstance(raw, dict) and "canary" in raw:  # a candidate on a share of traffic (router.canary_app)
        if len(raw) != 1:
            return _error(400, 'a canary is {"canary": {...}} alone')
        return await start_from_request(request, raw["canary"])
    try:
        spec, policy = await asyncio.to_thread(validate_policy, raw)
    except PolicyConfigError as exc:
        router.policy_rejected("PUT /admin/policy", exc)
        return _error(400, f"policy rejected, keeping '{router.policies.current.name}': {exc}")
    router.apply_policy(spec, policy, "PUT /admin/policy")
    return web.json_response({"name": router.policies.current.name, "spec": spec.model_dump(exclude_none=True)})


async def get_links(request: web.Request) -> web.Response:
    return web.json_response(request.app[ROUTER].lifecycle.links.as_json())


async def put_link(request: web.Request) -> web.Response:
    """`{"a": A, "b": B, "cut": bool}`: cut or restore an emulated link (fault injection)."""
    router = request.app[ROUTER]
    try:
        doc = wire.loads(await read_body(request, router.config.body_timeout_s))
        a, b, cut = str(doc["a"]), str(doc["b"]), bool(doc["cut"])
    except (ValueError, KeyError, TypeError):
        return _error(400, 'body must be {"a": partition, "b": partition, "cut": bool}')
    try:
        router.lifecycle.set_link(a, b, cut)
    except KeyError as exc:
        return _error(404, str(exc.args[0]))
    log.warning("link %s-%s %s", a, b, "cut" if cut else "restored")
    return web.json_response(router.lifecycle.links.as_json())


async def get_reroute(request: web.Request) -> web.Response:
    return web.json_response(request.app[ROUTER].lifecycle.reroute.as_json())


async def put_reroute(request: web.Request) -> web.Response:
    """The whole `reroute` section (router.lifecycle.reroute.RerouteConfig); unknown keys are a 400."""
    router = request.app[ROUTER]
    try:
        cfg = RerouteConfig.model_validate(wire.loads(await read_body(request, router.config.body_timeout_s)))
    except (ValueError, UnicodeDecodeError) as exc:
        return _error(400, f"reroute settings rejected: {str(exc).splitlines()[0]}")
    router.lifecycle.set_reroute(cfg)
    log.info("reroute settings applied: %s", cfg.model_dump())
    return web.json_response(router.lifecycle.reroute.as_json())


async def get_copies(request: web.Request) -> web.Response:
    copies = request.app[ROUTER].lifecycle.copies
    return web.json_response({**copies.cfg.model_dump(), "made": copies.made, "loading": copies.loading})


async def put_copies(request: web.Request) -> web.Response:
    """The whole `copies` section (router.lifecycle.copies.CopyConfig), swapped in with a fresh demand
    meter (a replay's policy runs turn copy scaling on and off); unknown keys are a 400."""
    router = request.app[ROUTER]
    try:
        cfg = CopyConfig.model_validate(wire.loads(await read_body(request, router.config.body_timeout_s)))
    except (ValueError, UnicodeDecodeError) as exc:
        return _error(400, f"copies settings rejected: {str(exc).splitlines()[0]}")
    router.lifecycle.copies = CopyState(cfg)
    log.info("copies settings applied: %s", cfg.model_dump())
    return await get_copies(request)


async def get_tenants(request: web.Request) -> web.Response:
    router = request.app[ROUTER]
    tenants = router.lifecycle.tenants
    if not tenants.enabled:
        return web.json_response({"enabled": False})
    cfg = tenants.cfg.model_dump() if tenants.cfg is not None else None
    return web.json_response({"enabled": True, "config": cfg, **tenants.as_json(router.clock())})


async def put_tenants(request: web.Request) -> web.Response:
    """The whole `tenants` section (router.lifecycle.tenants.TenantsConfig), swapped in live: tenants
    still configured keep their buckets, counts and requests in flight. A mistake is a 400 with the
    field named, and the tenants as they were."""
    router = request.app[ROUTER]
    try:
        cfg = TenantsConfig.model_validate(wire.loads(await read_body(request, router.config.body_timeout_s)))
    except (ValueError, UnicodeDecodeError) as exc:
        return _error(400, f"tenants rejected: {_first_error(exc)}")
    router.lifecycle.tenants.configure(cfg)
    log.info("tenants applied: %d named, default %s", len(cfg.named), cfg.default)
    return await get_tenants(request)


def _first_error(exc: Exception) -> str:
    return first_error(exc, "tenants") if isinstance(exc, ValidationError) else str(exc).splitlines()[0]


def _scaling_json(router: Router, now: float) -> list[dict[str, Any]] | None:
    """Each pool's scaling signal (router.lifecycle.scaling), as the metric gives it."""
    lc, cfg = router.lifecycle, router.config.scaling
    if lc.demand is None or cfg is None:
        return None
    from dataclasses import asdict

    from router.lifecycle.scaling import signals

    return [asdict(s) for s in signals(lc.store.view, lc.demand, cfg, now)]


def _cascades_json(router: Any) -> dict[str, Any]:
    return {
        name: {
            "mode": runner.spec.mode,
            "results": dict(runner.stats.by_result),
            "audits": runner.stats.audits,
            "audits_agreed": runner.stats.audits_agreed,
            "wan_bytes": runner.stats.wan_bytes,
        }
        for name, runner in router.cascades.items()
    }


async def get_cascades(request: web.Request) -> web.Response:
    return web.json_response(_cascades_json(request.app[ROUTER]))


async def put_cascades(request: web.Request) -> web.Response:
    """`{"mode": "cascade" | "first_only" | "second_only"}` for every cascade (comparing a cascade with
    its halves on one running stack); the counts start again."""
    router = request.app[ROUTER]
    try:
        doc = wire.loads(await read_body(request, router.config.body_timeout_s))
        mode = doc.get("mode") if isinstance(doc, dict) else None
        if mode not in ("cascade", "first_only", "second_only"):
            raise ValueError("'mode' is cascade, first_only or second_only")
    except (ValueError, UnicodeDecodeError) as exc:
        return _error(400, f"cascade mode rejected: {str(exc).splitlines()[0]}")
    for name, runner in list(router.cascades.items()):
        router.cascades[name] = type(runner)(
            runner.spec.model_copy(update={"mode": mode}), runner.dispatcher, runner.clock, router.config.seed
        )
    log.info("cascade mode %s applied", mode)
    return web.json_response(_cascades_json(router))


async def get_view(request: web.Request) -> web.Response:
    router = request.app[ROUTER]
    if router.dataplane is not None and router.dataplane.proxy is not None:  # (its counts as of now)
        with contextlib.suppress(OSError, TimeoutError, ValueError, RuntimeError):  # (DataPlaneError too)
            await asyncio.wait_for(router.dataplane.recount(), VIEW_RECOUNT_S)
    now = router.clock()
    view = router.lifecycle.tracker.overlay(router.store.view)
    health = router.lifecycle.health
    ejected: dict[str, list[str | None]] = {}
    for path in health.state(now)["ejected_now"]:
        ejected.setdefault(path["node"], []).append(path["site"])
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
                    "queued": sum(n.load.queued_by_priority.values()),
                    "in_flight": n.load.in_flight,
                    "models": sorted(n.load.models),
                    "resident": sorted(m for m, ml in n.load.models.items() if ml.resident),
                    "cold": sorted(m for m, ml in n.load.models.items() if not ml.resident),
                    "device": n.load.device.summary(),
                    "utilisation": round(n.load.utilisation, 3),
                    "memory": {"used": n.load.memory_used_bytes, "budget": n.load.memory_budget_bytes},
                    "ejected_for": sorted(site or "" for site in ejected.get(n.node_id, ())),
                    "slow_start": round(health.weight(None, n, now), 3),
                    # how the router knows it: fresh telemetry, its own evidence (answers, probes), out
                    **router.lifecycle.evidence.state(view, n, now),
                }
                for n in sorted(view, key=lambda n: (n.partition, n.node_id))
            ],
            "models": router.metrics.recent.summary(now),
            "policy": {"name": router.policies.current.name, "state": router.policies.current.state()},
            "telemetry": telemetry_summary(router.store, router.verifier),
            "hedging": {
                "sent": router.lifecycle.hedges_sent,
                "won": router.lifecycle.hedge_wins,
                "cancelled": router.lifecycle.hedge_cancels,
            },
            "reroute": router.lifecycle.reroute.as_json(),
            "overload": {
                **overload_summary(router.lifecycle, request.query.get("since_s")),
                "saturation": {
                    "lag_ms": round(router.saturation.lag_ms, 2),
                    "busy": round(router.saturation.busy, 3),
                    "shed_share": round(router.saturation.shed_share, 2),
                    "bulk_share": round(router.saturation.bulk_share, 2),
                    "refused": router.saturation.refused,
                    "refused_early": router.saturation.refused_early,
                    "in_flight": router.saturation.in_flight,
                },
            },
            "health": router.lifecycle.health.state(now),
            "router_id": router.router_id,
            "peers": None
            if router.peers is None
            else {
                "routers": router.peers.peers,
                "messages": router.peers.messages,
                "malformed": router.peers.malformed,
                "over_capacity": router.peers.over_capacity,
                "remote_in_flight": sum(router.peers.remote(n.node_id) for n in view),
                "lag_ms": {q: round(router.peers.lag_quantile(f), 2) for q, f in (("p50", 0.5), ("p99", 0.99))},
            },
            "workflows": {name: runner.stats.as_json() for name, runner in router.workflows.items()},
            "cascades": _cascades_json(router),
            "copies": {"loading": sorted(router.lifecycle.copies.loading), "recent": list(router.copies_log)},
            "canary": router.canaries.state(),
            "tenants": router.lifecycle.tenants.as_json(now) if router.lifecycle.tenants.enabled else None,
            "scaling": _scaling_json(router, now),
            "holds": {
                "held": router.lifecycle.holds,
                "refused": router.lifecycle.hold_refusals,
                "held_ms_total": round(router.lifecycle.held_ms_total, 1),
                "waiting": router.dispatcher.waiting,
            },
            "data_plane": None if router.dataplane is None else router.dataplane.state(),
        }
    )


def overload_summary(lc: Lifecycle[Any], since_s: str | None) -> dict[str, Any]:
    """The answer margin and retry budget; with `?since_s=` (epoch seconds), the worst window of the
    budget since then (a replay asks for its own run's)."""
    if since_s is None:
        return lc.overload_summary()
    try:
        since = int(float(since_s))
    except (ValueError, OverflowError):
        return lc.overload_summary()
    now_s = int(time.time())
    return lc.overload_summary((max(since, now_s - 3600), now_s))


def telemetry_summary(store: ViewStore, verifier: Verifier | None = None) -> dict[str, Any]:
    """The store's counts, and the signature checks where messages are verified."""
    out = store.summary()
    if verifier is not None:
        out["signatures"] = verifier.summary()
    return out


_STATUS = Template((Path(__file__).parent / "templates" / "status.html").read_text())


async def status_page(request: web.Request) -> web.Response:
    """The status page: a static document whose script reads `/admin/view` every 2 s and updates in
    place (with auth on, it asks for an admin token, or takes one from the URL fragment)."""
    router = request.app[ROUTER]
    page = _STATUS.safe_substitute(policy=html.escape(router.policies.current.name))
    return web.Response(text=page, content_type="text/html", headers={"Cache-Control": "no-store"})


@web.middleware
async def admin_auth(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Every admin route needs an admin token (when auth is configured)."""
    router = request.app[ROUTER]
    verdict = router.auth.check(request.headers.get("Authorization"), True, request.remote or "unknown")
    if verdict.status:
        headers = {"WWW-Authenticate": "Bearer"} if verdict.status == 401 else None
        return _error(verdict.status, verdict.reason, headers)
    return await handler(request)


def create_admin_app(router: Router) -> web.Application:
    """The `/admin` sub-application, sharing the main app's `Router`."""
    sub = web.Application(middlewares=[admin_auth])
    sub[ROUTER] = router
    r = sub.router
    r.add_get("/policy", get_policy)
    r.add_put("/policy", put_policy)
    r.add_get("/view", get_view)
    r.add_get("/links", get_links)
    r.add_put("/links", put_link)
    r.add_get("/reroute", get_reroute)
    r.add_put("/reroute", put_reroute)
    r.add_get("/copies", get_copies)
    r.add_put("/copies", put_copies)
    r.add_get("/tenants", get_tenants)
    r.add_put("/tenants", put_tenants)
    r.add_get("/cascades", get_cascades)
    r.add_get("/capture", get_capture)
    r.add_get("/canary", get_canary)
    r.add_delete("/canary", delete_canary)
    r.add_put("/canary/models/{model}", put_model_canary)
    r.add_delete("/canary/models/{model}", delete_model_canary)
    r.add_put("/cascades", put_cascades)
    return sub
