"""Scorer `queue`: prefer nodes with fewer outstanding requests per execution slot.

score = 1 / (1 + outstanding / capacity), where outstanding is the view's estimate (the node's last
report corrected by the router's own dispatches and settles since). An idle node scores 1; a node with
one request queued per slot scores 0.5. Inputs: queued_by_priority, in_flight, capacity.
Parameters: none.
"""

from __future__ import annotations

from typing import ClassVar

from policies.api import ClusterView, Columns, Context, NodeState, Params, RouteRequest
from telemetry.cluster.view import FloatArray


class QueueParams(Params):
    pass


class Queue:
    name: ClassVar[str] = "queue"
    reads: ClassVar[frozenset[str]] = frozenset({"queued_by_priority", "in_flight", "capacity"})
    Params = QueueParams

    def __init__(self, params: QueueParams | None = None) -> None:
        self.params = params or QueueParams()

    def score_rows(self, req: RouteRequest, cols: Columns, ctx: Context) -> FloatArray:
        scores: FloatArray = 1.0 / (1.0 + cols.of(cols.frame.load_per_slot()))
        return scores

    def score(self, req: RouteRequest, view: ClusterView, nodes: list[NodeState], ctx: Context) -> list[float]:
        return [1.0 / (1.0 + view.outstanding(n) / n.capacity) for n in nodes]
