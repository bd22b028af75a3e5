"""A canary: a candidate policy serving a share of traffic beside the current one, judged per arm and
promoted or rolled back by itself, the same for the live router and the simulator.

`CanarySpec` names the candidate (a policy spec), its `share`, what a request's arm is drawn by (`by`:
`client`, so a device sticks to one arm; `site`; or `request`) and the `guard`. A request's arm is a
hash of its key and the canary's salt (`Canary.arm`): deterministic, the same on every router given
the same salt, about `share` of the keys. Each arm keeps its answers: how many, how many in time (a
200 within the request's deadline: errors and late answers are both not), how many errors, and its
recent latencies (for p99). Every `guard.interval_s` (`judge`):

- **roll back** as soon as the candidate is worse than the current policy beyond `guard.margin`
  (in-time share, in points of a share) with `guard.confidence`: with p the smoothed in-time shares
  ((good + 1) / (n + 2)) and se the standard error of their difference, control - candidate - z * se >
  margin, z the one-sided normal quantile of the confidence; once the candidate has `min_rollback`
  answers (a bad candidate is stopped early, on few requests);
- **promote** when it is not worse: control - candidate + z * se < margin, after `min_requests`
  answers on each arm and `promote_after_s` seconds;
- otherwise keep going; past `max_duration_s` with no verdict, roll back (not proven not worse).

`Canary.history` keeps each interval's figures per arm (in-time share, p99, answers) for the status
page's chart and the report, bounded. Pure: no asyncio, no clock (callers pass `now` in ms).
"""

from __future__ import annotations

import math
import zlib
from collections import deque
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from policies import PolicySpec
from telemetry.measure.quantiles import nearest_rank

CONTROL, CANDIDATE = "control", "candidate"
ARMS = (CONTROL, CANDIDATE)
LATENCIES = 2048  # recent latencies kept per arm (for p99)
HISTORY = 240  # intervals kept for the chart (20 minutes at 5 s)


class GuardSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    margin: float = Field(0.01, ge=0, le=1, description="how much lower the candidate's in-time share may be")
    confidence: float = Field(0.95, ge=0.5, lt=1, description="of a verdict (one-sided)")
    min_requests: int = Field(200, ge=10, le=10_000_000, description="answers on each arm before promoting")
    min_rollback: int = Field(50, ge=10, le=10_000_000, description="answers on the candidate before rolling back")
    interval_s: float = Field(5.0, gt=0, le=3600, description="how often the arms are judged")
    promote_after_s: float = Field(30.0, ge=0, le=86_400, description="the least time before a promotion")
    max_duration_s: float = Field(3600.0, gt=0, le=604_800, description="no verdict by then: rolled back")


class ArmsSpec(BaseModel):
    """What every canary has: the candidate's share, what a request's arm is drawn by, the guard."""

    model_config = ConfigDict(extra="forbid")

    share: float = Field(0.1, gt=0, lt=1, description="the share of keys (clients, sites, requests) on the candidate")
    by: Literal["client", "site", "request"] = "client"
    guard: GuardSpec = Field(default_factory=GuardSpec)
    salt: str = Field("", max_length=64, description="the arms' hash salt (routers that share it agree on arms)")

    def describe(self) -> dict[str, Any]:
        raise NotImplementedError


class CanarySpec(ArmsSpec):
    """A canary of a policy: `PUT /admin/policy` with `{"canary": {...}}`, or the config's `canary`."""

    candidate: PolicySpec

    def describe(self) -> dict[str, Any]:
        return self.candidate.model_dump(exclude_none=True)


class ShadowSpec(BaseModel):
    """Mirrored requests: a copy of a share of the control arm's answered requests run on the candidate
    version, its answer compared with the one the client got and dropped. Sheddable and only where a
    node has a free slot, at most `max_in_flight` at once: it fills gaps, never takes capacity."""

    model_config = ConfigDict(extra="forbid")

    share: float = Field(0.2, gt=0, le=1, description="the share of the control arm's answers mirrored")
    max_in_flight: int = Field(4, ge=1, le=1024, description="copies under way at once, per router")
    min_agreement: float = Field(0.95, ge=0, le=1, description="the least share of copies that agree (top class)")
    min_compared: int = Field(50, ge=10, le=10_000_000, description="copies compared before agreement counts")


VERSION = r"^[0-9]{1,9}$"


class ModelCanarySpec(ArmsSpec):
    """A canary of a model version: `PUT /admin/canary/models/{model}` or the config's `model_canaries`.
    The candidate arm's requests (those that name no version) go to `version`, which nodes serve beside
    the model's current one (a repository version, or `model: NAME, version: V` in a node's models)."""

    model: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.-]+$")
    version: str = Field(pattern=VERSION, description="the candidate version")
    shadow: ShadowSpec | None = None

    def describe(self) -> dict[str, Any]:
        return {"model": self.model, "version": self.version, "shadow": self.shadow is not None}


@dataclass
class ArmStats:
    answers: int = 0
    in_time: int = 0
    errors: int = 0
    latencies: deque[float] = field(default_factory=lambda: deque(maxlen=LATENCIES))
    compared: int = 0  # mirrored copies compared with the control's answer (a model canary's shadow)
    agreed: int = 0

    def p99(self) -> float:
        return nearest_rank(list(self.latencies), 0.99) if self.latencies else 0.0

    def as_json(self) -> dict[str, Any]:
        return {
            "answers": self.answers,
            "in_time": self.in_time,
            "in_time_share": round(self.in_time / self.answers, 4) if self.answers else None,
            "errors": self.errors,
            "p99_ms": round(self.p99(), 2),
            **({"compared": self.compared, "agreed": self.agreed} if self.compared else {}),
        }


