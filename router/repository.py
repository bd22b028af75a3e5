"""The repository extension on the router: the cluster's index, and model load and unload on its nodes.

The HTTP routes (`POST /v2/repository/...`, behind admin auth in the front door) and the gRPC calls
(RepositoryIndex, RepositoryModelLoad, RepositoryModelUnload) do the same work here.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from router.node_client import NodeBadAnswer, NodeError, NodeTimeout, NodeUnavailable, error_text
from router.state import ROUTER, Router
from router.state import json_error as _error
from telemetry.cluster.view import NodeState
from telemetry.oip import wire
from telemetry.process.serving import read_body


def index(router: Router) -> list[dict[str, str]]:
    """The cluster's repository index: every model a node reports and every workflow, READY where warm."""
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

    entries = [{"name": m, "version": "1", **state(m)} for m in names]
    for name, runner in router.workflows.items():
        absent = [m for m in runner.models() if m not in serving]
        entries.append({"name": name, "version": "1", "state": "UNAVAILABLE" if absent else "READY",
                      **({"reason": f"no fresh ready node serves {', '.join(absent)}"} if absent else {})})  # fmt: skip
    return entries


async def repository_index(request: web.Request) -> web.Response:
    return web.json_response(index(request.app[ROUTER]))


def _fresh_serving(router: Router, model: str) -> list[NodeState]:
    now = router.clock()
    return [n for n in router.store.view.serving(model) if n.ready and router.store.view.is_fresh(n, now)]


async def repository_load(request: web.Request) -> web.Response:
    """Cluster `POST /v2/repository/models/{m}/load`: make the model resident on a node.

    Already resident on a fresh node: nothing to do. Otherwise the nodes that serve it are asked in
    order of free memory (or only the node named in `{"parameters": {"node": ID}}`) until one loads it;
    if none does, 502, 503 or 504 (see `_failure`) with each node's answer.
    """
    router = request.app[ROUTER]
    wanted = None
    raw = await read_body(request, router.config.body_timeout_s)
    if raw:
        try:
            doc = wire.loads(raw)
            wanted = (doc.get("parameters") or {}).get("node") if isinstance(doc, dict) else None
        except (ValueError, AttributeError):
            return _error(400, "malformed JSON body")
    status, body = await load(router, request.match_info["model"], wanted)
    return web.json_response(body, status=status)


async def load(router: Router, model: str, wanted: Any = None) -> tuple[int, dict[str, Any]]:
    """`repository_load`'s work: (status, answer body)."""
    nodes = _fresh_serving(router, model)
    if not nodes:
        return 404, {"error": f"no fresh node serves model '{model}'"}
    if wanted is not None:
        nodes = [n for n in nodes if n.node_id == wanted]
        if not nodes:
            return 404, {"error": f"node '{str(wanted)[:128]}' is not a fresh node serving '{model}'"}
    else:
        warm = [n.node_id for n in nodes if (st := n.model(model)) is not None and st.resident]
        if warm:
            return 200, {"name": model, "state": "READY", "nodes": warm}
    # the most free memory first; a node that fails or refuses leaves the load to the next one
    ordered = sorted(nodes, key=lambda n: n.load.memory_used_bytes - n.load.memory_budget_bytes)
    results: dict[str, Any] = {}
    for n in ordered:
        code, body = await _repository_call(router, n, model, "load", 60.0)
        if code == 200:
            return 200, {"name": model, "state": "READY", "nodes": [n.node_id]}
        results[n.node_id] = {"status": code, "error": body}
    return _failure(model, "load", results)


async def repository_unload(request: web.Request) -> web.Response:
    """Cluster `POST /v2/repository/models/{m}/unload`: every node holding it lets it go, all asked at
    once. 200 when all did; 409 when a node still has requests in progress (relayed per node); 502,
    503 or 504 when a node answered badly, could not be reached or did not answer in time."""
    status, body = await unload(request.app[ROUTER], request.match_info["model"])
    return web.json_response(body, status=status)


async def unload(router: Router, model: str) -> tuple[int, dict[str, Any]]:
    """`repository_unload`'s work: (status, answer body)."""
    nodes = _fresh_serving(router, model)
    if not nodes:
        return 404, {"error": f"no fresh node serves model '{model}'"}
    calls = [_repository_call(router, n, model, "unload", 10.0) for n in nodes]
    answers = await asyncio.gather(*calls)
    results = {n.node_id: code for n, (code, _) in zip(nodes, answers, strict=True)}
    if all(code == 200 for code in results.values()):
        return 200, {"name": model, "state": "UNAVAILABLE", "nodes": results}
    failed = {k: {"status": c, "error": e} for k, (c, e) in zip(results, answers, strict=True) if c not in (200, 409)}
    if failed:
        return _failure(model, "unload", failed)
    return 409, {"name": model, "state": "BUSY", "nodes": results}


_CALL_FAILURES = ((NodeUnavailable, 503), (NodeTimeout, 504), (NodeBadAnswer, 502))


async def _repository_call(
    router: Router, node: NodeState, model: str, action: str, timeout_s: float
) -> tuple[int, str]:
    """One node's answer to a repository load or unload: (its status, its error text), or for a call that
    got no usable answer (503 unreachable, 504 no answer in time, 502 a bad answer; the reason)."""
    url = f"{node.endpoint}/v2/repository/models/{model}/{action}"
    try:
        reply = await router.client.post(url, b"{}", {"Content-Type": "application/json"}, timeout_s, admin=True)
    except NodeError as exc:
        code = next((c for kind, c in _CALL_FAILURES if isinstance(exc, kind)), 502)
        return code, str(exc)[:200]
    if reply.status == 200:
        return 200, ""
    return reply.status, error_text(reply.body)[:200]


def _failure(model: str, action: str, results: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """No node did it, each node's answer in the body. Every node refused it (4xx: busy, unknown, no
    room): their verdict, the first node's status; otherwise the gateway status of the failures (504 if
    any timed out, else 503 if any could not be reached, else 502)."""
    codes = [r["status"] for r in results.values()]
    if all(400 <= c < 500 for c in codes):
        status = codes[0]
    else:
        status = 504 if 504 in codes else 503 if 503 in codes else 502
    detail = "; ".join(f"{node}: {r['status']} {r['error']}".strip() for node, r in results.items())
    body = {"error": f"{action} of '{model}' failed on every node tried ({detail})"[:2000], "nodes": results}
    return status, body
