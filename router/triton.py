"""Triton's model configuration and statistics extensions on the router.

- `GET /v2/models/{m}[/versions/{v}]/config`: the configuration a serving node answers (least busy,
  model resident first), relayed as it came, like the model's metadata.
- `GET /v2/models[/{m}[/versions/{v}]]/stats`: the fleet's statistics, the sum over every fresh node
  that serves the model (telemetry.oip.triton.merge_statistics): counts and durations added, the latest
  `last_inference`. A node's answer is hostile input: read against Triton's schema with a size bound,
  and a node that does not answer, or answers what does not fit, is left out and named in the
  `Edgeroute-Stats-Missing` header.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from router.node_client import NodeError
from router.oip import VERSION_NAME, _model_nodes, _unknown_or_unavailable, relay
from router.state import ROUTER, Router
from router.state import json_error as _error
from telemetry.cluster.view import NodeState
from telemetry.oip import wire
from telemetry.oip.triton import from_json, merge_statistics, pb, to_json

STATS_TIMEOUT_S = 2.0
MISSING = "Edgeroute-Stats-Missing"


async def model_config(request: web.Request) -> web.Response:
    router = request.app[ROUTER]
    model = request.match_info["model"]
    if router.workflows.get(model) is not None:
        return _error(404, f"'{model}' is a workflow of this router; it has no Triton model configuration")
    return await relay(router, model, request.match_info.get("version"), "/config", "the configuration of")


def _holders(router: Router, model: str | None) -> list[NodeState]:
    """Fresh ready nodes that serve `model` (any version of it), or every fresh ready node."""
    nodes = router.store.view.fresh_nodes(router.clock())
    if model is None:
        return [n for n in nodes if n.ready]
    versioned = f"{model}:"
    return [n for n in nodes if n.ready and any(m == model or m.startswith(versioned) for m in n.load.models)]


async def _node_stats(router: Router, node: NodeState, path: str) -> Any | None:
    try:
        reply = await router.client.get(f"{node.endpoint}{path}", STATS_TIMEOUT_S)
        if reply.status != 200:
            return None
        return from_json(wire.loads(reply.body), pb.ModelStatisticsResponse())
    except (NodeError, ValueError):
        return None


async def model_stats(request: web.Request) -> web.Response:
    router = request.app[ROUTER]
    model = request.match_info.get("model")
    version = request.match_info.get("version")
    if model is not None and router.workflows.get(model) is not None:
        return _error(404, f"'{model}' is a workflow of this router; its models have statistics of their own")
    if version is not None and not VERSION_NAME.match(version):
        return _error(404, f"model '{model}' has no version '{version}'")
    nodes = _holders(router, model)
    if model is not None and not nodes:
        _, known = _model_nodes(router, model)
        return _unknown_or_unavailable(model, known, bool(len(router.store.view)))
    path = "/v2/models/stats"
    if model is not None:
        path = f"/v2/models/{model}" + ("" if version is None else f"/versions/{version}") + "/stats"
    answers = await asyncio.gather(*(_node_stats(router, n, path) for n in nodes))
    merged = merge_statistics([a for a in answers if a is not None])
    missing = [n.node_id for n, a in zip(nodes, answers, strict=True) if a is None]
    if model is not None and not merged.model_stats:
        return _error(503 if missing else 404, f"no node answered statistics for model '{model}'")
    headers = {MISSING: ",".join(missing)[:1024]} if missing else None
    return web.json_response(to_json(merged), headers=headers)


def add_routes(app: web.Application) -> None:
    """Before the model metadata route (`/v2/models/stats` is not a model's metadata)."""
    r = app.router
    r.add_get("/v2/models/stats", model_stats)
    r.add_get("/v2/models/{model}/config", model_config)
    r.add_get("/v2/models/{model}/versions/{version}/config", model_config)
    r.add_get("/v2/models/{model}/stats", model_stats)
    r.add_get("/v2/models/{model}/versions/{version}/stats", model_stats)
