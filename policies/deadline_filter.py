"""Filter `deadline_filter`: drop nodes predicted to finish after the request's deadline.

Keeps nodes with `predicted_completion_ms <= remaining deadline x (1 - margin)` (see `completion`).
When no node qualifies: a request of priority >= `always_try_min` keeps every candidate (a critical
request is always tried, on the best prediction), a lower one is refused early with 429 and
Retry-After, so the client or its gateway can back off instead of waiting for a certain 504.
Requests without a deadline pass. Parameters: `margin` ([0, 1), default 0), `always_try_min`
(default 1), `default_exec_ms` (default 5).
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from policies.api import ClusterView, Columns, Context, NodeState, Params, RouteRequest
from policies.columns import any_row
from policies.completion import meets_deadline


class DeadlineFilterParams(Params):
    margin: float = Field(0.0, ge=0, lt=1)
    always_try_min: int = 1
    default_exec_ms: float = Field(5.0, gt=0)


class DeadlineFilter:
    name: ClassVar[str] = "deadline_filter"
    reads: ClassVar[frozenset[str]] = frozenset(
        {"expected_wait_ms", "models.ewma_ms_by_batch", "queued_by_priority", "in_flight", "capacity", "partition"}
    )
    Params = DeadlineFilterParams

    def __init__(self, params: DeadlineFilterParams | None = None) -> None:
        self.params = params or DeadlineFilterParams()

    def reject_status(self, req: RouteRequest) -> int:
        return 429

    def filter_rows(self, req: RouteRequest, cols: Columns, ctx: Context) -> Columns:
        budget = req.budget_ms
        if budget is None:
            return cols
        p = self.params
        fits = cols.of(cols.frame.completion_ms(p.default_exec_ms)) <= budget * (1.0 - p.margin)
        if req.priority < p.always_try_min or any_row(fits):
            return cols.keep(fits)
        return cols

    def filter(self, req: RouteRequest, view: ClusterView, nodes: list[NodeState], ctx: Context) -> list[NodeState]:
        if req.budget_ms is None:
            return nodes
        p = self.params
        fits = [n for n in nodes if meets_deadline(view, n, req, p.margin, p.default_exec_ms, ctx.now_ms)]
        if fits or req.priority < self.params.always_try_min:
            return fits
        return nodes
