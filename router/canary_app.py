"""A policy canary on the live router (the rule, shared with the simulator, is router.lifecycle.canary).

- Start: `PUT /admin/policy` with `{"canary": {"candidate": {...}, "share": 0.1, "by": "client",
  "guard": {...}}}`, or `canary:` in the config file (a reload starts it). A malformed spec is refused
  with the field named (400), and the live policy stays as it was.
- Per request (router.director): its arm from its client, site or id; the candidate's requests
  routed by the candidate policy; each answer observed on its arm.
- Judged every second (`judge_loop`): a promotion swaps the candidate in as the policy; a rollback
  drops it. `DELETE /admin/canary` rolls back by hand; `GET /admin/canary` is its state.
- Audited: every step (start, promote, rollback, why, the figures it was taken on) in the router's log,
  in `/admin/view` (`canary.log`), and on the Kafka topic `canary_topic` where set, so an operator and
  the other routers see it. Metrics: `edgeroute_canary_answers_total{arm,outcome}`.
- Shared: each router reads `canary_topic` (`VerdictReader`) and takes another router's verdict on the
  canary it runs as its own (router.canary.CanaryHolder.adopt): the first to decide decides for all.
  Each record is checked (types, bounds, its signature where telemetry keys are set) before it reaches
  the event loop.

Requests in flight finish on the policy they started with: a promotion or rollback changes what the
next request is routed by, never one under way, over HTTP, gRPC and MQTT alike.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from pydantic import ValidationError

from policies import PolicyConfigError, build_policy
from router.canary import CanaryHolder
from router.lifecycle.canary import CanarySpec, ModelCanarySpec
from router.state import ROUTER
from router.state import json_error as _error
from telemetry.kafka.reader import TopicReader
from telemetry.oip import wire
from telemetry.process.serving import read_body
from telemetry.process.settings import first_error

log = logging.getLogger("edgeroute.router")

MAX_SPEC_BYTES = 64 << 10  # a canary spec is a few hundred bytes


class CanaryCollector(Collector):
    def __init__(self, holder: CanaryHolder) -> None:
        self.holder = holder

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        answers = CounterMetricFamily(
            "edgeroute_canary_answers", "answers of a canary's arms, by outcome", labels=["arm", "outcome"]
        )
        for (arm, outcome), n in self.holder.outcomes.items():
            answers.add_metric([arm, outcome], n)
        yield answers
        running = GaugeMetricFamily("edgeroute_canary_share", "the candidate's share while a canary runs (else 0)")
        running.add_metric([], 0.0 if self.holder.canary is None else self.holder.canary.spec.share)
        yield running
        models = CounterMetricFamily(
            "edgeroute_model_canary_answers",
            "answers of a model version canary's arms, by outcome",
            labels=["model", "arm", "outcome"],
        )
        shadows = CounterMetricFamily(
            "edgeroute_model_canary_shadow",
            "mirrored copies of a model canary, by what they came to",
            labels=["model", "result"],
        )
        for key, n in sorted(self.holder.model_totals.items()):
            if key[0] == "answer":
                models.add_metric(list(key[1:]), n)
            else:
                shadows.add_metric(list(key[1:]), n)
        yield models
        yield shadows


def parse_model_canary(model: str, raw: Any) -> ModelCanarySpec:
    """A model version canary's spec (the model from the path), or ValueError naming the field."""
    if not isinstance(raw, dict):
        raise ValueError('canary: a model canary is an object: {"version": V, "share": ..., ...}')
    if "model" in raw and raw["model"] != model:
        raise ValueError(f"canary.model: '{raw['model']}' is not the model of the path ('{model}')")
    try:
        return ModelCanarySpec.model_validate({**raw, "model": model})
    except ValidationError as exc:
        raise ValueError(first_error(exc, "canary")) from None


async def put_model_canary(request: web.Request) -> web.Response:
    """`PUT /admin/canary/models/{model}`: a candidate version of the model on a share of its requests."""
    router = request.app[ROUTER]
    model = request.match_info["model"]
    body = await read_body(request, router.config.body_timeout_s)
    if len(body) > MAX_SPEC_BYTES:
        return _error(413, f"a canary spec is at most {MAX_SPEC_BYTES} bytes")
    try:
        spec = parse_model_canary(model, wire.loads(body))
    except (ValueError, UnicodeDecodeError) as exc:
        return _error(400, f"canary rejected: {exc}")
    view = router.store.view
    if not view.serving_count(model):
        return _error(404, f"unknown model '{model}'")
    if not view.serving_count(f"{model}:{spec.version}"):
        return _error(409, f"no node serves model '{model}' version {spec.version} (beside its default)")
    router.canaries.start_model(router, spec, f"PUT /admin/canary/models/{model}")
    return web.json_response(router.canaries.state()["models"][model])


async def delete_model_canary(request: web.Request) -> web.Response:
    """`DELETE /admin/canary/models/{model}`: its canary rolled back, or (none under way) a promotion's
    pin undone: the model's requests go to the nodes' default version again."""
    router = request.app[ROUTER]
    model = request.match_info["model"]
    if not router.canaries.stop_model(router, model, f"DELETE /admin/canary/models/{model}"):
        return _error(404, f"no canary and no promoted version for model '{model}'")
    return web.json_response(router.canaries.state())


