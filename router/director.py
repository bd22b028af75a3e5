"""The router's one path for an inference, whatever front door it came through (HTTP, gRPC, MQTT).

A front door authenticates and reads its protocol; everything after is here, transport-free:
`admit` (the client's rate), `precheck` (model and version names, size), then `infer`: the hints
(priority, deadline, site) read from the OIP body's JSON header and the request's hints, its tenant
and the tenant's quotas (router.lifecycle.tenants: in flight until answered), the model
checked against the view (lifecycle rule: unknown -> 404, nothing heard yet -> 503), the request
routed by the policy through the lifecycle (router.dispatch) or run as a workflow
(router.workflows), and one `Outcome`: a node's answer as it came, or the router's own error, with
the router's headers set. A front door only turns that outcome into its protocol's answer.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from policies.api import RouteRequest
from router import shadow
from router.dispatch import Outcome
from router.lifecycle import intake
from router.lifecycle.canary import CONTROL
from router.state import Router
from router.workflows import WorkflowInputError, WorkflowRunner, decode_inputs
from telemetry.cluster.schema import NAME_PATTERN
from telemetry.oip import wire
from telemetry.process import tracing

NAME = re.compile(NAME_PATTERN)
VERSION_NAME = re.compile(r"^[0-9]{1,9}$")  # model versions are numbers (Triton's repository layout)
MAX_NAME = 128
PRIORITY_LABELS = range(-100, 101)  # priorities outside are labelled "<-100" / ">100"


@dataclass(frozen=True)
class InferCall:
    """One inference request as a front door read it: its model and version, its OIP body in the HTTP
    form (JSON, or a JSON header and a binary tail; `hints` then carries the header's length), the
    hints that came beside the body (HTTP headers, or a gRPC call's equivalents), the authenticated
    client, and when it arrived (ms, the router's clock)."""

    model: str
    version: str | None
    body: bytes
    hints: Mapping[str, str]
    client: str
    arrived_ms: float
    transport_ms: float | None = None  # what the transport says is left of the budget (gRPC, MQTT)
    door: str = "http"  # http | grpc | mqtt
    subject: str | None = None  # the verified client certificate's tenant field, where tenants read it


def admit(router: Router, client: str, model: str) -> Outcome | None:
    """The client's rate (router.admission.RateLimiter): None when it may go on, else its 429."""
    limited = router.limiter.admit(client, router.clock())
    if not limited.status:
        return None
    count(router, model, 0, "none", 429, router.clock())
    out = Outcome.error(429, limited.reason)
    out.headers["Retry-After"] = str(limited.retry_after_s)
    return out


def refuse(router: Router, model: str, status: int, reason: str, arrived_ms: float) -> Outcome:
    """The router's own error for a request it will not route, counted."""
    count(router, model, 0, "none", status, arrived_ms)
    return Outcome.error(status, reason)


def precheck(router: Router, model: str, version: str | None, size: int | None, arrived_ms: float) -> Outcome | None:
    """What a request's names and size alone decide, before its body is read: None, or a 400 for a model
    or version name that is not one, a 413 for a body over `max_body_bytes`."""
    if not NAME.match(model) or len(model) > MAX_NAME or (version is not None and not NAME.match(version)):
        return refuse(
            router, "unknown", 400, "model and version names are letters, digits and '.', '_', ':' or '-'", arrived_ms
        )
    limit = router.config.max_body_bytes
    if size is not None and size > limit:
        return refuse(router, model, 413, f"request body of {size} bytes exceeds {limit}", arrived_ms)
    return None


@dataclass(slots=True)
class Trail:
    """What intake made of a request, for its capture record (router.capture)."""

    priority: int = 0
    site: str | None = None
    budget_ms: float | None = None
    arm: str | None = None  # the canary arm that served it (router.lifecycle.canary), if any
    version: str | None = None  # the model version it went to, where it named one or a canary chose
    tenant: str = ""  # whose traffic (router.lifecycle.tenants); "" with tenants off


async def infer(router: Router, call: InferCall) -> Outcome:
    """An inference request read whole, checked, routed by the policy (or run as a workflow), answered;
    traced as one span when tracing is on (telemetry.process.tracing); recorded when capture is on."""
    trail = Trail()
    sat = router.saturation
    sat.in_flight += 1  # (an input of its rule: router.lifecycle.saturation)
    try:
        if tracing.TRACER is None:
            outcome = await _infer(router, call, trail)
        else:
            outcome = await _traced(router, call, trail)
    finally:
        sat.in_flight -= 1
    if router.capture is not None:
        record(router, call, trail, outcome, len(call.body))
    return outcome


def record(router: Router, call: InferCall, trail: Trail, outcome: Outcome, size: int) -> None:
    """An answered inference's capture record (router.capture; capture on); `size`: its body's bytes."""
    assert router.capture is not None
    headers = outcome.headers
    router.capture.request(
        "r",
        call.arrived_ms,
        call.door,
        trail.site,
        call.client,
        call.model,
        trail.version or call.version,
        trail.priority,
        trail.budget_ms,
        size,
        outcome.status,
        round(router.clock() - call.arrived_ms, 3),
        outcome.node,
        outcome.attempts,
        _float(headers.get(wire.QUEUE_MS)),
        _float(headers.get(wire.EXEC_MS)),
        trail.arm,
        trail.tenant or None,
    )


def _float(value: str | None) -> float | None:
    try:
        return None if value is None else round(float(value), 3)
    except ValueError:
        return None


async def _traced(router: Router, call: InferCall, trail: Trail) -> Outcome:
    with tracing.span(f"route {call.model[:64]}", call.hints, **{"edgeroute.model": call.model[:128]}) as span:
        outcome = await _infer(router, call, trail)
        span.set_attributes(
            {
                "http.response.status_code": outcome.status,
                "edgeroute.node": outcome.node,
                "edgeroute.attempts": outcome.attempts,
            }
        )
        if outcome.status >= 500:
            from opentelemetry.trace import Status, StatusCode

            span.set_status(Status(StatusCode.ERROR, outcome.reason[:200]))
        return outcome


async def _infer(router: Router, call: InferCall, trail: Trail) -> Outcome:
    cfg = router.config
    model, hints, arrived = call.model, call.hints, call.arrived_ms
    tenants = router.lifecycle.tenants
    try:
        doc = _parse_header(call.body, hints.get(wire.HEADER_LENGTH))
        auth, client = router.auth, call.client
        tenant_hint = hints.get(tenants.cfg.header) if tenants.cfg is not None else None
        taken = intake.take(
            intake.Hints(
                hints.get(wire.PRIORITY),
                hints.get(wire.DEADLINE_MS),
                hints.get(wire.SITE),
                call.transport_ms,
                tenant_hint,
            ),
            doc,
            router.lifecycle.settings.intake,
            lambda site: auth.may_claim(client, site, cfg.site),
            lambda site: _known_site(router, site),
            auth.site_of(client),
        )
    except wire.BadHint as exc:
        count(router, model, 0, "none", 400, arrived)
        return Outcome.error(400, str(exc))
    except intake.Refused as exc:
        count(router, model, 0, "none", exc.status, arrived)
        reason = f"client '{client}' {exc.reason}" if exc.status == 403 else exc.reason
        return Outcome.error(exc.status, reason)
    prio, site = taken.priority, taken.site
    trail.priority, trail.site = prio, site
    if taken.deadline_ms is not None and taken.deadline_ms <= 0:  # (only a transport's own says so)
        count(router, model, prio, "none", 504, arrived)
        return Outcome.error(504, "expired before it was run")
    if not tenants.enabled:
        return await _admitted(router, call, trail, doc, taken)
    tenant = trail.tenant = tenants.of(client, taken.tenant, auth.enabled, call.subject)
    over = tenants.admit(tenant, arrived)
    if over is not None:  # the tenant's quota: refused before anything is routed
        count(router, model, prio, "none", 429, arrived)
        out = Outcome.error(429, over.reason)
        out.headers["Retry-After"] = str(over.retry_after_s)
        return out
    outcome: Outcome | None = None
    try:
        outcome = await _admitted(router, call, trail, doc, taken)
    finally:  # (a request cancelled on the way, its client gone, still leaves its tenant's flight)
        if outcome is None:
            tenants.done(tenant, 499, router.clock() - arrived, trail.budget_ms)
        else:
            _tenant_done(router, tenant, outcome, taken.batch, arrived, trail.budget_ms)
    return outcome


def _tenant_done(
    router: Router, tenant: str, outcome: Outcome, rows: int, arrived: float, budget: float | None
) -> None:
    """An admitted request's answer, for its tenant: its share of the batch's execution, its wait."""
    exec_ms = waited = 0.0
    if outcome.status == 200:
        get = outcome.headers.get
        try:  # (a node's figures: a malformed one counts as none)
            exec_ms = float(get(wire.EXEC_MS) or 0.0)
            batch_rows = int(get(wire.BATCH_ROWS) or rows)
            if batch_rows != rows and batch_rows > 0:  # its share of the batch
                exec_ms *= rows / batch_rows
            waited = float(get(wire.QUEUE_MS) or 0.0) + float(get(wire.HELD_MS) or 0.0)
        except ValueError:
            exec_ms = waited = 0.0
        if not (exec_ms >= 0.0 and waited >= 0.0 and exec_ms < 1e9 and waited < 1e9):  # (NaN, negative, huge)
            exec_ms = waited = 0.0
    router.lifecycle.tenants.done(tenant, outcome.status, router.clock() - arrived, budget, exec_ms, waited)


async def _admitted(
    router: Router, call: InferCall, trail: Trail, doc: dict[str, Any], taken: intake.Intake
) -> Outcome:
    """A request intake took (and its tenant's quotas let in): a workflow, a cascade, or one request
    routed by the policy through the lifecycle."""
    model, hints, arrived = call.model, call.hints, call.arrived_ms
    prio, site, batch, tenant = taken.priority, taken.site, taken.batch, trail.tenant
    runner = router.workflows.get(model)
    if runner is not None:
        trail.budget_ms = taken.budget_ms(router.lifecycle.settings.intake, runner.spec.slo_ms)
        return await _run_workflow(router, runner, call, doc, prio, taken, site, tenant)
    cascade = router.cascades.get(model)
    if cascade is not None:
        refused = _non_finite(doc, call.body, hints.get(wire.HEADER_LENGTH))
        if refused is not None:
            count(router, model, prio, "none", 400, arrived)
            return Outcome.error(400, refused)
        budget = trail.budget_ms = taken.budget_ms(router.lifecycle.settings.intake, cascade.spec.slo_ms)

        def charge() -> bool:  # an escalation is a second call of the client's, against its rate
            return not router.limiter.admit(call.client, router.clock()).status

        outcome = await cascade.run(
            call.body, hints, prio, budget, site, _request_id(doc), arrived, charge,
            _tenant_headers(router, tenant) if tenant else None,
        )  # fmt: skip
        count(router, model, prio, outcome.node, outcome.status, arrived, served=True)
        if outcome.status == 429 and "Retry-After" not in outcome.headers:
            outcome.headers["Retry-After"] = "1"
        outcome.headers[wire.NODE] = outcome.node
        outcome.headers[wire.ATTEMPTS] = str(outcome.attempts)
        return outcome
    through = router.cascade_only.get(model)
    if through is not None:
        count(router, model, prio, "none", 403, arrived)
        return Outcome.error(403, f"model '{model}' answers only through the cascade '{through}'")
    unknown = router.lifecycle.unknown_model(model)
    if unknown is not None:
        count(router, model, prio, "none", unknown.status, arrived)
        out = Outcome.error(unknown.status, unknown.reason)
        if unknown.status == 503:
            out.headers["Retry-After"] = "1"
        return out
    budget = trail.budget_ms = taken.budget_ms(router.lifecycle.settings.intake)
    saturated = router.saturation.refuse_request(prio, budget, tenant, router.lifecycle.tenants, arrived)
    if saturated is not None:  # the router itself is behind: its capacity goes to what it admits
        count(router, model, prio, "none", 503, arrived)
        out = Outcome.error(503, saturated)
        out.headers["Retry-After"] = "1"
        return out
    headers = {"Content-Type": hints.get("Content-Type", "application/json"), wire.PRIORITY: str(prio)}
    if wire.HEADER_LENGTH in hints:
        headers[wire.HEADER_LENGTH] = hints[wire.HEADER_LENGTH]
    if tenant:  # the node's fair share: the router's word on whose work it is, never the client's
        headers.update(_tenant_headers(router, tenant))
    request_id = _request_id(doc)
    policy = None
    canaries = router.canaries
    if canaries.canary is not None:  # a policy canary: the request's arm, by its client, site or id
        by = canaries.canary.spec.by
        key = call.client if by == "client" else (site or "") if by == "site" else request_id
        trail.arm, policy = canaries.arm(key)
    route_model, version, run, model_arm = model, call.version, None, None
    if version is None:
        if canaries.models or canaries.pinned:  # a version canary, or a version a canary promoted

            def keyed(by: str) -> str:
                return call.client if by == "client" else (site or "") if by == "site" else request_id

            run, model_arm, pinned = canaries.route_model(model, keyed)
            if pinned:
                route_model, version = f"{model}:{pinned}", pinned
    elif router.store.view.serving_count(f"{model}:{version}"):  # a version nodes serve beside the default
        route_model = f"{model}:{version}"
    outcome = await router.dispatcher.dispatch(
        RouteRequest(route_model, prio, budget, site, batch, request_id, tenant=tenant),
        _infer_path(model, version),
        call.body,
        headers,
        arrived + budget,
        policy,
    )
    if trail.arm is not None:
        canaries.observe(trail.arm, outcome.status, router.clock() - arrived, budget)
    if run is not None and model_arm is not None:
        canaries.observe_model(run, model_arm, outcome.status, router.clock() - arrived, budget)
        trail.arm = trail.arm or model_arm
        if model_arm == CONTROL and outcome.status == 200 and run.shadow_due():
            shadow.start(router, run, call.body, headers, outcome, site, request_id, arrived + budget)
    trail.version = version
    # counted once the answer is on its way (the next turn of the loop), not before it
    asyncio.get_running_loop().call_soon(_counted, router, model, prio, outcome, arrived)
    if outcome.status == 429 and outcome.node == "none":
        router.metrics.early_rejections.labels(model).inc()
    out_headers = outcome.headers
    if outcome.status == 429 and "Retry-After" not in out_headers:
        out_headers["Retry-After"] = "1"  # refused early: no node could serve it in time
    out_headers[wire.NODE] = outcome.node
    out_headers[wire.ATTEMPTS] = str(outcome.attempts)
    out_headers["Content-Type"] = out_headers.get("Content-Type", "application/json").split(";")[0]
    return outcome


async def _run_workflow(
    router: Router,
    runner: WorkflowRunner,
    call: InferCall,
    doc: dict[str, Any],
    priority: int,
    taken: intake.Intake,
    site: str | None,
    tenant: str = "",
) -> Outcome:
    """A workflow job: every stage routed by the policy, tensors passed between them (router.workflows)."""
    name = runner.spec.name
    header_length = call.hints.get(wire.HEADER_LENGTH)
    tail = call.body[int(header_length) :] if header_length is not None else b""
    try:
        inputs = decode_inputs(doc, tail)
        missing = [n for n in runner.spec.inputs if n not in inputs]
        if missing:
            raise WorkflowInputError(f"workflow '{name}' needs input(s) {', '.join(missing)}")
    except WorkflowInputError as exc:
        count(router, name, priority, "none", 400, call.arrived_ms)
        return Outcome.error(400, str(exc))
    budget = taken.budget_ms(router.lifecycle.settings.intake, runner.spec.slo_ms)
    fwd = {wire.PRIORITY: str(priority)}
    if tenant:
        fwd.update(_tenant_headers(router, tenant))
    job = await runner.run(inputs, priority, budget, site, _request_id(doc), call.arrived_ms, fwd)
    count(router, name, priority, "workflow", job.status, call.arrived_ms)
    headers = {k: v for k, v in job.headers.items() if k.startswith("x-edgeroute-")}
    headers.update({wire.NODE: job.node, wire.WORKFLOW: name, "Content-Type": "application/json"})
    if job.status == 429:
        headers["Retry-After"] = "1"
    job.headers = headers
    return job


_ID_PREFIX = secrets.token_hex(4) + "-"  # ids for requests that bring none: unique per process, and cheap
_ids = itertools.count(1)


def _request_id(doc: Mapping[str, Any]) -> str:
    """The client's own request id, or a new one."""
    return str(doc.get("id") or f"{_ID_PREFIX}{next(_ids):x}")


def _tenant_headers(router: Router, tenant: str) -> dict[str, str]:
    """What a node is told of a request's tenant (nodes.fairshare): its name and weight."""
    st = router.lifecycle.tenants.states.get(tenant)
    return {} if st is None else st.node_headers


def _known_site(router: Router, site: str) -> bool:
    """A partition some node reports, an end of a configured link, the router's own site, or a site
    given to a client's key."""
    if router.store.view.has_partition(site) or site in router.lifecycle.links.sites or site == router.config.site:
        return True
    return any(site in sites for sites in router.auth.sites.values())


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


def _non_finite(doc: dict[str, Any], body: bytes, header_length: str | None) -> str | None:
    """A cascade's request whose inputs are not all finite numbers (a NaN or infinity made every answer
    unsure, so every request went on to the costly model): the reason it is refused, else None."""
    import numpy as np

    try:
        tail = body[int(header_length) :] if header_length is not None else b""
        inputs = decode_inputs(doc, tail)
    except (WorkflowInputError, ValueError):
        return None  # malformed otherwise: the node says how, as for any model
    for name, arr in inputs.items():
        if arr.dtype.kind == "f" and not bool(np.isfinite(arr).all()):
            return f"input '{name[:64]}' holds values that are not finite numbers (NaN or infinity)"
    return None
