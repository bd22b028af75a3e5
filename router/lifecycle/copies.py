"""Copy scaling: load another warm copy of a model ahead of need when its demand outgrows its copies.

ModelMesh adds copies when the traffic per copy rises; Compass keeps enough warm copies that requests
never wait for a load. Every `interval_ms` the router compares each model's demand (its dispatches per
second over the last `window_ms`, workflow stages included) with what its warm copies can serve:

    capacity = sum over fresh ready nodes holding it resident of slots x 1000 / exec_ms x target_utilisation

where `exec_ms` is the median of those nodes' EWMA at batch 1. The demand compared is the demand one
load time ahead where it is rising (its trend over the window's two halves; a load takes longer than a
deadline, so a copy planned when the demand is already there lands too late); the load time is the
node's own measured one, else the median the fleet's nodes reported for that model, else
`default_load_ms`. When that demand is above capacity, and no copy of that model is already loading,
the router asks one more node to load it (Triton's `POST /v2/repository/models/{m}/load`): among the
fresh ready nodes that serve the model but do not hold it, and whose load could not leave another
model with less warm capacity than its demand (its last warm copy least of all), the one with the most
free memory, then the fewest
outstanding requests. A model gets at most one new copy per `cooldown_ms`, and at most `max_loading`
copies load at once fleet-wide, so the fleet cannot thrash. Each planned load is recorded where the
policies see loads under way (the overlay's `loading`), so routing and planning agree. A model with no
warm copy at all is left to the policy (its first request loads it where the finish estimate is best).

No trend foresees a jump (a flash crowd at a camera, a shift change): a load started when the demand is
already there lands seconds after it. So a model in demand (at least `spare_share` of one copy's
capacity) is also kept at `min_copies` warm copies while its demand is below capacity, GPU memory as a
model cache (Compass): a spare copy is loaded only where it would evict no copy that another model in
demand needs, to serve its demand or to keep its own `min_copies` (so two models cannot take each
other's spare copies in turn), after every copy the demand itself asks for (which may take a spare).

The planner is pure (`plan_copies`); the router runs it as a background task and the simulator runs
the same function on its own clock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

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
    default_load_ms: float = Field(500.0, gt=0, description="a load's time where no node has reported one")
    max_loading: int = Field(2, ge=1, le=1000, description="copies loading at once, fleet-wide (no thrashing)")
    min_copies: int = Field(
        2,
        ge=1,
        le=64,
        description="warm copies kept of a model in demand (at least spare_share of one copy's capacity), ahead "
        "of a jump no trend foresees; only where the load evicts no copy another model in demand needs",
    )
    spare_share: float = Field(
        0.25, gt=0, le=1, description="demand, as a share of one copy's planned capacity, that earns min_copies"
    )


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

    def projected(self, now_ms: float, lead_ms: dict[str, float]) -> dict[str, float]:
        """Each model's demand `lead_ms[model]` ahead on its trend (the window's second half against its
        first), where it is rising; its rate now where it is not (a copy must be warm when the demand
        arrives, not when it is already there: a load takes longer than a deadline)."""
        half = self.window_ms / 2.0
        out: dict[str, float] = {}
        for model, rate in self.rates(now_ms).items():
            times = self._times[model]
            recent = sum(1 for t in times if t >= now_ms - half) * 1000.0 / half
            older = max(0.0, rate * 2.0 - recent)  # (the first half's rate: the window is both halves)
            slope = (recent - older) / half  # requests/s per ms
            ahead = recent + slope * (half / 2.0 + lead_ms.get(model, 0.0))  # (from the second half's middle)
            out[model] = max(rate, ahead) if slope > 0 else rate
        return out

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


def load_time_ms(view: ClusterView, model: str, default_ms: float, node: NodeState | None = None) -> float:
    """What loading `model` takes: `node`'s last measured load of it, else the median of every node's
    that reported one (the fleet learns a model's load time from its first load), else `default_ms`."""
    own = None if node is None else node.model(model)
    if own is not None and own.load_ms is not None:
        return own.load_ms
    seen = sorted(m.load_ms for n in view.serving(model) if (m := n.model(model)) is not None and m.load_ms)
    return seen[len(seen) // 2] if seen else default_ms


def _in_demand(rate: float, capacity: float, warm: list[NodeState], cfg: CopyConfig) -> bool:
    """Whether a model at `rate` earns `min_copies` warm copies: at least `spare_share` of one copy's
    planned capacity (`capacity`: that of its warm copies `warm`, per slot)."""
    return rate > 0.0 and rate >= cfg.spare_share * capacity / max(1, sum(n.capacity for n in warm))


def would_starve(
    view: ClusterView,
    node: NodeState,
    model: str,
    demand_rps: dict[str, float],
    now_ms: float,
    cfg: CopyConfig,
    spare: bool = False,
) -> bool:
    """Whether loading `model` on `node` could leave another model short: `node`'s free memory is below
    the mean size of what it holds (it evicts the least recently used to make room, whichever that is),
    and one of the models it holds would then have warm copies elsewhere that serve less than its demand
    (none at all: its last warm copy), or, where the load is itself a `spare` copy, fewer than its own
    `min_copies` while in demand (`_in_demand`): a copy a demand over capacity asks for may take another
    model's spare, a spare may not."""
    resident = [name for name, m in node.load.models.items() if m.resident and name != model]
    if not resident:
        return False
    free = node.load.memory_budget_bytes - node.load.memory_used_bytes
    if free >= node.load.memory_used_bytes / len(resident):
        return False  # (room for a model of the mean size: nothing need leave)
    for other in resident:
        wanted = demand_rps.get(other, 0.0)
        if wanted <= 0.0:
            continue
        rest = [
            n
            for n in view.serving(other)
            if n.node_id != node.node_id and n.ready and view.is_fresh(n, now_ms) and _resident(n, other)
        ]
        if not rest:
            return True
        left = copy_capacity_rps(other, rest, cfg)
        if left < wanted or (spare and len(rest) < cfg.min_copies and _in_demand(wanted, left, rest, cfg)):
            return True
    return False


def plan_copies(
    view: ClusterView,
    demand_rps: dict[str, float],
    now_ms: float,
    cfg: CopyConfig,
    busy: Iterable[str],
    last_copy_ms: dict[str, float],
    projected_rps: dict[str, float] | None = None,
    loading_now: int | None = None,
) -> list[tuple[str, str]]:
    """(model, node) pairs to load now: at most one per model, none for a model in `busy` (a copy is
    loading) or within its cooldown, at most `max_loading` loading at once with those in `busy` (or
    `loading_now`, every load under way); each
    model judged on its demand ahead (`projected_rps`, else its rate now); never on a node where the
    load could leave another model with less warm capacity than its demand (`would_starve`). Highest
    demand over capacity first."""
    skip = set(busy)
    ahead = projected_rps or {}
    plans: list[tuple[float, str, str]] = []
    for model, rate in demand_rps.items():
        if model in skip or now_ms - last_copy_ms.get(model, -1e18) < cfg.cooldown_ms:
            continue
        serving = [n for n in view.serving(model) if n.ready and view.is_fresh(n, now_ms)]
        warm = [n for n in serving if _resident(n, model)]
        if not warm:
            continue
        capacity = copy_capacity_rps(model, warm, cfg)
        # over its capacity ahead, or short of its min_copies while in demand now (a spare is earned by
        # the demand measured, not by a short window's trend; ranked after those over: under 1)
        spare = len(warm) < cfg.min_copies and _in_demand(rate, capacity, warm, cfg)
        rate = max(rate, ahead.get(model, 0.0))
        if rate > capacity:
            spare = False
        elif not spare:
            continue
        cold = [
            n
            for n in serving
            if not _resident(n, model) and not would_starve(view, n, model, demand_rps, now_ms, cfg, spare)
        ]
        if not cold:
            continue
        target = max(
            cold,
            key=lambda n: (n.load.memory_budget_bytes - n.load.memory_used_bytes, -view.outstanding(n), n.node_id),
        )
        plans.append((rate / capacity, model, target.node_id))
    plans.sort(key=lambda p: (-p[0], p[1]))
    room = max(0, cfg.max_loading - (len(skip) if loading_now is None else loading_now))
    return [(model, node) for _, model, node in plans[:room]]


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

    def plan(self, view: ClusterView, now_ms: float, tracker: Any = None) -> list[tuple[str, str]]:
        """This round's (model, node) loads, each judged on its demand one load time ahead; each is
        marked loading, starts the model's cooldown and, with the router's `tracker`
        (router.lifecycle.overlay), is recorded there as a load under way, where the policies see
        loads (`load_ready_at`, `loader_busy_ms`): routing and planning agree on what is loading."""
        rates = self.demand.rates(now_ms)
        lead = {m: load_time_ms(view, m, self.cfg.default_load_ms) for m in rates}
        ahead = self.demand.projected(now_ms, lead)
        busy = dict.fromkeys(self.loading, 1)
        if tracker is not None:  # (loads the policy set off count too: they hold a node's loader and memory)
            busy |= tracker.loads_under_way(view)
        plans = plan_copies(view, rates, now_ms, self.cfg, busy, self.last_ms, ahead, sum(busy.values()))
        for model, node in plans:
            self.last_ms[model] = now_ms
            self.loading[model] = node
            self.made += 1
            state = view.get(node)
            if tracker is not None and state is not None:
                tracker.loading(state, model, now_ms, load_time_ms(view, model, self.cfg.default_load_ms, state))
        return plans

    def done(self, model: str, node: str | None = None) -> None:
        """The copy of `model` finished loading or failed (on `node`, where known)."""
        if node is None or self.loading.get(model) == node:
            self.loading.pop(model, None)
