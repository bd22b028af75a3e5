"""Copy scaling: load another warm copy of a model ahead of need when its demand outgrows its copies.

ModelMesh adds copies when the traffic per copy rises; Compass keeps enough warm copies that requests
never wait for a load. Every `interval_ms` the router compares each model's demand (its dispatches per
second over the last `window_ms`, workflow stages included) with what its warm copies can serve:

    capacity = sum over fresh ready nodes holding it resident of slots x 1000 / exec_ms x target_utilisation

where `exec_ms` is the median of those nodes' EWMA at batch 1. When demand is above capacity, and no
copy of that model is already loading, the router asks one more node to load it (Triton's
`POST /v2/repository/models/{m}/load`): among the fresh ready nodes that serve the model but do not
hold it, the one with the most free memory, then the fewest outstanding requests. A model gets at most
one new copy per `cooldown_ms`. A model with no warm copy at all is left to the policy (its first
request loads it where the finish estimate is best).

The planner is pure (`plan_copies`); the router runs it as a background task and the simulator runs
the same function on its own clock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from telemetry.cluster.view import ClusterView, NodeState


class CopyConfig(BaseModel):
    """The router's `copies` section."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = False
    interval_ms: float = Field(500.0, gt=0, description="how often demand is compared with the warm copies")
    window_ms: float = Field(2000.0, gt=0, description="demand is dispatches per second over this window")
    target_utilisation: float = Field(0.7, gt=0, le=1, description="share of a copy's capacity planned for")
    cooldown_ms: float = Field(3000.0, ge=0, description="least time between two new copies of one model")
    default_exec_ms: float = Field(5.0, gt=0)


@dataclass
class DemandMeter:
    """Dispatch times per model over a sliding window."""

    window_ms: float
    _times: dict[str, deque[float]] = field(default_factory=dict)

    def record(self, model: str, now_ms: float) -> None:
        times = self._times.setdefault(model, deque())
        times.append(now_ms)
        while times[0] < now_ms - self.window_ms:  # bounded by the window whether or not anyone reads it
            times.popleft()

    def rates(self, now_ms: float) -> dict[str, float]:
        """Requests per second per model over the window (models gone quiet are dropped)."""
        out: dict[str, float] = {}
        for model, times in list(self._times.items()):
            while times and times[0] < now_ms - self.window_ms:
                times.popleft()
            if times:
                out[model] = len(times) * 1000.0 / self.window_ms
            else:
                del self._times[model]
        return out


def _resident(node: NodeState, model: str) -> bool:
    state = node.model(model)
    return state is not None and state.resident


def copy_capacity_rps(model: str, warm: list[NodeState], cfg: CopyConfig) -> float:
    times = sorted(
        ms for n in warm if (m := n.model(model)) is not None and (ms := m.ewma_ms(1)) is not None and ms > 0
    )
    exec_ms = times[len(times) // 2] if times else cfg.default_exec_ms
    return sum(n.capacity for n in warm) * 1000.0 / exec_ms * cfg.target_utilisation


def plan_copies(
    view: ClusterView,
    demand_rps: dict[str, float],
    now_ms: float,
    cfg: CopyConfig,
    busy: Iterable[str],
    last_copy_ms: dict[str, float],
) -> list[tuple[str, str]]:
    """(model, node) pairs to load now: at most one per model, none for a model in `busy` (a copy is
    loading) or within its cooldown. Highest demand over capacity first."""
    skip = set(busy)
    plans: list[tuple[float, str, str]] = []
    for model, rate in demand_rps.items():
        if model in skip or now_ms - last_copy_ms.get(model, -1e18) < cfg.cooldown_ms:
            continue
        serving = [n for n in view.serving(model) if n.ready and view.is_fresh(n, now_ms)]
        warm = [n for n in serving if _resident(n, model)]
        if not warm:
            continue
        capacity = copy_capacity_rps(model, warm, cfg)
        if rate <= capacity:
            continue
        cold = [n for n in serving if not _resident(n, model)]
        if not cold:
            continue
        target = max(
            cold,
            key=lambda n: (n.load.memory_budget_bytes - n.load.memory_used_bytes, -view.outstanding(n), n.node_id),
        )
        plans.append((rate / capacity, model, target.node_id))
    plans.sort(key=lambda p: (-p[0], p[1]))
    return [(model, node) for _, model, node in plans]


class CopyState:
    """What copy scaling remembers between rounds, for the router and the simulator alike: the demand
    meter, the copy each model has loading (model -> node), when each model last got a copy, and how
    many copies were started."""

    def __init__(self, cfg: CopyConfig) -> None:
        self.cfg = cfg
        self.demand = DemandMeter(cfg.window_ms)
        self.loading: dict[str, str] = {}
        self.last_ms: dict[str, float] = {}
        self.made = 0

    def record(self, model: str, now_ms: float) -> None:
        """One dispatch of `model` (metered only while copy scaling is on)."""
        if self.cfg.enabled:
            self.demand.record(model, now_ms)

    def plan(self, view: ClusterView, now_ms: float) -> list[tuple[str, str]]:
        """This round's (model, node) loads; each is marked loading and starts the model's cooldown."""
        plans = plan_copies(view, self.demand.rates(now_ms), now_ms, self.cfg, self.loading, self.last_ms)
        for model, node in plans:
            self.last_ms[model] = now_ms
            self.loading[model] = node
            self.made += 1
        return plans

    def done(self, model: str, node: str | None = None) -> None:
        """The copy of `model` finished loading or failed (on `node`, where known)."""
        if node is None or self.loading.get(model) == node:
            self.loading.pop(model, None)
