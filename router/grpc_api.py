"""The router's gRPC front door: the OIP v2 `inference.GRPCInferenceService` beside its HTTP one.

Each call only adapts gRPC: authentication from the `authorization` metadata (health and server
metadata stay open, as their HTTP routes do; repository load and unload need an admin client), then
the same transport-free core as HTTP: an inference goes through router.director (rate limit, names,
size, hints, policy, lifecycle, deadline: the call's `grpc-timeout`, or an earlier `deadline_ms` /
`timeout` parameter), in its HTTP form (telemetry.oip.grpc.http_body), since the router speaks HTTP
to the nodes; metadata, readiness, configuration, statistics and the repository through router.fleet,
read into Triton's messages. HTTP statuses become gRPC codes (telemetry.oip.grpc.STATUS_CODES).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from aiohttp import web

from router import director, fleet
from router.dataplane.haproxy import KEY_HEADER, PEER_HEADER, vouched
from router.node_client import error_text
from router.state import ROUTER, VERSION, Router
from telemetry.oip import grpc_http1, wire
from telemetry.oip.grpc import (
    BadMessage,
    StreamLimits,
    bearer,
    code_of,
    http_body,
    parameters_of,
    peer_host,
    response_from_body,
    service_handler,
)
from telemetry.oip.triton import EXTENSIONS, from_json, mc, pb


async def _abort(context: Any, status: int, message: str) -> NoReturn:
    await context.abort(code_of(status), message[:1024])
    raise AssertionError("unreachable")  # (context.abort raises)


class RouterService:
    def __init__(self, router: Router) -> None:
        self.router = router

    async def _client(self, context: Any, admin: bool = False) -> str:
        verdict = self.router.auth.check(bearer(context), admin, _peer(self.router, context))
        if verdict.status:
            await _abort(context, verdict.status, verdict.reason)
        return verdict.client

    async def _doc(self, answer: fleet.Answer, context: Any) -> Any:
        """A fleet answer's JSON; an error status aborts the call."""
        if answer.status != 200:
            await _abort(context, answer.status, answer.error)
        try:
            return wire.loads(answer.body)
        except ValueError:
            await _abort(context, 502, "a node answered what is not JSON")

    async def _typed(self, doc: Any, message: Any, context: Any) -> Any:
        try:
            return from_json(doc, message)
        except ValueError as exc:
            await _abort(context, 502, f"a node's answer does not fit {message.DESCRIPTOR.name}: {exc}")

    async def ServerLive(self, request: Any, context: Any) -> Any:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, context: Any) -> Any:
        return pb.ServerReadyResponse(ready=fleet.ready(self.router).status == 200)

    async def ServerMetadata(self, request: Any, context: Any) -> Any:
        return pb.ServerMetadataResponse(name="edgeroute", version=VERSION, extensions=EXTENSIONS)

    async def ModelReady(self, request: Any, context: Any) -> Any:
        await self._client(context)
        answer = await fleet.model_ready(self.router, request.name, request.version or None)
        if answer.status in (200, 400, 503):  # ready, not resident, no ready node: an answer, not an error
            return pb.ModelReadyResponse(ready=answer.status == 200)
        await _abort(context, answer.status, answer.error)

    async def ModelMetadata(self, request: Any, context: Any) -> Any:
        await self._client(context)
        doc = await self._doc(await fleet.model_metadata(self.router, request.name, request.version or None), context)
        if isinstance(doc, dict):
            doc.pop("parameters", None)  # (a workflow's; the message has no such field)
        return await self._typed(doc, pb.ModelMetadataResponse(), context)

    async def ModelConfig(self, request: Any, context: Any) -> Any:
        await self._client(context)
        doc = await self._doc(await fleet.model_config(self.router, request.name, request.version or None), context)
        return pb.ModelConfigResponse(config=await self._typed(doc, mc.ModelConfig(), context))

    async def ModelStatistics(self, request: Any, context: Any) -> Any:
        refused = self.router.limiter.admit(await self._client(context), self.router.clock())
        if refused.status:  # statistics ask every node: the client's rate holds for them too
            await _abort(context, refused.status, refused.reason)
        stats = await fleet.model_stats(self.router, request.name or None, request.version or None)
        if stats.status != 200:
            await _abort(context, stats.status, stats.error)
        return stats.message

    async def RepositoryIndex(self, request: Any, context: Any) -> Any:
        await self._client(context)
        resp = pb.RepositoryIndexResponse()
        for entry in fleet.repository_index(self.router):
            if not request.ready or entry["state"] == "READY":
                resp.models.add(
                    name=entry["name"], version=entry["version"], state=entry["state"], reason=entry.get("reason", "")
                )
        return resp

    async def RepositoryModelLoad(self, request: Any, context: Any) -> Any:
        await self._client(context, admin=True)
        node = parameters_of(request.parameters).get("node")
        status, body = await fleet.repository_load(self.router, request.model_name, node)
        if status != 200:
            await _abort(context, status, str(body.get("error", "load failed")))
        return pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, request: Any, context: Any) -> Any:
        await self._client(context, admin=True)
        status, body = await fleet.repository_unload(self.router, request.model_name)
        if status != 200:
            await _abort(context, status, str(body.get("error", f"unload: {body.get('state', 'failed')}")))
        return pb.RepositoryModelUnloadResponse()

    def stream_client(self, context: Any) -> tuple[int, str, str]:
        """A stream's authentication, before its first message: (status, reason, client)."""
        verdict = self.router.auth.check(bearer(context), False, _peer(self.router, context))
        return verdict.status, verdict.reason, verdict.client

    async def infer_once(self, request: Any, context: Any) -> tuple[int, str, Any]:
        """One inference (telemetry.oip.grpc makes ModelInfer and ModelStreamInfer of it)."""
        router = self.router
        arrived = router.clock()
        verdict = router.auth.check(bearer(context), False, _peer(self.router, context))
        if verdict.status:
            return verdict.status, verdict.reason, None
        model, version = request.model_name, request.model_version or None
        refused = director.admit(router, verdict.client, model)
        if refused is not None:
            context.set_trailing_metadata((("retry-after", refused.headers.get("Retry-After", "1")),))
            return refused.status, refused.reason, None
        try:
            body, head, _ = await http_body(request, router.config.max_body_bytes)
        except BadMessage as exc:
            director.refuse(router, model, exc.status, str(exc), arrived)
            return exc.status, str(exc), None
        refused = director.precheck(router, model, version, len(body), arrived)
        if refused is not None:
            return refused.status, refused.reason, None
        hints = {wire.HEADER_LENGTH: str(head), "Content-Type": "application/octet-stream"}
        tenants = router.lifecycle.tenants.cfg
        tenant_key = tenants.header if tenants is not None else None
        for key, value in context.invocation_metadata() or ():
            # the hints HTTP takes as headers ride as metadata (Triton's clients reserve `priority`
            # as an unsigned parameter: sheddable work says so here); the tenants' header too
            if (key in METADATA_HINTS or key == tenant_key) and isinstance(value, str):
                hints[key] = value[:512]
        remaining = context.time_remaining()  # the call's own deadline: the transport's part of intake
        transport_ms = None if remaining is None else remaining * 1000.0
        call = director.InferCall(model, version, body, hints, verdict.client, arrived, transport_ms, "grpc")
        outcome = await director.infer(router, call)
        if outcome.status != 200:
            retry_after = outcome.headers.get("Retry-After")
            if retry_after is not None:  # (a refusal says when to come back, as HTTP's Retry-After does)
                context.set_trailing_metadata((("retry-after", retry_after),))
            return outcome.status, outcome.reason or error_text(outcome.body), None
        try:
            return 200, "", response_from_body(outcome.body, outcome.headers.get(wire.HEADER_LENGTH))
        except BadMessage as exc:
            return 502, str(exc), None


