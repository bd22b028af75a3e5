"""Filter `locality`: keep a request in its own partition while that partition can serve it in time.

A request that names its site (`parameters.site`, `x-edgeroute-site`, or the client's key) keeps only
the nodes of that partition with room for it: with a deadline, a node whose predicted completion at
the request's priority (see `completion`) is within the deadline less `margin`; without one, a node
with outstanding work per slot below `max_load`. When no local node has room, or the request names no
site, every candidate passes and the scorers choose (with `completion`, by predicted finish including
the link RTT). This is Ray Serve's local-then-anywhere, made load- and deadline-aware; holding the
request for a moment before spilling is `delay_spill`'s job. Inputs: partition, expected_wait_ms,
models.ewma_ms_by_batch, queued_by_priority, in_flight, capacity. Parameters: `max_load` (> 0,
default 1.0: a free slot), `margin` ([0, 1), default 0.2: the prediction cannot see higher-priority
work still to arrive), `default_exec_ms` (default 5).
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from policies.api import ClusterView, Columns, Context, NodeState, Params, RouteRequest
from policies.columns import Frame, any_row
from policies.completion import meets_deadline
from telemetry.cluster.view import BoolArray


class LocalityParams(Params):
    max_load: float = Field(1.0, gt=0)
    margin: float = Field(0.2, ge=0, lt=1)
    default_exec_ms: float = Field(5.0, gt=0)


def has_room(
    view: ClusterView,
    node: NodeState,
    req: RouteRequest,
    now_ms: float,
    max_load: float,
    margin: float,
    default_exec_ms: float,
) -> bool:
    """Room for this request: predicted in time (with a deadline), else below `max_load` per slot."""
    if req.deadline_ms is None:
        return view.outstanding(node) / node.capacity < max_load
    return meets_deadline(view, node, req, margin, default_exec_ms, now_ms)


def room_rows(frame: Frame, req: RouteRequest, max_load: float, margin: float, default_exec_ms: float) -> BoolArray:
    """`has_room` of every row of the frame's table."""
    if req.deadline_ms is None:
        return frame.load_per_slot() < max_load
    budget = req.budget_ms
    assert budget is not None
    return frame.completion_ms(default_exec_ms) <= budget * (1.0 - margin)


class Locality:
    name: ClassVar[str] = "locality"
    reads: ClassVar[frozenset[str]] = frozenset(
        {"partition", "expected_wait_ms", "models.ewma_ms_by_batch", "queued_by_priority", "in_flight", "capacity"}
    )
    Params = LocalityParams

    def __init__(self, params: LocalityParams | None = None) -> None:
        self.params = params or LocalityParams()

    def filter(self, req: RouteRequest, view: ClusterView, nodes: list[NodeState], ctx: Context) -> list[NodeState]:
        if req.site is None:
            return nodes
        p = self.params
        site, now = req.site, ctx.now_ms
        local = [
            n
            for n in nodes
            if n.partition == site and has_room(view, n, req, now, p.max_load, p.margin, p.default_exec_ms)
        ]
        return local or nodes

    def filter_rows(self, req: RouteRequest, cols: Columns, ctx: Context) -> Columns:
        if req.site is None:
            return cols
        p = self.params
        frame = cols.frame
        local = cols.of(frame.in_partition(req.site) & room_rows(frame, req, p.max_load, p.margin, p.default_exec_ms))
        return cols.keep(local) if any_row(local) else cols
