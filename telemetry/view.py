"""ClusterView: the immutable snapshot of all nodes that routing policies read.

The telemetry consumer builds a new `ClusterView` for every accepted message and swaps it in with one
assignment (`ViewStore`); readers never see a half-updated view and never lock. Each node carries the
time it was last heard from, so staleness is data: a node not heard from for `stale_after_ms` is
excluded by the `healthy` filter. The router overlays its own outstanding-request estimate per node
(`with_outstanding`) so a burst between two telemetry messages does not herd onto one node that only
looks idle.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from telemetry.schema import ModelLoad, NodeLoad

_EMPTY: Mapping[str, int] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class PartitionLink:
    """Network distance between two partitions (edge site, cloud region)."""

    src: str
    dst: str
    rtt_ms: float


@dataclass(frozen=True, slots=True)
class NodeState:
    """One node as last reported, plus when the router heard it."""

    load: NodeLoad
    heard_at_ms: float

    @property
    def node_id(self) -> str:
        return self.load.node_id

    @property
    def endpoint(self) -> str:
        return self.load.endpoint

    @property
    def partition(self) -> str:
        return self.load.partition

    @property
    def ready(self) -> bool:
        return self.load.status == "ready"

    @property
    def capacity(self) -> int:
        return self.load.capacity

    def model(self, name: str) -> ModelLoad | None:
        return self.load.models.get(name)

    def serves(self, model: str) -> bool:
        return model in self.load.models

    @property
    def reported_outstanding(self) -> int:
        """Requests queued or executing at the node when it sent its last message."""
        return self.load.queued + self.load.in_flight


@dataclass(frozen=True, slots=True)
class ClusterView:
    """An immutable snapshot of every node the router knows of.

    `outstanding` is the router's best estimate of each node's queued plus executing requests: the
    node's own report, corrected by what this router dispatched and saw settle since that report.
    Nodes without an overlay entry fall back to their report.
    """

    nodes: Mapping[str, NodeState] = field(default_factory=lambda: MappingProxyType({}))
    stale_after_ms: float = 1000.0
    built_at_ms: float = 0.0
    overlay: Mapping[str, int] = field(default_factory=lambda: _EMPTY)

    def __iter__(self) -> Iterator[NodeState]:
        return iter(self.nodes.values())

    def __len__(self) -> int:
        return len(self.nodes)

    def get(self, node_id: str) -> NodeState | None:
        return self.nodes.get(node_id)

    def age_ms(self, node_id: str, now_ms: float) -> float:
        node = self.nodes[node_id]
        return max(0.0, now_ms - node.heard_at_ms)

    def is_fresh(self, node: NodeState, now_ms: float) -> bool:
        return now_ms - node.heard_at_ms <= self.stale_after_ms

    def fresh_nodes(self, now_ms: float) -> list[NodeState]:
        return [n for n in self.nodes.values() if self.is_fresh(n, now_ms)]

    def outstanding(self, node: NodeState) -> int:
        return self.overlay.get(node.node_id, node.reported_outstanding)

    def models(self, now_ms: float) -> dict[str, list[NodeState]]:
        """Model name -> fresh, ready nodes that serve it."""
        out: dict[str, list[NodeState]] = {}
        for node in self.nodes.values():
            if node.ready and self.is_fresh(node, now_ms):
                for name in node.load.models:
                    out.setdefault(name, []).append(node)
        return out

    def with_node(self, state: NodeState, built_at_ms: float) -> ClusterView:
        nodes = dict(self.nodes)
        nodes[state.node_id] = state
        return replace(self, nodes=MappingProxyType(nodes), built_at_ms=built_at_ms)

    def with_outstanding(self, overlay: Mapping[str, int]) -> ClusterView:
        return replace(self, overlay=overlay)

    @classmethod
    def of(cls, loads: list[NodeLoad], heard_at_ms: float, stale_after_ms: float = 1000.0) -> ClusterView:
        """A view of `loads`, all heard at `heard_at_ms` (tests and the simulator)."""
        nodes = {m.node_id: NodeState(m, heard_at_ms) for m in loads}
        return cls(MappingProxyType(nodes), stale_after_ms, heard_at_ms)
