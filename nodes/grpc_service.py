"""The node's gRPC front door: the OIP v2 `inference.GRPCInferenceService` beside its HTTP one.

Everything a call asks runs the code its HTTP twin runs: metadata, readiness, configuration and
statistics through nodes.describe; inference through nodes.inference, the node's one path (the
request read in its HTTP form, telemetry.oip.grpc.http_form; the deadline the call's `grpc-timeout`
or a `deadline_ms`/`timeout` parameter); the admin check of nodes.inference. The repository calls need
the node's admin token as `authorization: Bearer <token>` metadata, as the HTTP routes do.
Shared-memory, trace and log settings are not offered (UNIMPLEMENTED, as a server without them answers).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, NoReturn

from nodes.describe import Unanswerable, config, metadata, served, statistics
from nodes.inference import Decoded, Done, Refused, admin_refusal, infer, load_or_refuse
from nodes.protocol import InferRequest, decode_request
from nodes.runtime import LoadedModel
from nodes.state import VERSION, NodeRuntime
from telemetry.oip import wire
from telemetry.oip.grpc import (
    BadMessage,
    StreamLimits,
    bearer,
    code_of,
    deadline_ms,
    http_form_off_loop,
    peer_host,
    response_from_arrays,
    service_handler,
)
from telemetry.oip.triton import EXTENSIONS, pb
from telemetry.process import tracing


async def _abort(context: Any, status: int, message: str) -> NoReturn:
    await context.abort(code_of(status), message[:1024])
    raise AssertionError("unreachable")  # (context.abort raises)


class NodeService:
    def __init__(self, rt: NodeRuntime) -> None:
        self.rt = rt

    async def ServerLive(self, request: Any, context: Any) -> Any:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, context: Any) -> Any:
        return pb.ServerReadyResponse(ready=not self.rt.draining)

    async def ServerMetadata(self, request: Any, context: Any) -> Any:
        return pb.ServerMetadataResponse(name="edgeroute-node", version=VERSION, extensions=EXTENSIONS)

    async def _served(self, context: Any, model: str, version: str) -> str:
        try:
            return served(self.rt, model, version or None)
        except Unanswerable as exc:
            await _abort(context, exc.status, exc.message)

    async def ModelReady(self, request: Any, context: Any) -> Any:
        name = await self._served(context, request.name, request.version)
        return pb.ModelReadyResponse(ready=name in self.rt.models)

    async def ModelMetadata(self, request: Any, context: Any) -> Any:
        name = await self._served(context, request.name, request.version)
        try:
            doc = await metadata(self.rt, name, versioned=bool(request.version))
        except Unanswerable as exc:
            await _abort(context, exc.status, exc.message)
        resp = pb.ModelMetadataResponse(name=doc["name"], versions=doc["versions"], platform=doc["platform"])
        for kind, tensors in (("inputs", doc["inputs"]), ("outputs", doc["outputs"])):
            for t in tensors:
                getattr(resp, kind).add(name=t["name"], datatype=t["datatype"], shape=t["shape"])
        return resp

    async def ModelConfig(self, request: Any, context: Any) -> Any:
        name = await self._served(context, request.name, request.version)
        try:
            return pb.ModelConfigResponse(config=await config(self.rt, name))
        except Unanswerable as exc:
            await _abort(context, exc.status, exc.message)

    async def ModelStatistics(self, request: Any, context: Any) -> Any:
        try:
            return statistics(self.rt, request.name or None, request.version or None)
        except Unanswerable as exc:
            await _abort(context, exc.status, exc.message)

    async def _admin(self, context: Any) -> None:
        refusal = admin_refusal(self.rt.config.admin_token, bearer(context))
        if refusal is not None:
            await _abort(context, *refusal)

    async def RepositoryIndex(self, request: Any, context: Any) -> Any:
        await self._admin(context)
        index = await asyncio.get_running_loop().run_in_executor(None, self.rt.repository_index)
        resp = pb.RepositoryIndexResponse()
        for entry in index:
            if request.ready and entry.get("state") != "READY":
                continue
            resp.models.add(
                name=entry["name"], version=entry["version"], state=entry["state"], reason=entry.get("reason", "")
            )
        return resp

    async def RepositoryModelLoad(self, request: Any, context: Any) -> Any:
        await self._admin(context)
        name = await self._served(context, request.model_name, "")
        loaded = await load_or_refuse(self.rt, name, retry=True)
        if isinstance(loaded, Done):
            await _abort(context, loaded.status, loaded.reason)
        return pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, request: Any, context: Any) -> Any:
        await self._admin(context)
        name = await self._served(context, request.model_name, "")
        busy = await self.rt.unload(name)
        if busy:
            await _abort(context, 409, f"model '{name}' has {busy} request(s) in progress")
        return pb.RepositoryModelUnloadResponse()

    def stream_client(self, context: Any) -> tuple[int, str, str]:
        """A stream's admission before its first message (the inference token, as over HTTP):
        (0 or the refusal's status, its reason, the calling host)."""
        refusal = admin_refusal(self.rt.config.infer_token, bearer(context), "inference")
        if refusal is not None:
            return refusal[0], refusal[1], peer_host(context)
        return 0, "", peer_host(context)

    async def infer_once(self, request: Any, context: Any) -> tuple[int, str, Any]:
        """One inference over nodes.inference (telemetry.oip.grpc makes ModelInfer and ModelStreamInfer
        of it): (status, error message, response or None). Priority and deadline from the request's
        parameters, the deadline also from the call's own (`grpc-timeout`), the earlier of the two."""
        arrived = time.perf_counter()
        token = self.rt.config.infer_token
        if token is not None:
            refusal = admin_refusal(token, bearer(context), "inference")
            if refusal is not None:
                return refusal[0], refusal[1], None

        async def decode(model: LoadedModel) -> Decoded:
            try:
                doc, tail = await http_form_off_loop(request, self.rt.config.max_body_bytes)
            except BadMessage as exc:
                raise Refused(str(exc), exc.status) from None
            req = decode_request(doc, tail, model.inputs, model.output_names)
            params = req.parameters
            # the hints HTTP takes as headers ride as metadata, as the router's gRPC door reads them
            priority = wire.priority_hint(hints.get(wire.PRIORITY, params.get("priority"))) or 0
            return Decoded(req, priority, deadline_ms(context, params, hints.get(wire.DEADLINE_MS)))

        hints = {k: v for k, v in context.invocation_metadata() or () if k in HINTS and isinstance(v, str)}
        carrier = dict(context.invocation_metadata() or ()) if tracing.TRACER is not None else None
        done = await infer(
            self.rt, request.model_name, request.model_version or None, decode, _encode, None, arrived, carrier
        )
        if done.status != 200 or done.payload is None:
            return done.status, done.reason, None
        return 200, "", done.payload


HINTS = frozenset({wire.PRIORITY, wire.DEADLINE_MS})


def _encode(model: LoadedModel, req: InferRequest, outputs: dict[str, Any]) -> Any:
    named = [(n, model.outputs[n].datatype, outputs[n]) for n in req.outputs]
    return response_from_arrays(model.served_name, model.version, req.id, named)


def add_to(rt: NodeRuntime) -> Any:
    """A function that puts the node's service on a grpc.aio server."""

    def add(server: Any) -> None:
        server.add_generic_rpc_handlers((service_handler(NodeService(rt), StreamLimits.of(rt.config)),))

    return add


__all__ = ["NodeService", "add_to"]
