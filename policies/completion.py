"""Scorer `completion`: prefer the node predicted to finish this request soonest, at its priority.

predicted_ms(node) = rtt(site, partition) + wait(priority) + exec(model, batch), where

- `rtt` comes from the view's link table (0 inside a partition);
- `wait` is the node's own `expected_wait_ms` for this priority (a priority-scheduling node excludes
  lower-priority work from it) less the report's age (that much of it has passed), plus what this
  router dispatched there since that report
  (`outstanding - reported`) times `exec / capacity`; a node that reports no expected wait is
  estimated as `outstanding / capacity x exec`;
- `exec` is the node's EWMA for this model and batch size (scaled from the nearest smaller measured
  batch), or `default_exec_ms`.

score = min_predicted / predicted (the best node scores 1). Inputs: expected_wait_ms,
models.ewma_ms_by_batch, queued_by_priority, in_flight, capacity, partition. Parameters:
`default_exec_ms` (> 0, default 5).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
from pydantic import Field

from policies.api import ClusterView, Columns, Context, NodeState, Params, RouteRequest
from policies.columns import clamp01_rows
from telemetry.cluster.view import FloatArray

INF = float("inf")


class CompletionParams(Params):
    default_exec_ms: float = Field(5.0, gt=0)


def exec_estimate_ms(node: NodeState, req: RouteRequest, default_exec_ms: float) -> float:
    """The node's EWMA for the model at the request's batch size, else `default_exec_ms`."""
    state = node.model(req.model)
    exec_ms = state.ewma_ms(req.batch) if state is not None else None
    return exec_ms if exec_ms is not None and exec_ms > 0 else default_exec_ms


def predicted_wait_ms(
    view: ClusterView, node: NodeState, req: RouteRequest, exec_ms: float, now_ms: float | None = None
) -> float:
    """How long the request would queue on the node at its priority (see the module docstring)."""
    outstanding = view.outstanding(node)
    reported_wait = node.load.wait_ms(req.priority)
    if reported_wait is None:
        return outstanding / node.capacity * exec_ms
    # the report is `age` old: that much of the wait it predicted has already passed
    age = 0.0 if now_ms is None else max(0.0, now_ms - node.heard_at_ms)
    extra = max(0, outstanding - node.reported_outstanding)
    return max(0.0, reported_wait - age) + extra * exec_ms / node.capacity


def predicted_completion_ms(
    view: ClusterView, node: NodeState, req: RouteRequest, default_exec_ms: float, now_ms: float | None = None
) -> float:
    exec_ms = exec_estimate_ms(node, req, default_exec_ms)
    return view.rtt_ms(req.site, node.partition) + predicted_wait_ms(view, node, req, exec_ms, now_ms) + exec_ms


def meets_deadline(
    view: ClusterView, node: NodeState, req: RouteRequest, margin: float, default_exec_ms: float, now_ms: float
) -> bool:
    """Predicted to finish within the request's remaining budget less `margin` (a share of it): the
    stage's own budget for a workflow stage, else the request's deadline."""
    budget = req.budget_ms
    assert budget is not None
    return predicted_completion_ms(view, node, req, default_exec_ms, now_ms) <= budget * (1.0 - margin)


def best_over(preds: FloatArray) -> FloatArray:
    """min / p for each prediction p (1 where p <= 0), within [0, 1] and never NaN (clamped as
    `pipeline.clamp01` would, so a `UnitRowScorer` may return it): the best scores 1."""
    best = preds[preds.argmin()]  # (min() with NaN's meaning, without the cost of a reduction)
    if 0.0 < best < INF:  # then min / p is in [0, 1] for every p >= min (no NaN: argmin finds NaN first)
        out: FloatArray = best / preds
        return out
    with np.errstate(divide="ignore", invalid="ignore"):
        return clamp01_rows(np.where(preds > 0, best / preds, 1.0))


class Completion:
    name: ClassVar[str] = "completion"
    reads: ClassVar[frozenset[str]] = frozenset(
        {"expected_wait_ms", "models.ewma_ms_by_batch", "queued_by_priority", "in_flight", "capacity", "partition"}
    )
    Params = CompletionParams

    def __init__(self, params: CompletionParams | None = None) -> None:
        self.params = params or CompletionParams()

    def unit_score_rows(self, req: RouteRequest, cols: Columns, ctx: Context) -> FloatArray:
        return best_over(cols.of(cols.frame.completion_ms(self.params.default_exec_ms)))

    score_rows = unit_score_rows

    def score(self, req: RouteRequest, view: ClusterView, nodes: list[NodeState], ctx: Context) -> list[float]:
        preds = [predicted_completion_ms(view, n, req, self.params.default_exec_ms, ctx.now_ms) for n in nodes]
        best = min(preds)
        return [best / p if p > 0 else 1.0 for p in preds]
