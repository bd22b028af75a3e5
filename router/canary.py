"""The router's canary holder (router.canary_app serves it; router.lifecycle.canary has the rule).

Several routers share one decision: every step a router takes is audited with the canary's digest (a
hash of its spec) on `canary_topic`, and each router reads the topic (router.canary_app); a verdict
(promote, roll back) another router took for the canary this one runs, the same digest, since this one
started it, is this router's verdict too (`adopt`): the first router to decide decides for them all,
and an operator's rollback at one router rolls every router back. What a message can do is bounded by
what the router already runs: it can end the canary this router has, the way the peer ended it (a
promotion applies this router's own candidate), never start one or name a policy; messages are signed
and checked where telemetry keys are configured.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
from collections import Counter, deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from policies import build_policy
from policies.pipeline import Pipeline
from router.lifecycle.canary import ARMS, CANDIDATE, Canary, CanarySpec, ModelCanarySpec, Verdict
from telemetry.oip import wire

if TYPE_CHECKING:
    from router.state import Router

log = logging.getLogger("edgeroute.router")

AUDIT = 100  # canary steps kept for /admin/view
OUTCOMES = ("in_time", "late", "error")
SHADOW_RESULTS = ("agreed", "disagreed", "failed", "skipped")


def outcome_of(status: int, latency_ms: float, deadline_ms: float | None) -> str:
    late = deadline_ms is not None and latency_ms > deadline_ms
    return "error" if status >= 500 else ("in_time" if status == 200 and not late else "late")


class ModelCanary:
    """One model's canary of a version: its arms, its shadow copies under way, what they came to."""

    def __init__(self, spec: ModelCanarySpec, now_ms: float, totals: Counter[tuple[str, ...]] | None = None) -> None:
        self.spec = spec
        self.canary = Canary(spec, now_ms)
        self.candidate_model = f"{spec.model}:{spec.version}"  # (the name nodes report it under)
        self.outcomes = {(arm, o): 0 for arm in ARMS for o in OUTCOMES}
        self.shadow = dict.fromkeys(SHADOW_RESULTS, 0)
        self.shadow_in_flight = 0
        self.totals: Counter[tuple[str, ...]] = Counter() if totals is None else totals  # (the metrics': cumulative)
        self._draw = random.Random().random
        self.digest = digest(spec)
        self.started_ms = now_ms

    def counted(self, arm: str, outcome: str) -> None:
        self.outcomes[(arm, outcome)] += 1
        self.totals[("answer", self.spec.model, arm, outcome)] += 1

    def shadowed(self, result: str) -> None:
        self.shadow[result] += 1
        self.totals[("shadow", self.spec.model, result)] += 1

    def shadow_due(self) -> bool:
        """Whether this control answer is mirrored: its share drawn, and room under `max_in_flight`."""
        shadow = self.spec.shadow
        if shadow is None or self._draw() >= shadow.share:
            return False
        if self.shadow_in_flight >= shadow.max_in_flight:
            self.shadowed("skipped")
            return False
        return True


def digest(spec: CanarySpec | ModelCanarySpec) -> str:
    """A canary's name across routers: a hash of its spec (routers given the same spec agree on it)."""
    return hashlib.sha256(wire.dumps(spec.model_dump(mode="json"))).hexdigest()[:16]


VERDICTS = ("promote", "rollback")


