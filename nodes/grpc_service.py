"""The node's gRPC front door: the OIP v2 `inference.GRPCInferenceService` beside its HTTP one.

Everything a call asks runs the code its HTTP twin runs: metadata, readiness, configuration and
statistics through nodes.describe; inference through the same decoding and checks (the request in
its HTTP form, telemetry.oip.grpc.http_form), the same admission, queue and deadline (the call's
`grpc-timeout` or a `deadline_ms`/`timeout` parameter), the same counters. The repository calls need
the node's admin token as `authorization: Bearer <token>` metadata, as the HTTP routes do.
Shared-memory, trace and log settings are not offered (UNIMPLEMENTED, as a server without them answers).
"""

from __future__ import annotations

import asyncio
import hmac
import time
from typing import Any, NoReturn

from nodes.describe import Unanswerable, config, metadata, served, statistics
from nodes.protocol import BadRequest, decode_request
from nodes.residency import NoRoom
from nodes.state import VERSION, NodeRuntime
from telemetry.oip import wire
from telemetry.oip.grpc import (
    BadMessage,
    bearer,
    code_of,
    deadline_ms,
    http_form,
    response_from_arrays,
    service_handler,
)
from telemetry.oip.triton import EXTENSIONS, pb


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
        token = self.rt.config.admin_token
        if token is None:
            return
        scheme, _, given = (bearer(context) or "").partition(" ")
        if scheme.lower() != "bearer" or not given:
            await _abort(context, 401, "repository calls need authorization: Bearer <admin token> metadata")
        if not hmac.compare_digest(given.strip().encode(), token.encode()):
            await _abort(context, 403, "wrong admin token")

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
        try:
            await self.rt.ensure(name, retry=True)
        except NoRoom as exc:
            await _abort(context, 503, f"cannot load model '{name}': {exc.reason}")
        except Exception as exc:  # noqa: BLE001 - a model that fails to load fails alone
            await _abort(context, 500, f"model '{name}' failed to load: {exc}")
        return pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, request: Any, context: Any) -> Any:
        await self._admin(context)
        name = await self._served(context, request.model_name, "")
        busy = await self.rt.unload(name)
        if busy:
            await _abort(context, 409, f"model '{name}' has {busy} request(s) in progress")
        return pb.RepositoryModelUnloadResponse()

    async def infer_once(self, request: Any, context: Any) -> tuple[int, str, Any]:
        """One inference (telemetry.oip.grpc makes ModelInfer and ModelStreamInfer of it): (status,
        error message, response or None)."""
        rt = self.rt
        arrived = time.perf_counter()
        if rt.draining:
            return 503, "node is draining", None
        try:
            name = served(rt, request.model_name, request.model_version or None)
        except Unanswerable as exc:
            return exc.status, exc.message, None
        rt.model_requests += 1
        model = rt.models.get(name)
        if model is None:  # not resident: load it first, as the HTTP path does
            rt.cold_requests += 1
            try:
                model = await rt.ensure(name)
            except Exception as exc:  # noqa: BLE001 - a model that fails to load fails alone
                status, why = (503, exc.reason) if isinstance(exc, NoRoom) else (500, f"failed to load: {exc}")
                rt.metrics.answered(name, status, None, 0.0)
                return status, f"model '{name}': {why}", None
        rt.residency.pin(model.name)
        try:
            return await self._infer(request, context, model, arrived)
        finally:
            rt.residency.unpin(model.name)

    async def _infer(self, request: Any, context: Any, model: Any, arrived: float) -> tuple[int, str, Any]:
        """(status, error message, response or None); counted in the node's statistics either way."""
        rt = self.rt
        try:
            doc, tail = http_form(request)
            req = decode_request(doc, tail, model.inputs, model.output_names)
            params = req.parameters
            priority = wire.priority_hint(params.get("priority")) or 0
            budget_ms = deadline_ms(context, params)
        except (BadMessage, BadRequest, wire.BadHint) as exc:
            rt.metrics.answered(model.name, 400, None, time.perf_counter() - arrived)
            return 400, str(exc), None
        decoded = time.perf_counter()
        if budget_ms is not None:
            budget_ms -= (decoded - arrived) * 1000.0
            if budget_ms <= 0:
                rt.metrics.answered(model.name, 504, None, time.perf_counter() - arrived)
                return 504, "deadline passed while the node read the request", None
        outcome = rt.engine.decide_now(model.name, req, priority, budget_ms, req.id)
        if outcome is None:
            outcome = await rt.engine.wait_queued(model.name, req, priority, budget_ms, req.id)
        if outcome.status != 200 or outcome.outputs is None:
            rt.metrics.answered(model.name, outcome.status, None, time.perf_counter() - arrived)
            return outcome.status, outcome.reason, None
        encoding = time.perf_counter()
        outputs = [(n, model.outputs[n].datatype, outcome.outputs[n]) for n in req.outputs]
        resp = response_from_arrays(model.served_name, model.version, req.id, outputs)
        done = time.perf_counter()
        rt.metrics.answered(
            model.name,
            200,
            outcome.queue_ms,
            done - arrived,
            req.batch,
            outcome.exec_ms,
            decoded - arrived,
            done - encoding,
        )
        return 200, "", resp


def add_to(rt: NodeRuntime) -> Any:
    """A function that puts the node's service on a grpc.aio server."""

    def add(server: Any) -> None:
        server.add_generic_rpc_handlers((service_handler(NodeService(rt)),))

    return add


__all__ = ["NodeService", "add_to"]
