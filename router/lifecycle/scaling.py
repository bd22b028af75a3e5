"""Scaling signals: how many nodes each pool (a site and tier) needs for the traffic this router sends
it to keep `target` of the requests within their deadline, per model and for the pool as a whole.

**Demand** (`Demand`, fed by the lifecycle): every request's first attempt counts for the pool of the
node it went to (its site and tier), with the budget it had; a request refused before any node (no
node could take it in time) counts for its own site's edge pool, so unmet demand raises the signal
too. Rates are over the last `window_s` whole seconds; with `lead_s`, a rising rate is taken where its
trend over the window (a least-squares line through each second's count) puts it `lead_s` ahead, so a
signal that a node takes `lead_s` to answer asks for it before the crowd arrives, not after (a falling
rate is taken as it is: nodes are let go on what is, not on a forecast).

**The planner** (`nodes_needed`): each pool a queue of c = nodes x slots servers (M/M/c, Erlang C),
offered a = rate x service time (the model's batch-1 execution time the pool's nodes report, their
mean), the least node count for which the share of requests that wait no longer than what their
deadline leaves after the service, 1 - C(c, a) exp(-(c - a)(D - S)/S), is at least `target`. It is
the queueing model's answer, the one a router can give at telemetry speed; `edgeroute sweep` gives the
simulator's for a whole scenario offline. The pool as a whole (`model` "*") is the same model on the
models' summed work, their rate-weighted service time and their tightest mean deadline.

With active-active routers each sees its own share of the traffic: each exports its own signal, and
an autoscaler reads the largest (`max by (site, tier)`), or the routers' summed `demand`. Pure: no
clock, no I/O; the router exports the signals as metrics (router.metrics), the simulator's autoscaler
(scenarios.sim.autoscale) acts on the same function.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from telemetry.cluster.view import ClusterView, NodeState

Pool = tuple[str, str, str]  # (site, tier, model)
ALL_MODELS = "*"


class ScalingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    target: float = Field(0.99, gt=0, lt=1, description="share of requests to keep within their deadline")
    window_s: int = Field(10, ge=2, le=600, description="seconds the demand is measured over")
    lead_s: float = Field(
        0.0, ge=0, le=3600, description="how far ahead a rising demand is taken (what a new node takes to serve)"
    )
    max_nodes: int = Field(1000, ge=1, le=100_000, description="the most nodes a pool is said to need")


@dataclass(frozen=True)
class Signal:
    site: str
    tier: str
    model: str
    nodes: int  # in rotation now, serving the model
    demand_rps: float
    service_ms: float
    deadline_ms: float
    needed: int


class Demand:
    """Requests per (site, tier, model) in one-second buckets over the last `window_s` seconds, with
    the sum of their budgets (their mean deadline)."""

    def __init__(self, window_s: int = 10) -> None:
        self.window_s = window_s
        self._seconds: deque[tuple[int, dict[Pool, list[float]]]] = deque()
        self._since: int | None = None  # the first second it measured (a young meter's window is shorter)

    def record(self, site: str | None, tier: str, model: str, budget_ms: float | None, now_ms: float) -> None:
        second = int(now_ms // 1000.0)
        if self._since is None:
            self._since = second
        seconds = self._seconds
        if not seconds or seconds[-1][0] != second:
            seconds.append((second, {}))
            while seconds and seconds[0][0] <= second - self.window_s:
                seconds.popleft()
        entry = seconds[-1][1].setdefault((site or "", tier, model), [0.0, 0.0])
        entry[0] += 1.0
        entry[1] += budget_ms if budget_ms is not None and budget_ms > 0 else 0.0

    def rates(self, now_ms: float, lead_s: float = 0.0) -> dict[Pool, tuple[float, float]]:
        """(requests/s, mean budget ms) per pool and model over the window's whole seconds before now,
        a rising rate taken `lead_s` ahead on its trend (module docstring)."""
        second = int(now_ms // 1000.0)
        width = min(self.window_s, second - (second if self._since is None else self._since))
        if width < 1:
            return {}
        first = second - width
        counts: dict[Pool, list[float]] = {}
        budgets: dict[Pool, float] = {}
        for s, pools in self._seconds:
            if first <= s < second:
                for key, (n, budget) in pools.items():
                    counts.setdefault(key, [0.0] * width)[s - first] += n
                    budgets[key] = budgets.get(key, 0.0) + budget
        out: dict[Pool, tuple[float, float]] = {}
        mid = (width - 1) / 2.0
        spread = sum((i - mid) ** 2 for i in range(width))
        for key, per_second in counts.items():
            n = sum(per_second)
            rate = n / width
            if lead_s > 0.0 and width > 2:  # the least-squares slope through the seconds, from the middle
                slope = sum((i - mid) * c for i, c in enumerate(per_second)) / spread
                rate = max(rate, rate + slope * (lead_s + mid + 1.0))
            out[key] = (rate, budgets[key] / n if n else 0.0)
        return out


def erlang_c(servers: int, load: float) -> float:
    """The probability that an arrival waits in an M/M/c queue of `servers` offered `load` Erlangs (1
    when the load is at or past the servers)."""
    if load <= 0.0:
        return 0.0
    if load >= servers:
        return 1.0
    b = 1.0  # Erlang B by its recursion, stable for any size
    for k in range(1, servers + 1):
        b = load * b / (k + load * b)
    return servers * b / (servers - load * (1.0 - b))


def nodes_needed(
    rate_rps: float, service_ms: float, slots: int, deadline_ms: float, target: float, max_nodes: int
) -> int:
    """The least nodes of `slots` each that keep `target` of the requests waiting no longer than their
    deadline leaves after the service (module docstring); `max_nodes` when none does (a deadline the
    service alone misses), 0 with no demand."""
    if rate_rps <= 0.0 or service_ms <= 0.0:
        return 0
    load = rate_rps * service_ms / 1000.0
    slack_ms = deadline_ms - service_ms
    if slack_ms <= 0.0:
        return max_nodes
    n = max(1, math.ceil(load / max(1, slots)))
    while n < max_nodes:
        c = n * max(1, slots)
        if load < c and erlang_c(c, load) * math.exp(-(c - load) * slack_ms / service_ms) <= 1.0 - target:
            return n
        n += 1
    return max_nodes


def signals(view: ClusterView, demand: Demand, cfg: ScalingConfig, now_ms: float) -> list[Signal]:
    """Every pool's signal, per model it had demand for and as a whole (`model` "*")."""
    fleet: dict[tuple[str, str], list[NodeState]] = {}  # (one pass over the view: a pool's nodes)
    for n in view:
        if view.is_fresh(n, now_ms) and n.load.status == "ready":
            fleet.setdefault((n.partition, n.load.tier), []).append(n)
    out: list[Signal] = []
    by_pool: dict[tuple[str, str], list[tuple[float, float, float, int]]] = {}
    for (site, tier, model), (rate, deadline) in sorted(demand.rates(now_ms, cfg.lead_s).items()):
        pool = fleet.get((site, tier), [])
        serving = [n for n in pool if model in n.load.models]
        execs = [e for n in serving if (e := n.load.models[model].ewma_ms(1)) is not None and e > 0]
        if not execs:  # (no node of the pool reports the model: the pool's nodes' own mean)
            execs = [e for n in pool for m in n.load.models.values() if (e := m.ewma_ms(1)) is not None and e > 0]
        service = sum(execs) / len(execs) if execs else 0.0
        slots = round(sum(n.capacity for n in pool) / len(pool)) if pool else 1
        needed = nodes_needed(rate, service, slots, deadline, cfg.target, cfg.max_nodes)
        out.append(
            Signal(site, tier, model, len(serving), round(rate, 3), round(service, 3), round(deadline, 1), needed)
        )
        by_pool.setdefault((site, tier), []).append((rate, service, deadline, slots))
    for (site, tier), parts in by_pool.items():
        rate = sum(p[0] for p in parts)
        service = sum(p[0] * p[1] for p in parts) / rate if rate else 0.0
        deadline = min(p[2] for p in parts if p[0] > 0) if rate else 0.0
        slots = max(p[3] for p in parts)
        nodes = len(fleet.get((site, tier), ()))
        needed = nodes_needed(rate, service, slots, deadline, cfg.target, cfg.max_nodes)
        # (the pool needs at least what its most demanding model needs alone)
        needed = max([needed, *(s.needed for s in out if (s.site, s.tier) == (site, tier))])
        rounded = (round(rate, 3), round(service, 3), round(deadline, 1))
        out.append(Signal(site, tier, ALL_MODELS, nodes, *rounded, needed))
    return out


__all__ = ["ALL_MODELS", "Demand", "ScalingConfig", "Signal", "erlang_c", "nodes_needed", "signals"]
