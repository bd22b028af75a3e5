"""One request's attempts: the state the lifecycle keeps for it and the steps it answers with.

A request is asked about until it ends: `Lifecycle.decide` answers `Send` (an attempt at a node),
`Hold` (a policy deferred it: wait for a slot in a partition, then decide again) or `Answer` (it ends
here without a node's answer: deadline passed, or no node can take it). When an attempt ends,
`Lifecycle.ended` answers `Ended`: answer with it, decide again, or wait for its hedge twin. The
drivers only carry these steps out.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Generic, NamedTuple, TypeVar

from policies.api import Decision, RouteRequest
from policies.pipeline import Pipeline
from router.lifecycle.failures import Failure
from telemetry.cluster.view import NodeState

_NONE_TRIED: frozenset[str] = frozenset()


@dataclass(slots=True)
class Attempts:
    request: RouteRequest  # as admitted: `deadline_ms` is the whole budget
    policy: Pipeline  # taken once: a policy swap mid-request does not change it
    started_ms: float
    deadline_at_ms: float
    stage_deadline_at_ms: float | None = None  # a workflow stage's share ends here
    tried: set[str] = field(default_factory=set)
    attempt: int = 0  # attempts sent (a hedge's duplicate is not one; holding is not one)
    last_error: tuple[int, str] | None = None
    last_kind: Failure | None = None  # how the last failed attempt failed (a node's refusal, unreachable...)
    held_since_ms: float | None = None
    waited_ms: float = 0.0  # held so far (delay scheduling)
    moves: int = 0  # moves tried for it: taken back from a queue to go elsewhere (router.lifecycle.reroute)
    router_id: str = ""  # the router that admitted it ...
    number: int = 0  # ... and its count there: `uid`, written out when first asked for
    _uid: str = ""

    @property
    def uid(self) -> str:
        """This router's own id for the request (attempt ids at the nodes; never the client's id)."""
        if not self._uid:
            self._uid = f"{self.router_id}.{self.number}"
        return self._uid

    def route_request(self, now: float) -> RouteRequest:
        """What the policy sees at `now`: the remaining budget, the nodes tried, what is left of a
        stage's share (built field by field: this runs on every decision)."""
        req = self.request
        stage_at = self.stage_deadline_at_ms
        return RouteRequest(
            req.model,
            req.priority,
            self.deadline_at_ms - now,
            req.site,
            req.batch,
            req.request_id,
            frozenset(self.tried) if self.tried else _NONE_TRIED,
            self.waited_ms,
            None if stage_at is None else stage_at - now,
            req.input_node,
            req.input_bytes,
            req.next_models,
            req.next_bytes,
            req.tenant,
        )


# The steps below are values made on every decision: plain slotted dataclasses (see policies.api on
# why not frozen ones); the drivers read them and never change them.


@dataclass(slots=True)
class Send:
    """Forward attempt `attempt` to `decision.node_id` (`state` is that node as the policy saw it)."""

    decision: Decision
    state: NodeState
    attempt: int
    hedge: bool = False


@dataclass(slots=True)
class Hold:
    """Wait for a slot in `partition` for at most `wait_ms`, then decide again."""

    partition: str
    wait_ms: float


@dataclass(slots=True)
class Answer:
    """The request ends with this error, without (another) node's answer."""

    status: int
    reason: str


class Next(enum.Enum):
    """What a request does after one of its attempts ended (`Lifecycle.ended`)."""

    ANSWER = "answer"  # it ends with this attempt's answer
    RETRY = "retry"  # decide again (the nodes tried excluded)
    WAIT = "wait"  # its hedge twin is still out: that answer decides


T = TypeVar("T")


class Ended(NamedTuple, Generic[T]):
    """An attempt's end: what the request does `next`, and the request held for the freed slot that
    the driver resumes now (`woken`), if any. (A tuple: one is made for every attempt.)"""

    next: Next
    woken: T | None = None