class CanaryHolder:
    """The router's canary: the running one (if any), its candidate policy, the audit trail."""

    def __init__(self) -> None:
        self.canary: Canary | None = None
        self.candidate: Pipeline | None = None
        self.log: deque[dict[str, Any]] = deque(maxlen=AUDIT)
        self.outcomes = {(arm, o): 0 for arm in ARMS for o in OUTCOMES}
        self.sender: Any = None  # a KafkaSender for the audit topic, or None
        self.models: dict[str, ModelCanary] = {}  # model -> its version canary under way
        self.model_totals: Counter[tuple[str, ...]] = Counter()  # every model canary's answers and copies
        self.pinned: dict[str, str] = {}  # model -> the version a promotion sends its unversioned requests to
        self.digest: str | None = None  # the running policy canary's (`digest`)
        self.started_ms = 0.0
        self.adopted = 0  # verdicts other routers took, taken here (`adopt`)

    def start(self, router: Router, spec: CanarySpec, origin: str) -> None:
        """Start `spec` (validated: its candidate builds), replacing a running canary."""
        candidate = build_policy(spec.candidate)
        self.canary = Canary(spec, router.clock())
        self.candidate = candidate
        self.digest, self.started_ms = digest(spec), router.clock()
        self.audit(router, "start", origin, {"candidate": spec.candidate.model_dump(exclude_none=True),
                                               "share": spec.share, "by": spec.by})  # fmt: skip

    def stop(self, router: Router, why: str) -> None:
        if self.canary is not None:
            self._end(router, "rollback", why, self.canary.state()["arms"], why)

    def _end(self, router: Router, action: str, why: str, figures: dict[str, Any], origin: str) -> None:
        """End the running policy canary: a promotion swaps its candidate in (`origin`: the swap's why);
        audited."""
        spec = None if self.canary is None else self.canary.spec
        if action == "promote" and self.candidate is not None and isinstance(spec, CanarySpec):
            router.apply_policy(spec.candidate, self.candidate, origin, by_canary=True)
        self.audit(router, action, why, figures)
        self.canary = self.candidate = self.digest = None

    def _end_model(self, router: Router, run: ModelCanary, action: str, why: str, figures: dict[str, Any]) -> None:
        """End a version canary: a promotion pins its model to the version; audited."""
        model = run.spec.model
        del self.models[model]
        if action == "promote":
            self.pinned[model] = run.spec.version
        self.audit(router, action, why, {"model": model, "version": run.spec.version, **figures}, run.digest)

    def arm(self, key: str) -> tuple[str | None, Pipeline | None]:
        """(the arm, the policy to route by: None for the current one) of a request keyed `key`."""
        canary = self.canary
        if canary is None:
            return None, None
        arm = canary.arm(key)
        return arm, (self.candidate if arm == CANDIDATE else None)

    def observe(self, arm: str, status: int, latency_ms: float, deadline_ms: float | None) -> None:
        if self.canary is None:
            return
        self.canary.observe(arm, status, latency_ms, deadline_ms)
        self.outcomes[(arm, outcome_of(status, latency_ms, deadline_ms))] += 1

    # --- model versions ---------------------------------------------------------------------------

    def start_model(self, router: Router, spec: ModelCanarySpec, origin: str) -> None:
        """Start a version canary of `spec.model`, replacing one under way for that model."""
        run = self.models[spec.model] = ModelCanary(spec, router.clock(), self.model_totals)
        figures = {"model": spec.model, "version": spec.version, "share": spec.share, "by": spec.by,
                   "shadow": spec.shadow is not None}  # fmt: skip
        self.audit(router, "start", origin, figures, run.digest)

    def stop_model(self, router: Router, model: str, why: str) -> bool:
        """Roll `model`'s canary back (True), or, with none under way, undo a promotion's pin (True);
        False when there was neither."""
        run = self.models.pop(model, None)
        if run is not None:
            figures = {"model": model, "version": run.spec.version, **run.canary.state()["arms"]}
            self.audit(router, "rollback", why, figures, run.digest)
            return True
        if self.pinned.pop(model, None) is not None:
            self.audit(router, "unpin", why, {"model": model})
            return True
        return False

    def route_model(self, model: str, key: Callable[[str], str]) -> tuple[ModelCanary | None, str | None, str]:
        """(the model's canary, the request's arm, the version it goes to) for a request of `model` that
        names no version: the candidate's arm to the candidate version, a promoted version's pin, else
        the model's own ("": the node's default). `key(by)` is the request's client, site or id."""
        run = self.models.get(model)
        if run is None:
            return None, None, self.pinned.get(model, "")
        arm = run.canary.arm(key(run.spec.by))
        return run, arm, (run.spec.version if arm == CANDIDATE else self.pinned.get(model, ""))

    def observe_model(
        self, run: ModelCanary, arm: str, status: int, latency_ms: float, deadline_ms: float | None
    ) -> None:
        if self.models.get(run.spec.model) is not run:  # (ended while the request was under way)
            return
        run.canary.observe(arm, status, latency_ms, deadline_ms)
        run.counted(arm, outcome_of(status, latency_ms, deadline_ms))

    def _judge_models(self, router: Router) -> None:
        now = router.clock()
        for run in list(self.models.values()):
            verdict = run.canary.judge(now)
            if verdict is not None:
                self._end_model(router, run, verdict.action, verdict.why, verdict.figures)

    def judge(self, router: Router) -> Verdict | None:
        if self.models:
            self._judge_models(router)
        canary = self.canary
        if canary is None:
            return None
        verdict = canary.judge(router.clock())
        if verdict is None:
            return None
        self._end(router, verdict.action, verdict.why, verdict.figures, "canary promoted")
        return verdict

    def adopt(self, router: Router, entry: dict[str, Any]) -> bool:
        """Another router's step for a canary (a checked `canary_topic` record, router.canary_app): a
        verdict for the canary this router runs, taken since it started it, is taken here too (module
        docstring). True when it was."""
        if entry["router"] == router.router_id or entry["step"] not in VERDICTS:
            return False
        why = f"adopted from router {entry['router']}: {entry['why']}"[:512]
        model = entry.get("model")
        if model is None:
            canary = self.canary
            if canary is None or self.digest != entry["canary"] or entry["at_ms"] < self.started_ms - 1000.0:
                return False
            promotes = self.candidate is not None and isinstance(canary.spec, CanarySpec)
            action = entry["step"] if promotes else "rollback"  # (nothing to swap in: rolled back)
            self._end(router, action, why, canary.state()["arms"], why)
        else:
            run = self.models.get(model)
            if run is None or run.digest != entry["canary"] or entry["at_ms"] < run.started_ms - 1000.0:
                return False
            self._end_model(router, run, entry["step"], why, {})
        self.adopted += 1
        return True

    def audit(self, router: Router, step: str, why: str, figures: dict[str, Any], canary: str | None = None) -> None:
        """Record a step (the log, the audit topic); a version canary's names `canary`, its digest."""
        entry = {"at_ms": router.clock(), "router": router.router_id, "step": step, "why": why, "figures": figures}
        model = figures.get("model")
        if isinstance(model, str):  # (a version canary's step: named by its model and its spec's digest)
            entry["model"] = model
            entry["canary"] = canary or ""
        elif self.digest is not None:
            entry["canary"] = self.digest
        self.log.append(entry)
        log.warning("canary %s: %s", step, why)
        if self.sender is not None:
            body = wire.dumps(entry)
            asyncio.get_running_loop().run_in_executor(None, self.sender.send, router.router_id.encode(), body, 0)

    def state(self) -> dict[str, Any]:
        return {
            "running": None if self.canary is None else self.canary.state(),
            "models": {
                m: {**run.canary.state(), "shadow": {**run.shadow, "in_flight": run.shadow_in_flight}}
                for m, run in self.models.items()
            },
            "pinned": dict(self.pinned),
            "log": list(self.log),
        }


__all__ = ["AUDIT", "CanaryHolder", "ModelCanary", "outcome_of"]
