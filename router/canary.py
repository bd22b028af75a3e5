"""The router's canary holder (router.canary_app serves it; router.lifecycle.canary has the rule)."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import TYPE_CHECKING, Any

from policies import build_policy
from policies.pipeline import Pipeline
from router.lifecycle.canary import ARMS, CANDIDATE, Canary, CanarySpec, Verdict
from telemetry.oip import wire

if TYPE_CHECKING:
    from router.state import Router

log = logging.getLogger("edgeroute.router")

AUDIT = 100  # canary steps kept for /admin/view


class CanaryHolder:
    """The router's canary: the running one (if any), its candidate policy, the audit trail."""

    def __init__(self) -> None:
        self.canary: Canary | None = None
        self.candidate: Pipeline | None = None
        self.log: deque[dict[str, Any]] = deque(maxlen=AUDIT)
        self.outcomes = {(arm, o): 0 for arm in ARMS for o in ("in_time", "late", "error")}
        self.sender: Any = None  # a KafkaSender for the audit topic, or None

    def start(self, router: Router, spec: CanarySpec, origin: str) -> None:
        """Start `spec` (validated: its candidate builds), replacing a running canary."""
        candidate = build_policy(spec.candidate)
        self.canary = Canary(spec, router.clock())
        self.candidate = candidate
        self.audit(router, "start", origin, {"candidate": spec.candidate.model_dump(exclude_none=True),
                                               "share": spec.share, "by": spec.by})  # fmt: skip

    def stop(self, router: Router, why: str) -> None:
        if self.canary is not None:
            self.audit(router, "rollback", why, self.canary.state()["arms"])
        self.canary = self.candidate = None

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
        late = deadline_ms is not None and latency_ms > deadline_ms
        outcome = "error" if status >= 500 else ("in_time" if status == 200 and not late else "late")
        self.outcomes[(arm, outcome)] += 1

    def judge(self, router: Router) -> Verdict | None:
        canary = self.canary
        if canary is None:
            return None
        verdict = canary.judge(router.clock())
        if verdict is None:
            return None
        if verdict.action == "promote" and self.candidate is not None:
            router.apply_policy(canary.spec.candidate, self.candidate, "canary promoted", by_canary=True)
        self.audit(router, verdict.action, verdict.why, verdict.figures)
        self.canary = self.candidate = None
        return verdict

    def audit(self, router: Router, step: str, why: str, figures: dict[str, Any]) -> None:
        entry = {"at_ms": router.clock(), "router": router.router_id, "step": step, "why": why, "figures": figures}
        self.log.append(entry)
        log.warning("canary %s: %s", step, why)
        if self.sender is not None:
            body = wire.dumps(entry)
            asyncio.get_running_loop().run_in_executor(None, self.sender.send, router.router_id.encode(), body, 0)

    def state(self) -> dict[str, Any]:
        return {"running": None if self.canary is None else self.canary.state(), "log": list(self.log)}


__all__ = ["AUDIT", "CanaryHolder"]
