"""What the router answers about the fleet, whatever front door asks: readiness, model metadata and
readiness, Triton's configuration and statistics, and the repository (index, load, unload).

Each query is transport-free: an `Answer` (a status and, on success, a JSON body: the router's own,
or a serving node's as it came) or, for statistics, Triton's merged message itself (`Stats`). A
front door turns them into its protocol's answer; nothing here is built to be decoded again.

- Metadata, a version's readiness and configuration are a serving node's answer, least busy node
  first (model resident first); 404 for an odd version name or an unknown model, 503 when no node
  serves it or none answers.
- Statistics are the fleet's sum over every fresh node that serves the model
  (telemetry.oip.triton.merge_statistics). A node's answer is hostile input: read against Triton's
  schema with a size bound; a node that does not answer, or answers what does not fit, is left out
  and named (`Stats.missing`).
- Repository: the cluster's index; a load makes a model resident on one node (free memory first, or
  the node named), an unload lets it go on every node, each node's answer relayed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from policies.healthy import Healthy
from policies.pipeline import Pipeline
from router.cascade import CascadeRunner
from router.director import VERSION_NAME
from router.lifecycle import NO_TELEMETRY_YET
from router.node_client import NodeBadAnswer, NodeError, NodeTimeout, NodeUnavailable, error_text
from router.state import Router
from router.workflows import WorkflowRunner
from telemetry.cluster.view import NodeState
from telemetry.oip import wire
from telemetry.oip.triton import from_json, merge_statistics, pb

STATS_TIMEOUT_S = 2.0
# statistics one fan-out to the nodes answers for (model_stats): short, as a client that reads them
# twice expects the counts between (perf_analyzer reads them at each end of a window and finds no
# model where nothing changed; at 1 s its windows under 1 s failed through the router)
STATS_FRESH_MS = 100.0
STATS_KEYS = 256  # (model, version) pairs whose statistics are held at once
METADATA_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class Answer:
    """A query's result: `status`, a JSON `body` (the router's own, or a node's as it came: on a node's
    error too), and for an error its text (`error`; the router's own errors have no body)."""

    status: int
    body: bytes = b""
    error: str = ""
    headers: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, doc: Any, status: int = 200) -> Answer:
        return cls(status, wire.dumps(doc))

    @classmethod
    def fail(cls, status: int, error: str, headers: Mapping[str, str] | None = None) -> Answer:
        return cls(status, error=error, headers=headers or {})


@dataclass(frozen=True)
class Stats:
    """The fleet's statistics (Triton's `ModelStatisticsResponse`), or an error; `missing`: the nodes
    left out because they did not answer, or answered what does not fit."""

    status: int
    message: Any = None
    error: str = ""
    missing: tuple[str, ...] = ()


def panic_max_age_ms(pipeline: Pipeline) -> float:
    """How old a node's last report may be for the policy to route to it when no node is fresh (its
    `healthy` filter's panic age; 0 when the policy has no panic mode)."""
    for f in pipeline.filters:
        if isinstance(f, Healthy):
            return f.params.panic_max_age_ms
    return 0.0


def ready(router: Router) -> Answer:
    """Readiness is "can route": some node is live (its telemetry fresh, or alive by the router's own
    answers and probes), or, when none is, the policy's panic mode still routes to nodes heard from
    within its panic age. A router that has heard of no node is not ready; one whose telemetry stopped
    stays in the Service while it hears from its nodes itself, exactly when it should keep serving."""
    now = router.clock()
    view = router.lifecycle.view()
    live = len(view.live_nodes(now))
    if live:
        return Answer.of({"ready": True, "nodes": live, "panic": False})
    horizon = panic_max_age_ms(router.policies.current)
    recent = sum(1 for n in view if n.ready and view.age_ms(n.node_id, now) <= horizon)
    return Answer.of(
        {"ready": recent > 0, "nodes": 0, "panic": recent > 0, "recent_nodes": recent}, 200 if recent else 503
    )


