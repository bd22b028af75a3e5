"""The policy contract: request, decision, context, and the filter/scorer/picker protocols.

Types and protocols only: this module imports nothing from the engine or the plugins (a test checks).
A policy is pure: it reads an immutable `ClusterView` and a `Context` carrying the clock reading and a
seeded `random.Random`, and returns a `Decision` or a `Rejection`. It never touches Kafka, HTTP, the
wall clock or the global RNG, so the router and the simulator run the same objects and every run is
reproducible from its seed.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, TypeVar, runtime_checkable

from pydantic import BaseModel, ConfigDict

from policies.columns import Columns
from telemetry.cluster.view import BoolArray, ClusterView, FloatArray, ModelTable, NodeState

__all__ = [
    "ClusterView",
    "Context",
    "Decision",
    "Defer",
    "Admitter",
    "CandidateSource",
    "Columns",
    "RowAdmitter",
    "RowFilter",
    "RowGate",
    "RowPicker",
    "RowScorer",
    "Filter",
    "Gate",
    "HOLD_POLL_MS",
    "Learner",
    "PluginClass",
    "RejectStatus",
    "Sampler",
    "Stateful",
    "NodeState",
    "Params",
    "Picker",
    "Policy",
    "Rejection",
    "RouteRequest",
    "Scorer",
]


# The values made on every decision (RouteRequest, Decision) are plain slotted dataclasses, not frozen
# ones: a frozen dataclass sets each field through `object.__setattr__` and costs about eight times as
# much to build (2.0 against 0.24 us for a RouteRequest on the development machine). They are values
# all the same: policies read them and never change them.


@dataclass(slots=True)
class RouteRequest:
    """What a policy knows of one request (a value: read, never changed)."""

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
    tenant: str = ""  # whose traffic it is (router.lifecycle.tenants); "" with tenants off

    @property
    def budget_ms(self) -> float | None:
        """The budget a placement must meet: the stage's own for a workflow stage, else the deadline."""
        return self.stage_deadline_ms if self.stage_deadline_ms is not None else self.deadline_ms


@dataclass(slots=True)
class Decision:
    """The node a policy chose (a value)."""

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


# --- optional hooks ---------------------------------------------------------------------------------
# A filter may implement any of these besides `filter`; the engine checks each plugin against them once,
# when a pipeline is built (tests/unit/test_registry.py checks every registered plugin), never per request.


@runtime_checkable
class Admitter(Protocol):
    """A filter that judges one node at a time: a per-node predicate for this request (None: admits all),
    so the engine can fuse leading filters and sample without filtering every node first."""

    def admitter(self, req: RouteRequest, view: ClusterView, ctx: Context) -> Callable[[NodeState], bool] | None: ...


@runtime_checkable
class CandidateSource(Protocol):
    """A filter that can name its candidates from an index (`has_model`: the view's per-model index).
    The candidates must be exactly the nodes the filter admits: the engine does not check them again."""

    def candidates(self, req: RouteRequest, view: ClusterView) -> Sequence[NodeState]: ...


@runtime_checkable
class Sampler(Protocol):
    """A filter that samples: from `base`, nodes that `admit` accepts (None: cannot, filter instead)."""

    def sample_from(
        self, base: Sequence[NodeState], admit: Callable[[NodeState], bool], ctx: Context
    ) -> list[NodeState] | None: ...


@runtime_checkable
class Gate(Protocol):
    """A filter that may hold the request at the router (delay scheduling) instead of filtering."""

    def gate(
        self, req: RouteRequest, view: ClusterView, nodes: list[NodeState], ctx: Context
    ) -> list[NodeState] | Defer: ...


@runtime_checkable
class Learner(Protocol):
    """A plugin that learns from outcomes: the router feeds every answered request back."""

    def observe(self, req: RouteRequest, latency_ms: float, met_deadline: bool, ctx: Context) -> None: ...


@runtime_checkable
class Stateful(Protocol):
    """A plugin with learned state to show (`/admin/policy`, reports)."""

    def state(self) -> dict[str, Any]: ...


@runtime_checkable
class RejectStatus(Protocol):
    """A filter whose rejection is not a 503 (e.g. 429: the deadline cannot be met anywhere)."""

    def reject_status(self, req: RouteRequest) -> int: ...


# --- the columnar path (policies.columns) ------------------------------------------------------------
# On a model served by many nodes, the engine judges every candidate at once on the view's column
# table, if every plugin of the pipeline implements its columnar hook; each must choose exactly what
# its per-node method chooses (tests/unit/test_columns.py checks every preset both ways).


@runtime_checkable
class RowAdmitter(Protocol):
    """A leading filter on the table's rows: `mask` (None: all rows) narrowed to the rows it admits,
    judged in row order (a filter that draws random numbers draws them as its admitter would)."""

    def admit_rows(
        self, req: RouteRequest, view: ClusterView, table: ModelTable, ctx: Context, mask: BoolArray | None
    ) -> BoolArray | None: ...


@runtime_checkable
class RowFilter(Protocol):
    """`filter` on columns: the candidates it keeps."""

    def filter_rows(self, req: RouteRequest, cols: Columns, ctx: Context) -> Columns: ...


@runtime_checkable
class RowGate(Protocol):
    """`gate` on columns."""

    def gate_rows(self, req: RouteRequest, cols: Columns, ctx: Context) -> Columns | Defer: ...


@runtime_checkable
class RowScorer(Protocol):
    """`score` on columns: one score per candidate row, in row order."""

    def score_rows(self, req: RouteRequest, cols: Columns, ctx: Context) -> FloatArray: ...


@runtime_checkable
class UnitRowScorer(Protocol):
    """A `RowScorer` whose columnar scores are always within [0, 1] and never NaN (min / predicted):
    the engine takes them as they are, where it would clamp `score_rows` (which changes nothing then)."""

    def unit_score_rows(self, req: RouteRequest, cols: Columns, ctx: Context) -> FloatArray: ...


@runtime_checkable
class RowPicker(Protocol):
    """`pick` on columns: the index (into `cols`) of the chosen candidate."""

    def pick_row(self, req: RouteRequest, cols: Columns, scores: FloatArray, ctx: Context) -> int: ...


HOOKS: tuple[type, ...] = (
    Admitter,
    CandidateSource,
    Sampler,
    Gate,
    Learner,
    Stateful,
    RejectStatus,
    RowAdmitter,
    RowFilter,
    RowGate,
    RowScorer,
    UnitRowScorer,
    RowPicker,
)

P_co = TypeVar("P_co", covariant=True)


class PluginClass(Protocol[P_co]):
    """What the registry holds: a plugin class, its name, its parameter model, and its constructor."""

    @property
    def name(self) -> str: ...

    @property
    def Params(self) -> type[Params]: ...  # noqa: N802 - the plugin class's nested parameter model

    def __call__(self, params: Any) -> P_co: ...
