"""The router's gRPC front door: the OIP v2 `inference.GRPCInferenceService` beside its HTTP one.

A call meets what its HTTP twin meets. Authentication takes the bearer token from `authorization`
metadata (health and server metadata stay open, as their HTTP routes do; repository load and unload
need an admin client); inference is rate-limited per client, then goes through `router.oip.route` in
its HTTP form (telemetry.oip.grpc.http_body): the same checks, policies, admission, lifecycle and
deadline (the call's `grpc-timeout`, or an earlier `deadline_ms`/`timeout` parameter); towards the
nodes the router keeps HTTP. Metadata, readiness, configuration and statistics are answered by the
HTTP handlers themselves (`_Local` carries a call's names to them), their JSON read into Triton's
messages. HTTP statuses become gRPC codes (telemetry.oip.grpc.STATUS_CODES).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, NoReturn

from aiohttp import web

from router import oip, repository, triton
from router.node_client import error_text
from router.state import ROUTER, VERSION, Router
from telemetry.oip import wire
from telemetry.oip.grpc import (
    BadMessage,
    bearer,
    code_of,
    deadline_ms,
    http_body,
    parameters_of,
    response_from_body,
    service_handler,
)
from telemetry.oip.triton import EXTENSIONS, from_json, mc, pb


class _Local:
    """What the router's HTTP handlers for metadata, readiness, configuration and statistics read of a
    request (its app and the names in its path), for a gRPC call answered by them."""

    def __init__(self, app: web.Application, names: dict[str, str]) -> None:
        self.app = app
        self.match_info = names


def _names(model: str, version: str) -> dict[str, str]:
    names = {"model": model} if model else {}
    if version:
        names["version"] = version
    return names


async def _abort(context: Any, status: int, message: str) -> NoReturn:
    await context.abort(code_of(status), message[:1024])
    raise AssertionError("unreachable")  # (context.abort raises)


class RouterService:
    def __init__(self, app: web.Application) -> None:
        self.app = app
        self.router: Router = app[ROUTER]

    async def _client(self, context: Any, admin: bool = False) -> str:
        verdict = self.router.auth.check(bearer(context), admin, str(context.peer())[:128])
        if verdict.status:
            await _abort(context, verdict.status, verdict.reason)
        return verdict.client

    async def _ask(self, handler: Callable[[Any], Awaitable[web.Response]], names: dict[str, str], context: Any) -> Any:
        """The JSON a router HTTP handler answers for these names; an error status aborts the call."""
        await self._client(context)
        answer = await handler(_Local(self.app, names))
        body = answer.body if isinstance(answer.body, bytes) else b""
        if answer.status != 200:
            await _abort(context, answer.status, error_text(body))
        try:
            return wire.loads(body)
        except ValueError:
            await _abort(context, 502, "a node answered what is not JSON")

    async def ServerLive(self, request: Any, context: Any) -> Any:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, context: Any) -> Any:
        answer = await oip.ready(_Local(self.app, {}))  # type: ignore[arg-type]
        return pb.ServerReadyResponse(ready=answer.status == 200)

    async def ServerMetadata(self, request: Any, context: Any) -> Any:
        return pb.ServerMetadataResponse(name="edgeroute", version=VERSION, extensions=EXTENSIONS)

    async def ModelReady(self, request: Any, context: Any) -> Any:
        await self._client(context)
        answer = await oip.model_ready(_Local(self.app, _names(request.name, request.version)))  # type: ignore[arg-type]
        if answer.status in (200, 400, 503):  # ready, not resident, no ready node: an answer, not an error
            return pb.ModelReadyResponse(ready=answer.status == 200)
        await _abort(context, answer.status, error_text(answer.body if isinstance(answer.body, bytes) else b""))

    async def _typed(self, doc: Any, message: Any, context: Any) -> Any:
        try:
            return from_json(doc, message)
        except ValueError as exc:
            await _abort(context, 502, f"a node's answer does not fit {message.DESCRIPTOR.name}: {exc}")

    async def ModelMetadata(self, request: Any, context: Any) -> Any:
        doc = await self._ask(oip.model_metadata, _names(request.name, request.version), context)
        if isinstance(doc, dict):
            doc.pop("parameters", None)  # (a workflow's; the message has no such field)
        return await self._typed(doc, pb.ModelMetadataResponse(), context)

    async def ModelConfig(self, request: Any, context: Any) -> Any:
        doc = await self._ask(triton.model_config, _names(request.name, request.version), context)
        return pb.ModelConfigResponse(config=await self._typed(doc, mc.ModelConfig(), context))

    async def ModelStatistics(self, request: Any, context: Any) -> Any:
        doc = await self._ask(triton.model_stats, _names(request.name, request.version), context)
        return await self._typed(doc, pb.ModelStatisticsResponse(), context)

    async def RepositoryIndex(self, request: Any, context: Any) -> Any:
        await self._client(context)
        resp = pb.RepositoryIndexResponse()
        for entry in repository.index(self.router):
            if not request.ready or entry["state"] == "READY":
                resp.models.add(
                    name=entry["name"], version=entry["version"], state=entry["state"], reason=entry.get("reason", "")
                )
        return resp

    async def RepositoryModelLoad(self, request: Any, context: Any) -> Any:
        await self._client(context, admin=True)
        node = parameters_of(request.parameters).get("node")
        status, body = await repository.load(self.router, request.model_name, node)
        if status != 200:
            await _abort(context, status, str(body.get("error", "load failed")))
        return pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, request: Any, context: Any) -> Any:
        await self._client(context, admin=True)
        status, body = await repository.unload(self.router, request.model_name)
        if status != 200:
            await _abort(context, status, str(body.get("error", f"unload: {body.get('state', 'failed')}")))
        return pb.RepositoryModelUnloadResponse()

    async def infer_once(self, request: Any, context: Any) -> tuple[int, str, Any]:
        """One inference (telemetry.oip.grpc makes ModelInfer and ModelStreamInfer of it)."""
        router = self.router
        arrived = router.clock()
        verdict = router.auth.check(bearer(context), False, str(context.peer())[:128])
        if verdict.status:
            return verdict.status, verdict.reason, None
        model, version = request.model_name, request.model_version or None
        limited = router.limiter.admit(verdict.client, arrived)
        if limited.status:
            oip.count(router, model, 0, "none", 429, arrived)
            return 429, limited.reason, None
        if not oip.NAME.match(model) or len(model) > 128 or (version is not None and not oip.NAME.match(version)):
            oip.count(router, "unknown", 0, "none", 400, arrived)
            return 400, "model and version names are letters, digits and '.', '_', ':' or '-'", None
        try:
            body, head, params = http_body(request)
            budget = deadline_ms(context, params)
        except (BadMessage, wire.BadHint) as exc:
            oip.count(router, model, 0, "none", 400, arrived)
            return 400, str(exc), None
        if len(body) > router.config.max_body_bytes:
            oip.count(router, model, 0, "none", 413, arrived)
            return 413, f"request of {len(body)} bytes exceeds {router.config.max_body_bytes}", None
        hints = {wire.HEADER_LENGTH: str(head), "Content-Type": "application/octet-stream"}
        if budget is not None:
            if budget <= 0:
                return 504, "deadline passed before the router received the request", None
            hints[wire.DEADLINE_MS] = f"{budget:.3f}"
        answer = await oip.route(router, model, version, body, hints, verdict.client, arrived)
        payload = answer.body if isinstance(answer.body, bytes) else b""
        if answer.status != 200:
            return answer.status, error_text(payload), None
        try:
            return 200, "", response_from_body(payload, answer.headers.get(wire.HEADER_LENGTH))
        except BadMessage as exc:
            return 502, str(exc), None


def add_to(app: web.Application) -> Callable[[Any], None]:
    """A function that puts the router's service on a grpc.aio server."""

    def add(server: Any) -> None:
        server.add_generic_rpc_handlers((service_handler(RouterService(app)),))

    return add