def model_nodes(router: Router, model: str) -> tuple[list[NodeState], bool]:
    """(live ready nodes serving `model`, whether any node at all ever reported it)."""
    view = router.lifecycle.view()
    nodes = view.models(router.clock()).get(model, [])
    known = bool(nodes) or any(n.serves(model) for n in view)
    return nodes, known


def unknown_or_unavailable(router: Router, model: str, known: bool) -> Answer:
    if known:
        return Answer.fail(503, f"no ready node serves model '{model}'")
    if not len(router.store.view):
        return Answer.fail(503, NO_TELEMETRY_YET, {"Retry-After": "1"})
    return Answer.fail(404, f"unknown model '{model}'")


async def _node_get(router: Router, model: str, suffix: str = "") -> tuple[int, bytes] | None:
    """A serving node's answer to `GET /v2/models/{model}{suffix}` (metadata, a version's readiness,
    configuration), least busy node first."""
    nodes, _ = model_nodes(router, model)
    view = router.lifecycle.view()
    for node in sorted(nodes, key=lambda n: (not ((m := n.model(model)) and m.resident), view.outstanding(n))):
        try:
            reply = await router.client.get(f"{node.endpoint}/v2/models/{model}{suffix}", METADATA_TIMEOUT_S)
        except NodeError:
            continue
        if reply.status < 500:
            return reply.status, reply.body
    return None


async def relay(router: Router, model: str, version: str | None, tail: str, what: str) -> Answer:
    """A serving node's answer to `GET /v2/models/{model}[/versions/{version}]{tail}` (metadata,
    configuration), relayed as it came; 404 for an odd version name or an unknown model, 503 when
    no node serves it or none answers."""
    if version is not None and not VERSION_NAME.match(version):
        return Answer.fail(404, f"model '{model}' has no version '{version}'")
    nodes, known = model_nodes(router, model)
    if not nodes:
        return unknown_or_unavailable(router, model, known)
    suffix = ("" if version is None else f"/versions/{version}") + tail
    got = await _node_get(router, model, suffix)
    if got is None:
        return Answer.fail(503, f"no node answered {what} model '{model}'")
    status, body = got
    return Answer(status, body, "" if status == 200 else error_text(body))


def _virtual(router: Router, model: str) -> WorkflowRunner | CascadeRunner | None:
    """The workflow or cascade this router serves as `model`, if it is one."""
    return router.workflows.get(model) or router.cascades.get(model)


async def model_metadata(router: Router, model: str, version: str | None) -> Answer:
    runner = router.workflows.get(model)
    if runner is not None:
        return await _workflow_metadata(router, runner)
    cascade = router.cascades.get(model)
    if cascade is not None:
        return await _cascade_metadata(router, cascade)
    return await relay(router, model, version, "", "metadata for")


async def _cascade_metadata(router: Router, runner: CascadeRunner) -> Answer:
    """The first model's inputs and outputs (the second's are the same), under the cascade's name."""
    spec = runner.spec
    model = spec.second if spec.mode == "second_only" else spec.first
    got = await _node_get(router, model)
    if got is None or got[0] != 200:
        return Answer.fail(503, f"cascade '{spec.name}': no node answered metadata for model '{model}'")
    try:
        meta = wire.loads(got[1])
        if not isinstance(meta, dict):
            raise wire.MalformedBody("not an object")
    except wire.MalformedBody:
        return Answer.fail(502, f"cascade '{spec.name}': unreadable metadata for model '{model}'")
    return Answer.of(
        {
            "name": spec.name,
            "versions": ["1"],
            "platform": "edgeroute_cascade",
            "inputs": meta.get("inputs", []),
            "outputs": meta.get("outputs", []),
            "parameters": spec.model_dump(mode="json"),
        }
    )


