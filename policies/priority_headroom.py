"""Filter `priority_headroom`: keep low-priority work off nodes without headroom.

A request below `high_priority_min` may only go to nodes whose outstanding work per slot is below
`max_load`, so high-priority requests find capacity; high-priority requests pass untouched. When no
node has headroom the low-priority request is refused early with 429 and Retry-After (shed, not
queued behind critical work). Inputs: queued_by_priority, in_flight, capacity. Parameters:
`high_priority_min` (default 1), `max_load` (> 0, default 1.0).
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from policies.api import ClusterView, Columns, Context, NodeState, Params, RouteRequest


class PriorityHeadroomParams(Params):
    high_priority_min: int = 1
    max_load: float = Field(1.0, gt=0)


class PriorityHeadroom:
    name: ClassVar[str] = "priority_headroom"
    reads: ClassVar[frozenset[str]] = frozenset({"queued_by_priority", "in_flight", "capacity"})
    Params = PriorityHeadroomParams

    def __init__(self, params: PriorityHeadroomParams | None = None) -> None:
        self.params = params or PriorityHeadroomParams()

    def reject_status(self, req: RouteRequest) -> int:
        return 429

    def filter_rows(self, req: RouteRequest, cols: Columns, ctx: Context) -> Columns:
        if req.priority >= self.params.high_priority_min:
            return cols
        return cols.keep(cols.of(cols.frame.load_per_slot()) < self.params.max_load)

    def filter(self, req: RouteRequest, view: ClusterView, nodes: list[NodeState], ctx: Context) -> list[NodeState]:
        if req.priority >= self.params.high_priority_min:
            return nodes
        limit = self.params.max_load
        return [n for n in nodes if view.outstanding(n) / n.capacity < limit]
