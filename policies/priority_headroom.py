"""Filter `priority_headroom`: optionally keep low-priority work off nodes past a load cap.

With `max_load` set, a request below `high_priority_min` may only go to nodes whose outstanding work
per slot is below it, so high-priority requests find capacity; high-priority requests pass untouched.
When no node has headroom the low-priority request is refused early with 429 and Retry-After. The
cap is a load proxy: it refuses work a node could have finished in time (at light load, eight clients
in a closed loop already put one request per slot on every node), so it is off unless an operator
sets it (`max_load: null`, the default, passes every node). The `slo_priority` preset refuses by
prediction alone (its `deadline_filter`): a low-priority request only when no node is predicted to
answer it within its deadline at its priority, which counts the high-priority work that overtakes
it on priority nodes. Inputs: queued_by_priority, in_flight, capacity. Parameters:
`high_priority_min` (default 1), `max_load` (> 0, or null: off, the default).
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from policies.api import ClusterView, Columns, Context, NodeState, Params, RouteRequest


class PriorityHeadroomParams(Params):
    high_priority_min: int = 1
    max_load: float | None = Field(None, gt=0)


class PriorityHeadroom:
    name: ClassVar[str] = "priority_headroom"
    reads: ClassVar[frozenset[str]] = frozenset({"queued_by_priority", "in_flight", "capacity"})
    Params = PriorityHeadroomParams

    def __init__(self, params: PriorityHeadroomParams | None = None) -> None:
        self.params = params or PriorityHeadroomParams()

    def reject_status(self, req: RouteRequest) -> int:
        return 429

    def filter_rows(self, req: RouteRequest, cols: Columns, ctx: Context) -> Columns:
        limit = self.params.max_load
        if limit is None or req.priority >= self.params.high_priority_min:
            return cols
        return cols.keep(cols.of(cols.frame.load_per_slot()) < limit)

    def filter(self, req: RouteRequest, view: ClusterView, nodes: list[NodeState], ctx: Context) -> list[NodeState]:
        limit = self.params.max_load
        if limit is None or req.priority >= self.params.high_priority_min:
            return nodes
        return [n for n in nodes if view.outstanding(n) / n.capacity < limit]