async def _workflow_metadata(router: Router, runner: WorkflowRunner) -> Answer:
    """Like an ensemble's: the inputs as the stages' models declare them, outputs named STAGE.OUTPUT."""
    spec = runner.spec
    meta: dict[str, dict[str, Any]] = {}
    for stage in spec.stages:
        got = await _node_get(router, stage.model)
        if got is None or got[0] != 200:
            return Answer.fail(503, f"workflow '{spec.name}': no node answered metadata for model '{stage.model}'")
        try:
            meta[stage.name] = wire.loads(got[1])
            if not isinstance(meta[stage.name], dict):
                raise wire.MalformedBody("not an object")
        except wire.MalformedBody:
            return Answer.fail(502, f"workflow '{spec.name}': unreadable metadata for model '{stage.model}'")
    inputs: dict[str, dict[str, Any]] = {}
    for stage in spec.stages:
        declared = {t["name"]: t for t in meta[stage.name].get("inputs", [])}
        for model_input, src in stage.inputs.items():
            ref = src if isinstance(src, str) else src.crop
            if ref in spec.inputs and ref not in inputs and model_input in declared:
                inputs[ref] = {**declared[model_input], "name": ref}
    if isinstance(spec.outputs, list):
        wanted = set(spec.outputs)
    else:
        wanted = {f"{s}.{t['name']}" for s in spec.sinks() for t in meta[s].get("outputs", [])}
    outputs = [{**t, "name": f"{s.name}.{t['name']}"} for s in spec.stages for t in meta[s.name].get("outputs", [])]
    return Answer.of(
        {
            "name": spec.name,
            "versions": ["1"],
            "platform": "edgeroute_workflow",
            "inputs": [inputs.get(n, {"name": n, "datatype": "FP32", "shape": [-1]}) for n in spec.inputs],
            "outputs": [o for o in outputs if o["name"] in wanted],
            "parameters": {"slo_ms": spec.slo_ms, "stages": [s.model_dump(exclude_none=True) for s in spec.stages]},
        }
    )


async def model_ready(router: Router, model: str, version: str | None) -> Answer:
    runner = _virtual(router, model)
    if version is not None and (not VERSION_NAME.match(version) or (runner is not None and version != "1")):
        return Answer.fail(404, f"model '{model}' has no version '{version}'")
    if runner is not None:
        absent = [m for m in runner.models() if not model_nodes(router, m)[0]]
        if absent:
            return Answer.fail(503, f"'{model}': no ready node serves {', '.join(absent)}")
        return Answer.of({"name": model, "ready": True, "models": runner.models()})
    nodes, known = model_nodes(router, model)
    if not nodes:
        return unknown_or_unavailable(router, model, known)
    if version is not None:  # which versions a node holds is the node's to say (a user's model repository)
        got = await _node_get(router, model, f"/versions/{version}/ready")
        if got is None:
            return Answer.fail(503, f"no node answered readiness for model '{model}' version '{version}'")
        status, body = got
        return Answer(status, body, "" if status == 200 else error_text(body))
    return Answer.of({"name": model, "ready": True, "nodes": len(nodes)})


async def model_config(router: Router, model: str, version: str | None) -> Answer:
    if _virtual(router, model) is not None:
        return Answer.fail(
            404, f"'{model}' is a workflow or cascade of this router; it has no Triton model configuration"
        )
    return await relay(router, model, version, "/config", "the configuration of")


def _holders(router: Router, model: str | None) -> list[NodeState]:
    """Live ready nodes that serve `model` (any version of it), or every live ready node."""
    nodes = router.lifecycle.view().live_nodes(router.clock())
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


async def model_stats(router: Router, model: str | None, version: str | None) -> Stats:
    """The fleet's statistics for `model` (every model when None), asked of every node that holds it.
    One fan-out serves every caller for STATS_FRESH_MS: callers while it runs wait for it, later ones
    get its result, so statistics polled by many clients cost the nodes ten calls per node a second."""
    key = (model, version)
    cache = router.stats_cache
    now = router.clock()
    held = cache.get(key)
    if held is not None and (isinstance(held, asyncio.Future) or now - held[0] < STATS_FRESH_MS):
        return await asyncio.shield(held) if isinstance(held, asyncio.Future) else held[1]
    if len(cache) >= STATS_KEYS:  # keys are names a client chose: the table is bounded
        for k in [k for k, v in cache.items() if not isinstance(v, asyncio.Future)]:
            del cache[k]
    running = asyncio.ensure_future(_fan_out_stats(router, model, version))
    cache[key] = running

    def settle(done: asyncio.Future[Stats]) -> None:
        if cache.get(key) is done:
            if not done.cancelled() and done.exception() is None:
                cache[key] = (router.clock(), done.result())
            else:
                del cache[key]

    running.add_done_callback(settle)
    return await asyncio.shield(running)


