"""Filter `stage_budget`: keep the nodes predicted to finish a workflow stage within its own budget.

ESG splits a workflow's end-to-end SLO into per-stage budgets (`policies.budgets`); the router sends
each stage with its remaining budget (`RouteRequest.stage_deadline_ms`). This filter keeps the nodes
whose Compass finish estimate (`warm_model`: wait, load where cold, input arrival where the input is
elsewhere, execution) fits that budget less `margin`. When none fits, every candidate is kept: a stage
that overruns its share may still finish the workflow in time (the later stages' shares absorb it),
so it is placed on the best estimate instead of being refused. Single-model requests are checked
against their deadline the same way. Parameters: `margin` ([0, 1), default 0), and those of
`warm_model`.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from policies.api import ClusterView, Columns, Context, NodeState, RouteRequest
from policies.columns import any_row
from policies.warm_model import READS, WarmModelParams, finish_estimate_ms, finish_estimate_rows


class StageBudgetParams(WarmModelParams):
    margin: float = Field(0.0, ge=0, lt=1)


class StageBudget:
    name: ClassVar[str] = "stage_budget"
    reads: ClassVar[frozenset[str]] = READS
    Params = StageBudgetParams

    def __init__(self, params: StageBudgetParams | None = None) -> None:
        self.params = params or StageBudgetParams()

    def filter(self, req: RouteRequest, view: ClusterView, nodes: list[NodeState], ctx: Context) -> list[NodeState]:
        budget = req.budget_ms
        if budget is None:
            return nodes
        limit = budget * (1.0 - self.params.margin)
        fits = [n for n in nodes if finish_estimate_ms(view, n, req, self.params, ctx.now_ms) <= limit]
        return fits or nodes

    def filter_rows(self, req: RouteRequest, cols: Columns, ctx: Context) -> Columns:
        """`filter` on columns (the same estimate, the same fallback)."""
        budget = req.budget_ms
        if budget is None:
            return cols
        limit = budget * (1.0 - self.params.margin)
        fits = cols.of(finish_estimate_rows(cols.frame, req, self.params, ctx.now_ms)) <= limit
        return cols.keep(fits) if any_row(fits) else cols
