"""A policy canary in the simulator, by the rule the live router follows (router.lifecycle.canary): a
run whose `router:` names a `canary` routes each arrival by its arm's policy, observes each answer on
its arm, and on the guard's verdict promotes the candidate (every router's policy swapped) or rolls it
back, at the same virtual moment the rule reaches it. What it decided, when, on which figures, goes to
the run's report (`canary`)."""

from __future__ import annotations

from typing import Any

from policies import build_policy
from policies.pipeline import Pipeline
from router.lifecycle.canary import CANDIDATE, Canary, CanarySpec
from scenarios.spec.workload import Arrival


class SimCanary:
    """The canary of one simulated run: its arms, the candidate policy per router, its decisions."""

    def __init__(self, spec: CanarySpec, started_ms: float = 0.0) -> None:
        self.spec = spec
        self.canary: Canary | None = Canary(spec, started_ms)
        self._candidates: dict[str | None, Pipeline] = {}
        self.decisions: list[dict[str, Any]] = [
            {"at_s": started_ms / 1000.0, "step": "start", "share": spec.share, "by": spec.by}
        ]
        self.history: list[dict[str, Any]] = []

    def key(self, index: int, a: Arrival) -> str:
        """What an arrival's arm is drawn by: its request, its site, or its client (a site's traffic
        class stands for the clients that send it)."""
        if self.spec.by == "request":
            return str(index)
        if self.spec.by == "site":
            return a.site
        return f"{a.site}/{a.source}"

    def choose(self, index: int, a: Arrival, site: str | None) -> tuple[str | None, Pipeline | None]:
        """(the arm, the policy to route by: None for the router's own) of an arrival."""
        canary = self.canary
        if canary is None:
            return None, None
        arm = canary.arm(self.key(index, a))
        if arm != CANDIDATE:
            return arm, None
        candidate = self._candidates.get(site)
        if candidate is None:  # (each router its own candidate object, as live)
            candidate = self._candidates[site] = build_policy(self.spec.candidate)
        return arm, candidate

    def observe(self, arm: str, status: int, latency_ms: float, deadline_ms: float, now_ms: float) -> str | None:
        """An answer on `arm`; the verdict's action when the guard reaches one now ("promote" or
        "rollback"), else None."""
        canary = self.canary
        if canary is None:
            return None
        canary.observe(arm, status, latency_ms, deadline_ms)
        verdict = canary.judge(now_ms)
        if verdict is None:
            return None
        self.history = list(canary.history)
        self.decisions.append(
            {"at_s": round(now_ms / 1000.0, 3), "step": verdict.action, "why": verdict.why, "figures": verdict.figures}
        )
        self.canary = None
        return verdict.action

    def candidate_for(self, site: str | None) -> Pipeline:
        found = self._candidates.get(site)
        return found if found is not None else build_policy(self.spec.candidate)

    def report(self) -> dict[str, Any]:
        history = self.history if self.canary is None else list(self.canary.history)
        return {"decisions": self.decisions, "history": history}


__all__ = ["SimCanary"]