async def _fan_out_stats(router: Router, model: str | None, version: str | None) -> Stats:
    if model is not None and _virtual(router, model) is not None:
        return Stats(
            404, error=f"'{model}' is a workflow or cascade of this router; its models have statistics of their own"
        )
    if version is not None and not VERSION_NAME.match(version):
        return Stats(404, error=f"model '{model}' has no version '{version}'")
    nodes = _holders(router, model)
    if model is not None and not nodes:
        _, known = model_nodes(router, model)
        missing = unknown_or_unavailable(router, model, known)
        return Stats(missing.status, error=missing.error)
    path = "/v2/models/stats"
    if model is not None:
        path = f"/v2/models/{model}" + ("" if version is None else f"/versions/{version}") + "/stats"
    answers = await asyncio.gather(*(_node_stats(router, n, path) for n in nodes))
    merged = merge_statistics([a for a in answers if a is not None])
    missing_nodes = tuple(n.node_id for n, a in zip(nodes, answers, strict=True) if a is None)
    if model is not None and not merged.model_stats:
        return Stats(503 if missing_nodes else 404, error=f"no node answered statistics for model '{model}'")
    return Stats(200, merged, missing=missing_nodes)


# --- the repository extension ----------------------------------------------------------------------


def repository_index(router: Router) -> list[dict[str, str]]:
    """The cluster's repository index: every model a node reports and every workflow, READY where warm."""
    view = router.lifecycle.view()
    serving = view.models(router.clock())
    names = sorted({m for n in view for m in n.load.models})
    warm = {m for m, nodes in serving.items() for n in nodes if (st := n.model(m)) is not None and st.resident}

    def state(m: str) -> dict[str, str]:
        if m in warm:
            return {"state": "READY"}
        if m in serving:
            return {"state": "UNAVAILABLE", "reason": "not resident on any node; loads on first use"}
        return {"state": "UNAVAILABLE", "reason": "no live ready node serves it"}

    entries = [{"name": m, "version": "1", **state(m)} for m in names]
    virtual: list[tuple[str, WorkflowRunner | CascadeRunner]] = [*router.workflows.items(), *router.cascades.items()]
    for name, runner in virtual:
        absent = [m for m in runner.models() if m not in serving]
        entries.append({"name": name, "version": "1", "state": "UNAVAILABLE" if absent else "READY",
                      **({"reason": f"no live ready node serves {', '.join(absent)}"} if absent else {})})  # fmt: skip
    return entries


def _fresh_serving(router: Router, model: str) -> list[NodeState]:
    now = router.clock()
    view = router.lifecycle.view()
    return [n for n in view.serving(model) if n.ready and view.is_live(n, now)]


async def repository_load(router: Router, model: str, wanted: Any = None) -> tuple[int, dict[str, Any]]:
    """Make the model resident on a node: (status, answer body).

    Already resident on a fresh node: nothing to do. Otherwise the nodes that serve it are asked in
    order of free memory (or only the node `wanted`) until one loads it; if none does, 502, 503 or
    504 (see `_failure`) with each node's answer.
    """
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


async def repository_unload(router: Router, model: str) -> tuple[int, dict[str, Any]]:
    """Every node holding the model lets it go, all asked at once: (status, answer body). 200 when all
    did; 409 when a node still has requests in progress (relayed per node); 502, 503 or 504 when a node
    answered badly, could not be reached or did not answer in time."""
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
