"""The policy contract: request, decision, context, and the filter/scorer/picker protocols.

Types and protocols only: this module imports nothing from the engine or the plugins (a test checks).
A policy is pure: it reads an immutable `ClusterView` and a `Context` carrying the clock reading and a
seeded `random.Random`, and returns a `Decision` or a `Rejection`. It never touches Kafka, HTTP, the
wall clock or the global RNG, so the router and the simulator run the same objects and every run is
reproducible from its seed.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict

from telemetry.view import ClusterView, NodeState

__all__ = [
    "ClusterView",
    "Context",
    "Decision",
    "Defer",
    "Filter",
    "HOLD_POLL_MS",
    "NodeState",
    "Params",
    "Picker",
    "Policy",
    "Rejection",
    "RouteRequest",
    "Scorer",
]


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What a policy knows of one request."""

    model: str
    priority: int = 0
    deadline_ms: float | None = None  # remaining latency budget at decision time
    site: str | None = None  # the client's partition
    batch: int = 1
    request_id: str = ""
    exclude: frozenset[str] = frozenset()  # nodes already tried for this request
    waited_ms: float = 0.0  # how long the router has already held it for local capacity (delay scheduling)
    # a workflow stage: its own remaining budget (ESG's per-stage split of the end-to-end SLO), and
    # where its input was produced (the node of the stage before it) and how large that input is
    stage_deadline_ms: float | None = None
    input_node: str | None = None
    input_bytes: int = 0
    # the stages that will take this one's output: their models, and how much will go to them
    next_models: tuple[str, ...] = ()
    next_bytes: int = 0

    @property
    def budget_ms(self) -> float | None:
        """The budget a placement must meet: the stage's own for a workflow stage, else the deadline."""
        return self.stage_deadline_ms if self.stage_deadline_ms is not None else self.deadline_ms


@dataclass(frozen=True, slots=True)
class Decision:
    node_id: str
    endpoint: str
    policy: str
    predicted_ms: float | None = None


@dataclass(frozen=True, slots=True)
class Rejection:
    """No node may take the request; `status` is the HTTP status the router answers with."""

    status: int
    reason: str


HOLD_POLL_MS = 10.0  # a held request is asked about again at least this often (the view may show room)


@dataclass(frozen=True, slots=True)
class Defer:
    """Hold the request at the router for up to `wait_ms`, then ask again (delay scheduling).

    The router (and the simulator) wakes it early when a slot frees in `partition`, and asks again
    with `RouteRequest.waited_ms` grown by the time held.
    """

    wait_ms: float
    partition: str
    reason: str = ""


@dataclass(slots=True)
class Context:
    """Everything a policy may know of the world besides the view: the time, and its randomness."""

    now_ms: float
    rng: random.Random = field(default_factory=lambda: random.Random(0))


class Params(BaseModel):
    """Base for plugin parameters: strict, unknown keys rejected."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@runtime_checkable
class Filter(Protocol):
    """Drops candidates that must not take the request. Keeps order."""

    name: ClassVar[str]
    reads: ClassVar[frozenset[str]]

    def filter(self, req: RouteRequest, view: ClusterView, nodes: list[NodeState], ctx: Context) -> list[NodeState]: ...


@runtime_checkable
class Scorer(Protocol):
    """Scores each candidate in [0, 1], higher is better; the engine clamps and weights."""

    name: ClassVar[str]
    reads: ClassVar[frozenset[str]]

    def score(self, req: RouteRequest, view: ClusterView, nodes: list[NodeState], ctx: Context) -> list[float]: ...


@runtime_checkable
class Picker(Protocol):
    """Chooses one candidate given the combined scores (same order as `nodes`)."""

    name: ClassVar[str]
    reads: ClassVar[frozenset[str]]

    def pick(self, req: RouteRequest, nodes: list[NodeState], scores: Sequence[float], ctx: Context) -> NodeState: ...


@runtime_checkable
class Policy(Protocol):
    name: str

    def choose(self, req: RouteRequest, view: ClusterView, ctx: Context) -> Decision | Rejection | Defer: ...
