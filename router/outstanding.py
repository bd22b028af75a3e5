"""The router's overlay of outstanding requests per node, between telemetry messages.

Telemetry is up to `interval_ms` old; a burst routed on it alone herds onto whichever node last looked
idle. So, per node, the router counts what it dispatched (`d`) and saw settle (`s`) since it noticed
the node's latest report (of `r` outstanding), and estimates

    outstanding = max(pending, r + d - s)

where `pending` is this router's own unanswered requests there. `r + d - s` is exact when every
request counted in the report settles after it was noticed; requests that settled between the node's
send and the router's notice make it an overestimate until the next report, which is the safe side.
`max(pending, ...)` keeps it from dropping below what this router alone knows to be there.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

from telemetry.view import ClusterView


@dataclass
class _Node:
    pending: int = 0
    dispatched: int = 0
    settled: int = 0
    report_seq: int = -1
    report_sent_ms: float = -1.0


class OutstandingTracker:
    """Single-threaded (the router's event loop)."""

    def __init__(self) -> None:
        self._nodes: dict[str, _Node] = {}

    def dispatch(self, node_id: str) -> None:
        n = self._nodes.setdefault(node_id, _Node())
        n.pending += 1
        n.dispatched += 1

    def settle(self, node_id: str) -> None:
        n = self._nodes.setdefault(node_id, _Node())
        n.pending = max(0, n.pending - 1)
        n.settled += 1

    def pending(self, node_id: str) -> int:
        n = self._nodes.get(node_id)
        return 0 if n is None else n.pending

    def overlay(self, view: ClusterView) -> ClusterView:
        """`view` with this router's estimate per node attached."""
        estimates: dict[str, int] = {}
        for state in view:
            n = self._nodes.get(state.node_id)
            if n is None:
                n = self._nodes[state.node_id] = _Node()
            load = state.load
            if (load.seq, load.sent_at_ms) != (n.report_seq, n.report_sent_ms):
                n.report_seq, n.report_sent_ms = load.seq, load.sent_at_ms
                n.dispatched = n.settled = 0
            estimates[state.node_id] = max(n.pending, state.reported_outstanding + n.dispatched - n.settled)
        return view.with_outstanding(MappingProxyType(estimates))
