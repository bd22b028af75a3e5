"""Filter `healthy`: keep nodes that report `ready` and were heard from within `stale_after_ms`.

Inputs: status, heard_at (the view's staleness). Parameters: none. A draining node or one whose
telemetry stopped (crashed, partitioned, broker outage) is never chosen.
"""

from __future__ import annotations

from typing import ClassVar

from policies.api import ClusterView, Context, NodeState, Params, RouteRequest


class HealthyParams(Params):
    pass


class Healthy:
    name: ClassVar[str] = "healthy"
    reads: ClassVar[frozenset[str]] = frozenset({"status", "heard_at"})
    Params = HealthyParams

    def __init__(self, params: HealthyParams | None = None) -> None:
        self.params = params or HealthyParams()

    def filter(
        self, req: RouteRequest, view: ClusterView, nodes: list[NodeState], ctx: Context
    ) -> list[NodeState]:
        return [n for n in nodes if n.ready and view.is_fresh(n, ctx.now_ms)]