def parse_canary(raw: Any) -> CanarySpec:
    """A canary spec, or ValueError naming the field and why (the live policy is left as it is)."""
    try:
        spec = CanarySpec.model_validate(raw)
    except ValidationError as exc:
        raise ValueError(first_error(exc, "canary")) from None
    try:
        build_policy(spec.candidate)
    except PolicyConfigError as exc:
        raise ValueError(f"canary.candidate: {str(exc).splitlines()[0]}") from None
    return spec


async def start_from_request(request: web.Request, raw: Any) -> web.Response:
    """`PUT /admin/policy` with a `canary`: validated, then started."""
    router = request.app[ROUTER]
    try:
        spec = await asyncio.to_thread(parse_canary, raw)
    except ValueError as exc:
        return _error(400, f"canary rejected, keeping '{router.policies.current.name}': {exc}")
    router.canaries.start(router, spec, "PUT /admin/policy")
    return web.json_response({"name": router.policies.current.name, "canary": router.canaries.state()["running"]})


async def get_canary(request: web.Request) -> web.Response:
    return web.json_response(request.app[ROUTER].canaries.state())


async def delete_canary(request: web.Request) -> web.Response:
    router = request.app[ROUTER]
    if router.canaries.canary is None:
        return _error(404, "no canary is running")
    router.canaries.stop(router, "DELETE /admin/canary")
    return web.json_response(router.canaries.state())


VERDICT_WAIT_MS = 200  # the verdicts reader's fetch wait


class VerdictReader(TopicReader):
    """The other routers' canary steps from `canary_topic` (a daemon thread), checked, each handed to
    the event loop (`deliver`); a record that is not one is counted (`malformed`) and dropped."""

    thread_name = "canary-verdicts"

    def __init__(self, bootstrap: str, topic: str, router_id: str, deliver: Callable[[dict[str, Any]], None]) -> None:
        # (a verdict is not latency-critical: a long fetch wait keeps an idle reader from polling the
        # broker a hundred times a second)
        super().__init__(bootstrap, topic, lookback_ms=10_000.0, fetch_max_wait_ms=VERDICT_WAIT_MS)
        self.router_id = router_id
        self.deliver = deliver
        self.messages = self.malformed = 0

    def start(self) -> None:
        self._start()

    def _handle(
        self, values: list[bytes], received_ms: float, history: bool | None = None, kids: list[str | None] | None = None
    ) -> None:
        verifier = self.verifier
        may_sign = verifier.may_sign_for if verifier is not None and verifier.bindings else None
        for i, raw in enumerate(values):
            entry = checked_step(raw)
            if entry is None:
                self.malformed += 1
                continue
            if may_sign is not None and kids is not None and not may_sign(kids[i], f"router:{entry['router']}"):
                continue  # (a key bound to nodes speaks for them alone)
            self.messages += 1
            if entry["router"] != self.router_id:
                self.deliver(entry)


def checked_step(raw: bytes) -> dict[str, Any] | None:
    """A `canary_topic` record as a router wrote it (router.canary.CanaryHolder.audit), its fields
    checked and bounded; None for anything else."""
    try:
        doc = wire.loads(raw)
    except ValueError:
        return None
    if not isinstance(doc, dict):
        return None
    router_id, step, canary, at, why = (doc.get(k) for k in ("router", "step", "canary", "at_ms", "why"))
    model = doc.get("model")
    if not (isinstance(router_id, str) and 0 < len(router_id) <= 128 and isinstance(step, str) and len(step) <= 16):
        return None
    if not (isinstance(canary, str) and len(canary) <= 64 and isinstance(why, str)):
        return None
    if isinstance(at, bool) or not isinstance(at, int | float) or not math.isfinite(at):
        return None
    if model is not None and not (isinstance(model, str) and 0 < len(model) <= 128):
        return None
    return {"router": router_id, "step": step, "canary": canary, "at_ms": float(at), "why": why[:256], "model": model}


async def canary_ctx(app: web.Application) -> AsyncIterator[None]:
    """The canary's judge (every second), its metrics and audit topic, and the config's own canary."""
    router = app[ROUTER]
    holder = router.canaries
    router.metrics.registry.register(CanaryCollector(holder))
    topic = router.config.canary_topic
    reader = None
    if topic is not None and router.config.kafka is not None:
        from telemetry.kafka.bus import KafkaSender

        signer = router.config.signer()
        holder.sender = KafkaSender(
            router.config.kafka, topic, f"edgeroute-canary-{router.router_id}", "canary", signer
        )
        loop = asyncio.get_running_loop()

        def deliver(entry: dict[str, Any]) -> None:  # (the reader's thread: the holder is the loop's)
            try:
                loop.call_soon_threadsafe(holder.adopt, router, entry)
            except RuntimeError:  # the loop closed at shutdown
                pass

        reader = VerdictReader(router.config.kafka, topic, router.router_id, deliver)
        reader.verifier = router.verifier
        reader.start()
    if router.config.canary is not None:
        holder.start(router, router.config.canary, "config")
    for spec in router.config.model_canaries:
        holder.start_model(router, spec, "config")

    async def judge_loop() -> None:
        while True:
            await asyncio.sleep(1.0)
            holder.judge(router)

    task = asyncio.get_running_loop().create_task(judge_loop())
    try:
        yield
    finally:
        task.cancel()
        if reader is not None:
            await asyncio.to_thread(reader.stop)
        if holder.sender is not None:
            await asyncio.to_thread(holder.sender.close)


__all__ = [
    "canary_ctx",
    "delete_canary",
    "delete_model_canary",
    "get_canary",
    "parse_canary",
    "parse_model_canary",
    "put_model_canary",
    "start_from_request",
]
