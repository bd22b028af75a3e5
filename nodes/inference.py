"""The node's one path for an inference, for both front doors (HTTP in nodes.server, gRPC in
nodes.grpc_service), and its one admin check.

A front door resolves nothing itself: it hands `infer` the names in the request, a `decode` that
reads its protocol's request against the model (tensors, priority, deadline) and an `encode` that
writes the outputs in its protocol. Here: draining -> 503; a model or version the node does not
serve -> 404; a model not resident is loaded first (evicting idle ones; 503 when it cannot fit now,
500 when loading failed) and pinned while the request needs it; the request decoded (400 when it
does not fit the model); the remaining budget checked (504 when it ran out before or while the node
read the request); queued by priority and deadline and run (nodes.executor: 429/503 refusals, 504
when too late); the answer encoded; every answer counted in the node's statistics.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from nodes.describe import Unanswerable, served
from nodes.protocol import BadRequest, InferRequest
from nodes.residency import NoRoom
from nodes.runtime import LoadedModel
from nodes.state import LoadFailed, NodeRuntime
from telemetry.oip import wire
from telemetry.process import tracing

log = logging.getLogger("edgeroute.node")

T = TypeVar("T")
TENANTS_SEEN = 256  # tenant names a node counts requests under (GET /admin/stats), then "(other)"


@dataclass(frozen=True)
class Decoded:
    """A request read against its model: the tensors and the hints a front door found (the budget in
    ms from the request's arrival, None for no deadline)."""

    request: InferRequest
    priority: int
    budget_ms: float | None
    tenant: str = ""  # the router's word for whose work it is (its fair share at the node); "" none
    weight: float = 1.0


class Refused(ValueError):
    """A request that cannot be decoded: answered `status` (400, or 413 for one too large) with this
    message."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Done(Generic[T]):
    """An inference's answer: `status`, and for a success the encoded outputs and what the node's
    headers report (queue wait, execution, rows of the batch, time spent loading the model first)."""

    status: int
    reason: str = ""
    payload: T | None = None
    queue_ms: float = 0.0
    exec_ms: float = 0.0
    batch_rows: int = 0
    cold_ms: float | None = None
    refused: bool = False  # the queue's refusal (full, or too late here): cheap, and says when to come back


async def load_or_refuse(rt: NodeRuntime, name: str, retry: bool = False) -> LoadedModel | Done[Any]:
    """The model the node serves as `name`, loaded on demand; 503 if it cannot be loaded now (memory
    held by models in use, or larger than the budget), 500 if loading failed (now or recently)."""
    try:
        return await rt.ensure(name, retry)
    except LoadFailed as exc:
        return Done(500, f"model '{name}' failed to load: {exc}")
    except NoRoom as exc:
        return Done(503, f"cannot load model '{name}': {exc.reason}")
    except Exception as exc:  # noqa: BLE001 - a model that fails to load fails alone
        log.error("node %s: loading %s failed: %s", rt.config.node_id, name, exc)
        return Done(500, f"model '{name}' failed to load: {exc}")


async def infer(
    rt: NodeRuntime,
    model: str,
    version: str | None,
    decode: Callable[[LoadedModel], Awaitable[Decoded]],
    encode: Callable[[LoadedModel, InferRequest, dict[str, Any]], T],
    request_id: str | None,
    arrived: float,
    carrier: Mapping[str, str] | None = None,
) -> Done[T]:
    """One inference, `arrived` on `time.perf_counter()`; `request_id` names it for cancels (a router's
    attempt id), else the request's own id. Traced when tracing is on, as the child of the
    `traceparent` in `carrier` (the request's headers or metadata), with its queueing and its execution
    as child spans (telemetry.process.tracing)."""
    work = _infer(rt, model, version, decode, encode, request_id, arrived)
    if tracing.TRACER is None:
        return await work
    return await _traced(rt, model, carrier, arrived, work)


async def _traced(
    rt: NodeRuntime, model: str, carrier: Mapping[str, str] | None, arrived: float, work: Awaitable[Done[T]]
) -> Done[T]:
    """`work` (one inference) in its span, with its queueing and its execution as child spans."""
    with tracing.span(f"infer {model[:64]}", carrier, **{"edgeroute.node": rt.config.node_id}) as span:
        started_ns = time.time_ns() - int((time.perf_counter() - arrived) * 1e9)
        done = await work
        span.set_attributes({"http.response.status_code": done.status, "edgeroute.batch_rows": done.batch_rows})
        if done.status == 200:
            end_ns = time.time_ns()
            exec_ns, queue_ns = int(done.exec_ms * 1e6), int(done.queue_ms * 1e6)
            ran_ns = end_ns - exec_ns
            tracing.child("queue", max(started_ns, ran_ns - queue_ns), ran_ns)
            tracing.child("execute", ran_ns, end_ns, **{"edgeroute.batch_rows": done.batch_rows})
        return done


async def _infer(
    rt: NodeRuntime,
    model: str,
    version: str | None,
    decode: Callable[[LoadedModel], Awaitable[Decoded]],
    encode: Callable[[LoadedModel, InferRequest, dict[str, Any]], T],
    request_id: str | None,
    arrived: float,
) -> Done[T]:
    if rt.draining:
        return Done(503, "node is draining")
    try:
        name = served(rt, model, version)
    except Unanswerable as exc:  # not a model (or version) it serves: 404
        return Done(exc.status, exc.message)
    rt.model_requests += 1
    rt.per_model.add(name, "model_requests")
    loaded = rt.models.get(name)
    cold_ms = None
    if loaded is None:  # not resident: load it first (evicting idle models), or answer why it cannot be
        rt.cold_requests += 1
        rt.per_model.add(name, "cold_requests")
        got = await load_or_refuse(rt, name)
        if isinstance(got, Done):
            rt.metrics.answered(name, got.status, None, 0.0)
            return got
        loaded = got
        cold_ms = (time.perf_counter() - arrived) * 1000.0
    rt.residency.pin(loaded.name)  # not evicted while this request needs it (and now the most recently used)
    try:
        return await _run(rt, loaded, decode, encode, request_id, arrived, cold_ms)
    finally:
        rt.residency.unpin(loaded.name)


async def _run(
    rt: NodeRuntime,
    model: LoadedModel,
    decode: Callable[[LoadedModel], Awaitable[Decoded]],
    encode: Callable[[LoadedModel, InferRequest, dict[str, Any]], T],
    request_id: str | None,
    arrived: float,
    cold_ms: float | None,
) -> Done[T]:
    def answered(done: Done[T], rows: int = 0, input_s: float = 0.0, output_s: float = 0.0) -> Done[T]:
        queue = done.queue_ms if done.status == 200 else None
        exec_ms = done.exec_ms if done.status == 200 else None
        total_s = time.perf_counter() - arrived
        rt.metrics.answered(model.name, done.status, queue, total_s, rows, exec_ms, input_s, output_s)
        return done

    try:
        decoded = await decode(model)
    except (BadRequest, Refused, wire.BadHint) as exc:
        return answered(Done(exc.status if isinstance(exc, Refused) else 400, str(exc), cold_ms=cold_ms))
    read = time.perf_counter()
    req, budget_ms = decoded.request, decoded.budget_ms
    if budget_ms is not None and budget_ms <= 0:
        return answered(Done(504, "deadline passed before the node received the request", cold_ms=cold_ms))
    if budget_ms is not None:  # the budget counts from arrival: reading and validating took some of it
        budget_ms -= (read - arrived) * 1000.0
        if budget_ms <= 0:
            return answered(Done(504, "deadline passed while the node read the request", cold_ms=cold_ms))
    rid = request_id if request_id is not None else req.id
    if decoded.tenant:
        seen = rt.tenant_requests
        seen[decoded.tenant if decoded.tenant in seen or len(seen) < TENANTS_SEEN else "(other)"] += 1
    tenant = (decoded.tenant, decoded.weight)
    outcome = rt.engine.decide_now(model.name, req, decoded.priority, budget_ms, rid, tenant)
    if outcome is None:
        outcome = await rt.engine.wait_queued(model.name, req, decoded.priority, budget_ms, rid, tenant)
    if outcome.status != 200 or outcome.outputs is None:
        refused = outcome.status in (429, 503)
        return answered(Done(outcome.status, outcome.reason, cold_ms=cold_ms, refused=refused))
    encoding = time.perf_counter()
    payload = encode(model, req, outcome.outputs)
    done = Done(200, "", payload, outcome.queue_ms, outcome.exec_ms, outcome.batch_rows, cold_ms)
    return answered(done, req.batch, read - arrived, time.perf_counter() - encoding)


def admin_refusal(token: str | None, authorization: str | None, what: str = "admin") -> tuple[int, str] | None:
    """The node's bearer check: its admin token for its `/admin/*` and repository routes and its
    repository calls over gRPC, its inference token (`what` "inference") for inference over HTTP and
    gRPC. With the token set, `Authorization: Bearer <token>` (401 without one, 403 for a wrong one,
    compared in constant time). None: allowed."""
    if token is None:
        return None
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not given:
        return 401, f"{what} calls need Authorization: Bearer <{what} token>"
    if not hmac.compare_digest(given.strip().encode(), token.encode()):
        return 403, f"wrong {what} token"
    return None
