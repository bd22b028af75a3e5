"""Confidence cascades as the router runs them (router.cascade): the first model where the policy sends
it, the rule's verdict, and the unsure answers sent on to the second model when the escalation rule
(router.lifecycle.cascade.escalate, the router's own) says the trip fits.

Which answers are unsure is not drawn at random: the replay reads it from the first model's answers to
the very payloads its live load sends (`CascadeProfile.unsure`, request i the payload i mod K), so live
and simulated runs escalate the same requests. Without a profile, every second request is unsure.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from policies.api import RouteRequest
from router.lifecycle.cascade import ESCALATED, KEPT, SECOND, SURE, CascadeSpec, escalate
from scenarios.sim.state import Job, SimRequest, SimState
from scenarios.spec.workload import Arrival, Result


@dataclass(frozen=True)
class CascadeProfile:
    """What the live load sends a cascade: whether the first model is unsure of each of its payloads
    (request i sends payload i mod K), and their size on the wire."""

    unsure: tuple[bool, ...] = (True, False)
    body_bytes: int = 0


@dataclass(slots=True)
class SimCascade:
    """One cascade request: its phase (`first`, `second`, or an `audit` nobody waits for)."""

    index: int
    arrival: Arrival
    spec: CascadeSpec
    t0: float
    deadline_at: float
    phase: str = "first"
    first: Result | None = None  # the first model's answer, kept while the second is asked
    wan_bytes: int = 0
    stages: int = 0
    exec_ms: list[float] = field(default_factory=list)


class CascadeDriver(SimState):
    def _start_cascade(self, index: int, a: Arrival, spec: CascadeSpec, t0: float, budget_ms: float) -> None:
        job = SimCascade(index, a, spec, t0, t0 + budget_ms)
        if spec.mode == "second_only":
            job.phase = "second"
            self._cascade_send(job, spec.second, a.priority)
        else:
            self._cascade_send(job, spec.first, a.priority)

    def _cascade_send(self, job: SimCascade, model: str, priority: int) -> None:
        a = job.arrival
        lc = self.router_of(a.site)
        o = self._overhead[model].sample(self.svc_rng)
        left = job.deadline_at - self.now
        route = RouteRequest(model, priority, left, a.site, 1, f"{job.index}.{model}", tenant=self.tenant_of(lc, a))
        life = lc.begin(route, self.policy_of(a.site), self.now, job.deadline_at)
        req = SimRequest(job.index, a, self.now, job.deadline_at, o / 2.0, o / 2.0, life, lc, model=model, cascade=job)
        self._decide(req)

    def _cascade_done(self, req: SimRequest, status: int, reason: str, at_ms: float, served: Job | None) -> None:
        job = req.cascade
        assert job is not None
        if job.phase == "audit":
            return
        node = served.node.spec.id if served is not None else "none"
        if served is not None:
            job.stages += 1
            job.exec_ms.append(served.exec_ms)
            if job.arrival.site is not None and served.node.spec.partition != job.arrival.site:
                job.wan_bytes += self.cascade_profiles.get(job.spec.name, CascadeProfile()).body_bytes
        result = Result(
            job.arrival,
            status,
            at_ms - job.t0,
            node if status == 200 else "none",
            reason,
            served.exec_ms if served is not None else 0.0,
            served.queue_ms if served is not None else 0.0,
            served.rows if served is not None else 1,
        )
        spec = job.spec
        if job.phase == "second":
            if spec.mode == "second_only":
                self._cascade_finish(job, result, SECOND if status == 200 else "failed")
            elif status == 200:
                self._cascade_finish(job, result, ESCALATED)
            else:  # the first model's answer returns, when the second could not answer
                assert job.first is not None
                self._cascade_finish(job, job.first, KEPT, at_ms)
            return
        if status != 200:
            self._cascade_finish(job, result, "failed")
            return
        profile = self.cascade_profiles.get(spec.name, CascadeProfile())
        unsure = profile.unsure[job.index % len(profile.unsure)]
        if not unsure:
            if spec.audit_share > 0 and self.svc_rng.random() < spec.audit_share:
                audit = SimCascade(job.index, job.arrival, spec, at_ms, at_ms + spec.slo_ms, phase="audit")
                self._cascade_send(audit, spec.second, spec.audit_priority)
            self._cascade_finish(job, result, SURE)
            return
        lc = self.router_of(job.arrival.site)
        now = self.now
        if spec.mode == "first_only" or not escalate(
            spec, lc.view(), job.arrival.priority, job.arrival.site, job.deadline_at - now, now
        ):
            self._cascade_finish(job, result, KEPT)
            return
        job.first = result
        job.phase = "second"
        self._cascade_send(job, spec.second, job.arrival.priority)

    def _cascade_finish(self, job: SimCascade, result: Result, label: str, at_ms: float | None = None) -> None:
        self._open -= 1
        latency = result.latency_ms if at_ms is None else at_ms - job.t0
        a = job.arrival
        self.tenant_done(self.router_of(a.site), a, result.status or 0, latency, job.deadline_at - job.t0)
        self.results[job.index] = Result(
            job.arrival,
            result.status,
            latency,
            result.node,
            result.error,
            sum(job.exec_ms),
            result.queue_ms,
            result.rows,
            max(1, job.stages),
            0,
            0,
            job.wan_bytes,
            cascade=label,
        )


__all__ = ["CascadeDriver", "CascadeProfile", "SimCascade"]