@dataclass(frozen=True)
class Verdict:
    action: Literal["promote", "rollback"]
    at_ms: float
    why: str
    figures: dict[str, Any]


class Canary:
    """One canary under way: arms, their answers, the guard's verdict."""

    def __init__(self, spec: ArmsSpec, started_ms: float) -> None:
        self.spec = spec
        self.started_ms = started_ms
        self.arms = {arm: ArmStats() for arm in ARMS}
        self._interval = {arm: ArmStats() for arm in ARMS}
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY)
        self.next_judge_ms = started_ms + spec.guard.interval_s * 1000.0
        self.verdict: Verdict | None = None
        self._cut = int(spec.share * 10_000)
        self._salt = spec.salt.encode()

    def arm(self, key: str) -> str:
        """The arm of a request keyed `key` (its client, site or id, as `spec.by` says)."""
        return CANDIDATE if zlib.crc32(self._salt + key.encode()) % 10_000 < self._cut else CONTROL

    def observe(self, arm: str, status: int, latency_ms: float, deadline_ms: float | None) -> None:
        """An answer on `arm`: its status and latency, against its deadline."""
        for stats in (self.arms[arm], self._interval[arm]):
            stats.answers += 1
            stats.errors += status >= 500
            stats.in_time += status == 200 and (deadline_ms is None or latency_ms <= deadline_ms)
            stats.latencies.append(latency_ms)

    def compared(self, agreed: bool) -> None:
        """A mirrored copy's answer on the candidate, compared with the control's: did it agree?"""
        for stats in (self.arms[CANDIDATE], self._interval[CANDIDATE]):
            stats.compared += 1
            stats.agreed += agreed

    def _agreement(self, z: float) -> tuple[str | None, bool]:
        """(why the candidate disagrees too often, or None; whether agreement allows a promotion)."""
        shadow = getattr(self.spec, "shadow", None)
        if shadow is None:
            return None, True
        cand = self.arms[CANDIDATE]
        if cand.compared < shadow.min_compared:
            return None, False
        p = (cand.agreed + 1) / (cand.compared + 2)
        se = math.sqrt(p * (1 - p) / (cand.compared + 2))
        if p + z * se < shadow.min_agreement:
            return (
                f"the candidate's answers agree with the current version's on {p * 100:.1f}% of "
                f"{cand.compared} mirrored requests: below {shadow.min_agreement * 100:.1f}%"
            ), False
        return None, p - z * se >= shadow.min_agreement

    def judge(self, now_ms: float) -> Verdict | None:
        """The guard's verdict when one is due and reached (at most once), else None."""
        if self.verdict is not None or now_ms < self.next_judge_ms:
            return None
        guard = self.spec.guard
        self.next_judge_ms = now_ms + guard.interval_s * 1000.0
        self.history.append(
            {"t_ms": now_ms, **{arm: self._interval[arm].as_json() for arm in ARMS}}
        )  # fmt: skip
        self._interval = {arm: ArmStats() for arm in ARMS}
        control, cand = self.arms[CONTROL], self.arms[CANDIDATE]
        p_c = (control.in_time + 1) / (control.answers + 2)
        p_t = (cand.in_time + 1) / (cand.answers + 2)
        se = math.sqrt(p_c * (1 - p_c) / (control.answers + 2) + p_t * (1 - p_t) / (cand.answers + 2))
        z = NormalDist().inv_cdf(guard.confidence)
        worse = p_c - p_t
        figures = {
            "control": control.as_json(),
            "candidate": cand.as_json(),
            "worse_by": round(worse, 4),
            "bound": round(z * se, 4),
            "elapsed_s": round((now_ms - self.started_ms) / 1000.0, 1),
            # the candidate's cost so far: its answers less those the control's in-time share would have
            # answered in time (what the canary took from the fleet, never below 0)
            "answered_worse": max(
                0, round(cand.answers * control.in_time / control.answers - cand.in_time) if control.answers else 0
            ),
        }
        disagrees, agreement_allows = self._agreement(z)
        if disagrees is not None:
            self.verdict = Verdict("rollback", now_ms, disagrees, figures)
        elif cand.answers >= guard.min_rollback and worse - z * se > guard.margin:
            why = (
                f"the candidate answers in time {p_t * 100:.1f}% against {p_c * 100:.1f}%: worse by more than "
                f"{guard.margin * 100:.1f} points at {guard.confidence * 100:.0f}% confidence"
            )
            self.verdict = Verdict("rollback", now_ms, why, figures)
        elif (
            min(control.answers, cand.answers) >= guard.min_requests
            and now_ms - self.started_ms >= guard.promote_after_s * 1000.0
            and worse + z * se < guard.margin
            and agreement_allows
        ):
            why = (
                f"the candidate answers in time {p_t * 100:.1f}% against {p_c * 100:.1f}%: not worse by "
                f"{guard.margin * 100:.1f} points at {guard.confidence * 100:.0f}% confidence"
            )
            self.verdict = Verdict("promote", now_ms, why, figures)
        elif now_ms - self.started_ms >= guard.max_duration_s * 1000.0:
            self.verdict = Verdict("rollback", now_ms, "no verdict within max_duration_s", figures)
        return self.verdict

    def state(self) -> dict[str, Any]:
        return {
            "candidate": self.spec.describe(),
            "share": self.spec.share,
            "by": self.spec.by,
            "started_ms": self.started_ms,
            "arms": {arm: stats.as_json() for arm, stats in self.arms.items()},
            "history": list(self.history),
            "verdict": None if self.verdict is None else self.verdict.__dict__,
        }


__all__ = [
    "ARMS",
    "CANDIDATE",
    "CONTROL",
    "ArmsSpec",
    "Canary",
    "CanarySpec",
    "GuardSpec",
    "ModelCanarySpec",
    "ShadowSpec",
    "Verdict",
]
