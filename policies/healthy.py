"""Filter `healthy`: keep nodes that report `ready` and were heard from within `stale_after_ms`.

Inputs: status, heard_at (the view's staleness), and the router's own health record (the view's
`health`, see router.lifecycle.health). A draining node, one whose telemetry stopped (crashed, partitioned),
or one ejected for this request's site after consecutive failures is not chosen; a node back from an
ejection or freshly started is admitted with a probability that ramps up (slow start).

Panic mode (after Envoy's panic threshold): when *no* node in the whole view is fresh, the likely
cause is the telemetry path itself (a broker outage), not every node dying at once. Refusing all
traffic then would turn a monitoring fault into a full outage, so the filter falls back to the ready
nodes heard from within `panic_max_age_ms` and lets the router's retries skip any that are really
gone. Parameters: `panic_max_age_ms` (>= 0, default 30000; 0 disables panic mode).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from pydantic import Field

from policies.api import ClusterView, Context, NodeState, Params, RouteRequest


class HealthyParams(Params):
    panic_max_age_ms: float = Field(30_000.0, ge=0)


class Healthy:
    name: ClassVar[str] = "healthy"
    reads: ClassVar[frozenset[str]] = frozenset({"status", "heard_at"})
    Params = HealthyParams

    def __init__(self, params: HealthyParams | None = None) -> None:
        self.params = params or HealthyParams()

    def admitter(self, req: RouteRequest, view: ClusterView, ctx: Context) -> Callable[[NodeState], bool]:
        if view.any_fresh(ctx.now_ms) or self.params.panic_max_age_ms <= 0:
            horizon = ctx.now_ms - view.stale_after_ms
        else:  # panic: nothing in the whole view is fresh
            horizon = ctx.now_ms - self.params.panic_max_age_ms
        sound = None if view.health is None else view.health.admitter(req.site, ctx.now_ms, ctx.rng)
        if sound is None:
            return lambda n: n.ready and n.heard_at_ms >= horizon
        return lambda n: n.ready and n.heard_at_ms >= horizon and sound(n)

    def filter(self, req: RouteRequest, view: ClusterView, nodes: list[NodeState], ctx: Context) -> list[NodeState]:
        admit = self.admitter(req, view, ctx)
        return [n for n in nodes if admit(n)]
