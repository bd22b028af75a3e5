"""Scorer `latency`: prefer the node predicted to finish the request soonest.

predicted_ms(node) = (outstanding / capacity + 1) x exec_ms(model, batch), where exec_ms is the node's
EWMA execution time for that model at that batch size (scaled from the nearest smaller measured
batch), or `default_exec_ms` when the node has not measured it yet. Work ahead of the request is
assumed to cost what this request costs, a fair guess per model and a coarse one across models.
score = min_predicted / predicted: the best node scores 1, one twice as slow 0.5.
Inputs: models.ewma_ms_by_batch, queued_by_priority, in_flight, capacity.
Parameters: `default_exec_ms` (> 0, default 5).
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from policies.api import ClusterView, Columns, Context, NodeState, Params, RouteRequest
from policies.completion import best_over
from telemetry.cluster.view import FloatArray


class LatencyParams(Params):
    default_exec_ms: float = Field(5.0, gt=0)


def predicted_ms(view: ClusterView, node: NodeState, model: str, batch: int, default_exec_ms: float) -> float:
    state = node.model(model)
    exec_ms = state.ewma_ms(batch) if state is not None else None
    if exec_ms is None or exec_ms <= 0:
        exec_ms = default_exec_ms
    return (view.outstanding(node) / node.capacity + 1.0) * exec_ms


class Latency:
    name: ClassVar[str] = "latency"
    reads: ClassVar[frozenset[str]] = frozenset(
        {"models.ewma_ms_by_batch", "queued_by_priority", "in_flight", "capacity"}
    )
    Params = LatencyParams

    def __init__(self, params: LatencyParams | None = None) -> None:
        self.params = params or LatencyParams()

    def score(self, req: RouteRequest, view: ClusterView, nodes: list[NodeState], ctx: Context) -> list[float]:
        preds = [predicted_ms(view, n, req.model, req.batch, self.params.default_exec_ms) for n in nodes]
        best = min(preds)
        return [best / p for p in preds]

    def unit_score_rows(self, req: RouteRequest, cols: Columns, ctx: Context) -> FloatArray:
        """`score` on columns: (outstanding / capacity + 1) x exec_ms, then min / predicted."""
        frame = cols.frame
        preds = (frame.load_per_slot() + 1.0) * frame.exec_ms(self.params.default_exec_ms)
        return best_over(cols.of(preds))

    score_rows = unit_score_rows