def _peer(router: Router, context: Any) -> str:
    """The client's address: the call's, or, for a call the native data plane passed on (its key
    proves it), the one the proxy saw (router.dataplane)."""
    dp = router.dataplane
    if dp is not None:
        meta = dict(context.invocation_metadata() or ())
        peer = vouched(dp.key, _text(meta.get(KEY_HEADER)), _text(meta.get(PEER_HEADER)))
        if peer is not None:
            return peer
    return peer_host(context)


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


METADATA_HINTS = frozenset({wire.PRIORITY, wire.DEADLINE_MS, wire.SITE, "traceparent", "tracestate"})


async def proxy_door(router: Router, path: Path) -> grpc_http1.Server | None:
    """The router's ModelInfer over HTTP/1.1 for its proxy (telemetry.oip.grpc_http1: a gRPC call the
    proxy passes on costs the router about what an HTTP request does, where its grpc.aio service costs
    more), on the unix socket `path` in its proxy's private folder. None where it cannot listen: the
    proxy then passes those calls to the gRPC service."""
    c = router.config
    try:
        return await grpc_http1.start_for(RouterService(router), c, c.max_body_bytes, path=str(path))
    except OSError as exc:
        print(f"edgeroute router: the proxy's gRPC calls go to the gRPC service: {exc}", file=sys.stderr, flush=True)
        return None


def add_to(app: web.Application) -> Callable[[Any], None]:
    """A function that puts the router's service on a grpc.aio server."""

    def add(server: Any) -> None:
        router = app[ROUTER]
        server.add_generic_rpc_handlers((service_handler(RouterService(router), StreamLimits.of(router.config)),))

    return add
