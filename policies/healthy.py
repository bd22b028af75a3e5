"""Filter `healthy`: keep nodes that report `ready` and are live: heard from within `stale_after_ms`,
or alive by the router's own evidence.

Inputs: status, heard_at (the view's staleness), the router's own evidence of life (the view's
`evidence`, see router.lifecycle.evidence: its answers and probes) and its health record (the view's
`health`, see router.lifecycle.health). Telemetry is advice, not a lifeline: a node whose telemetry
stopped (a broker outage, a cut telemetry path) stays routable while the router itself hears from it,
at any age; one silent on both (crashed, partitioned), a draining node, or one ejected for this
request's site after consecutive failures is not chosen; a node back from an ejection or freshly
started is admitted with a probability that ramps up (slow start).

Panic mode (after Envoy's panic threshold), for a view without the router's evidence (tools, tests):
when *no* node in the whole view is fresh, the likely cause is the telemetry path itself, not every
node dying at once, so the filter falls back to the ready nodes heard from within `panic_max_age_ms`
and lets the router's retries skip any that are really gone. Parameters: `panic_max_age_ms` (>= 0,
default 30000; 0 disables panic mode).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from pydantic import Field

from policies.api import ClusterView, Context, NodeState, Params, RouteRequest
from telemetry.cluster.view import BoolArray, ModelTable


class HealthyParams(Params):
    panic_max_age_ms: float = Field(30_000.0, ge=0)


class Healthy:
    name: ClassVar[str] = "healthy"
    reads: ClassVar[frozenset[str]] = frozenset({"status", "heard_at"})
    Params = HealthyParams

    def __init__(self, params: HealthyParams | None = None) -> None:
        self.params = params or HealthyParams()

    def _horizon(self, view: ClusterView, now_ms: float) -> float:
        """Nodes heard since this count as fresh (further back in panic mode)."""
        if view.any_fresh(now_ms) or self.params.panic_max_age_ms <= 0:
            return now_ms - view.stale_after_ms
        return now_ms - self.params.panic_max_age_ms  # panic: nothing in the whole view is fresh

    def admit_rows(
        self, req: RouteRequest, view: ClusterView, table: ModelTable, ctx: Context, mask: BoolArray | None
    ) -> BoolArray | None:
        horizon = self._horizon(view, ctx.now_ms)
        health = view.health
        affected = None if health is None else health.exceptions(req.site, ctx.now_ms)
        if affected is None and table.all_ready_since(horizon):  # the usual case: every row passes
            return mask
        admitted = table.ready & (table.heard >= horizon)
        evidence = view.evidence
        if evidence is not None:  # stale telemetry: the router's own evidence may keep a node live
            now = ctx.now_ms
            rows = table.nodes
            for row in (table.ready & ~admitted).nonzero()[0].tolist():
                if evidence.alive(rows[row].node_id, now):
                    admitted[row] = True
        if mask is not None:
            admitted &= mask
        if health is not None and affected is not None:
            sound = health.admitter(req.site, ctx.now_ms, ctx.rng)
            if sound is not None:  # the few ejected or ramping nodes, in row order (its random draws)
                pos = table.pos
                nodes = table.nodes
                for i in sorted({pos[k] for k in affected if k in pos}):
                    if admitted[i] and not sound(nodes[i]):
                        admitted[i] = False
        return admitted

    def admitter(self, req: RouteRequest, view: ClusterView, ctx: Context) -> Callable[[NodeState], bool]:
        horizon = self._horizon(view, ctx.now_ms)
        sound = None if view.health is None else view.health.admitter(req.site, ctx.now_ms, ctx.rng)
        evidence = view.evidence
        if evidence is not None:
            now = ctx.now_ms
            if sound is None:
                return lambda n: n.ready and (n.heard_at_ms >= horizon or evidence.alive(n.node_id, now))
            return lambda n: n.ready and (n.heard_at_ms >= horizon or evidence.alive(n.node_id, now)) and sound(n)
        if sound is None:
            return lambda n: n.ready and n.heard_at_ms >= horizon
        return lambda n: n.ready and n.heard_at_ms >= horizon and sound(n)

    def filter(self, req: RouteRequest, view: ClusterView, nodes: list[NodeState], ctx: Context) -> list[NodeState]:
        admit = self.admitter(req, view, ctx)
        return [n for n in nodes if admit(n)]
