"""ClusterView: the immutable snapshot of all nodes that routing policies read.

The telemetry consumer builds a new `ClusterView` for each batch of messages and swaps it in with one
assignment (`ViewStore`); readers never see a half-updated view and never lock. Each node carries the
time it was last heard from, so staleness is data: a node not heard from for `stale_after_ms` is
excluded by the `healthy` filter. The router attaches an `Overlay`, its own estimate of each node's
outstanding requests (`with_outstanding`), so a burst between two telemetry messages does not herd onto
one node that only looks idle.

Per-model candidate lists are indexed once per view (lazily), so a policy's `has_model` step costs
O(1) instead of a scan of every node.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Protocol, overload

import numpy as np
from msgspec import Struct
from msgspec.structs import replace as replace_struct

from telemetry.cluster.schema import ModelLoad, NodeLoad
from telemetry.cluster.table import BoolArray, FloatArray, IntArray, ModelTable

__all__ = [
    "BoolArray",
    "ClusterView",
    "Evidence",
    "FloatArray",
    "Health",
    "IntArray",
    "Links",
    "ModelTable",
    "NodeState",
    "Overlay",
]


class NodeState(Struct, frozen=True, gc=False):
    """One node as last reported, plus when the router heard it; made by `NodeState.of(load, heard_at_ms)`.

    What policies and the in-flight overlay read on every decision (id, endpoint, partition,
    readiness, capacity, the reported outstanding count, the report's key) is taken from the report
    once, when the state is made, instead of through properties that reach into the report (and sum
    its queues) at every read. A struct made in C (msgspec), not a dataclass: a router applying a large
    fleet's reports makes one per report (~0.3 us against ~1.2 us). Not tracked by the cyclic garbage
    collector: a state refers to its report only, never back to anything that refers to it.
    """

    load: NodeLoad
    heard_at_ms: float
    node_id: str
    endpoint: str
    partition: str
    ready: bool
    capacity: int
    # Requests queued or executing at the node when it sent its last message.
    reported_outstanding: int
    # Which report this is: (seq, sent_at_ms), the key the in-flight overlay counts from (a repeat's
    # own; its `load` is the report it repeats).
    report: tuple[int, float]

    @classmethod
    def of(cls, load: NodeLoad, heard_at_ms: float) -> NodeState:
        """The state of a node that sent `load`, heard at `heard_at_ms`."""
        return cls(
            load,
            heard_at_ms,
            load.node_id,
            load.endpoint,
            load.partition,
            load.status == "ready",
            load.capacity,
            load.queued + load.in_flight,
            (load.seq, load.sent_at_ms),
        )

    def repeated(self, seq: int, sent_at_ms: float, heard_at_ms: float) -> NodeState:
        """The state after a report that says again what this state's report said, but for its seq and
        send time (a repeat, telemetry.cluster.store.Repeats): the same `load` (the report repeated,
        whose own seq and send time are the first one's), its own key (`report`) and time heard. What
        reads a report's seq and send time reads `report`."""
        return replace_struct(self, heard_at_ms=heard_at_ms, report=(seq, sent_at_ms))

    def model(self, name: str) -> ModelLoad | None:
        return self.load.models.get(name)

    def serves(self, model: str) -> bool:
        return model in self.load.models


def _copied(nodes: Mapping[str, NodeState]) -> dict[str, NodeState]:
    """A dict copy of a view's nodes: a view's own read-only proxy copies its dict at C speed, where
    `dict(proxy)` walks it key by key (~10x slower at 1,000 nodes; this runs at every telemetry poll)."""
    if isinstance(nodes, MappingProxyType):
        return nodes.copy()
    return dict(nodes)


class _NodesById(Sequence[NodeState]):
    """A read-only sequence of nodes given by id, resolved against one view's mapping."""

    __slots__ = ("ids", "nodes")

    def __init__(self, ids: tuple[str, ...], nodes: Mapping[str, NodeState]) -> None:
        self.ids = ids
        self.nodes = nodes

    def __len__(self) -> int:
        return len(self.ids)

    @overload
    def __getitem__(self, i: int) -> NodeState: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[NodeState]: ...

    def __getitem__(self, i: int | slice) -> NodeState | Sequence[NodeState]:
        if isinstance(i, slice):
            return [self.nodes[x] for x in self.ids[i]]
        return self.nodes[self.ids[i]]

    def __iter__(self) -> Iterator[NodeState]:
        nodes = self.nodes
        return (nodes[x] for x in self.ids)


class Overlay(Protocol):
    """The router's estimate of a node's outstanding requests (see router.lifecycle.overlay).

    Every method is a read: it never changes the router's state (that happens where telemetry is
    applied and where requests are dispatched and settled)."""

    def estimate(self, node: NodeState) -> int: ...

    def estimate_many(self, table: ModelTable) -> IntArray:
        """`estimate` of every node of `table`, in its row order."""
        ...

    def load_exceptions(self) -> Iterable[str]:
        """The nodes for which `loader_busy_ms` or `load_ready_at` may answer other than 0 and None."""
        ...

    def loader_busy_ms(self, node: NodeState, now_ms: float) -> float: ...

    def load_ready_at(self, node: NodeState, model: str) -> float | None: ...


class Health(Protocol):
    """The router's view of node health from its own answers (see router.lifecycle.health); a read."""

    def admitter(self, site: str | None, now_ms: float, rng: random.Random) -> Callable[[NodeState], bool] | None: ...

    def exceptions(self, site: str | None, now_ms: float) -> Iterable[str] | None:
        """The nodes `admitter` may refuse for `site` (ejected or ramping); None when it would be None."""
        ...


class Evidence(Protocol):
    """The router's own evidence that a node is alive (answers, probes; router.lifecycle.evidence); a read."""

    def alive(self, node_id: str, now_ms: float) -> bool: ...


class Links(Protocol):
    """Partition distances (the router's link table, router.lifecycle.links); a read."""

    def rtt_ms(self, site: str | None, partition: str) -> float: ...


class FixedOverlay:
    """An overlay from a plain mapping node id -> outstanding (tests, tools)."""

    def __init__(self, values: Mapping[str, int]) -> None:
        self.values = dict(values)

    def estimate(self, node: NodeState) -> int:
        return self.values.get(node.node_id, node.reported_outstanding)

    def estimate_many(self, table: ModelTable) -> IntArray:
        return np.array([self.estimate(n) for n in table.nodes], dtype=np.int64)

    def load_exceptions(self) -> Iterable[str]:
        return ()

    def loader_busy_ms(self, node: NodeState, now_ms: float) -> float:
        return 0.0

    def load_ready_at(self, node: NodeState, model: str) -> float | None:
        return None


@dataclass(frozen=True)
class ClusterView:
    """An immutable snapshot of every node the router knows of."""

    nodes: Mapping[str, NodeState] = field(default_factory=lambda: MappingProxyType({}))
    stale_after_ms: float = 1000.0
    built_at_ms: float = 0.0
    overlay: Overlay | None = None
    newest_heard_ms: float = float("-inf")
    links: Links | None = None  # partition distances (the router's link table), attached with the overlay
    health: Health | None = None  # the router's outlier ejection and slow start (router.lifecycle.health)
    evidence: Evidence | None = None  # the router's own evidence of life (router.lifecycle.evidence)
    _by_model: dict[str, tuple[str, ...]] | None = field(default=None, compare=False, repr=False)
    _partitions: frozenset[str] | None = field(default=None, compare=False, repr=False)
    # per-model column tables (telemetry.cluster.table), built or patched on first use in this view; and where
    # to patch them from: an earlier view's tables and the reports that changed since
    _tables: dict[str, ModelTable] = field(default_factory=dict, compare=False, repr=False)
    _table_src: tuple[dict[str, ModelTable], dict[str, NodeState]] | None = field(
        default=None, compare=False, repr=False
    )

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

    def is_live(self, node: NodeState, now_ms: float) -> bool:
        """Routable as far as liveness goes: its telemetry is fresh, or the router's own evidence (its
        answers, its probes) says it is alive. Telemetry is advice, not a lifeline."""
        if now_ms - node.heard_at_ms <= self.stale_after_ms:
            return True
        evidence = self.evidence
        return evidence is not None and evidence.alive(node.node_id, now_ms)

    def live_nodes(self, now_ms: float) -> list[NodeState]:
        return [n for n in self.nodes.values() if self.is_live(n, now_ms)]

    def any_fresh(self, now_ms: float) -> bool:
        return now_ms - self.newest_heard_ms <= self.stale_after_ms

    def fresh_nodes(self, now_ms: float) -> list[NodeState]:
        return [n for n in self.nodes.values() if self.is_fresh(n, now_ms)]

    def rtt_ms(self, site: str | None, partition: str) -> float:
        """Round-trip time from a request's site to a partition (0 inside one, or with no link)."""
        return 0.0 if self.links is None else self.links.rtt_ms(site, partition)

    def with_links(self, links: Links | None) -> ClusterView:
        return replace(self, links=links, _by_model=self._index())

    def outstanding(self, node: NodeState) -> int:
        return node.reported_outstanding if self.overlay is None else self.overlay.estimate(node)

    def loader_busy_ms(self, node: NodeState, now_ms: float) -> float:
        """How long loads this router set off keep `node`'s loader busy (0: none known)."""
        return 0.0 if self.overlay is None else self.overlay.loader_busy_ms(node, now_ms)

    def load_ready_at(self, node: NodeState, model: str) -> float | None:
        """When a load of `model` this router set off on `node` should finish (None: none known)."""
        return None if self.overlay is None else self.overlay.load_ready_at(node, model)

    def _index(self) -> dict[str, tuple[str, ...]]:
        """model -> ids of the nodes reporting it, built on first use (views are immutable)."""
        index = self._by_model
        if index is None:
            built: dict[str, list[str]] = {}
            for node in self.nodes.values():
                for name in node.load.models:
                    built.setdefault(name, []).append(node.node_id)
            index = {k: tuple(v) for k, v in built.items()}
            object.__setattr__(self, "_by_model", index)
        return index

    def has_partition(self, name: str) -> bool:
        """Whether some node of this view is in partition `name` (O(1) after the first call per view)."""
        parts = self._partitions
        if parts is None:
            parts = frozenset(n.partition for n in self.nodes.values())
            object.__setattr__(self, "_partitions", parts)
        return name in parts

    def serving(self, model: str) -> Sequence[NodeState]:
        """Every node (fresh or not) that reports `model`: O(1), from an index of node ids.

        The index (model -> node ids) survives view rebuilds while no node changes its model set,
        which is almost always; the returned sequence resolves ids against this view's nodes.
        """
        index = self._index()
        return _NodesById(index.get(model, ()), self.nodes)

    def serving_count(self, model: str) -> int:
        """`len(serving(model))`."""
        return len(self._index().get(model, ()))

    def models(self, now_ms: float) -> dict[str, list[NodeState]]:
        """Model name -> live (fresh, or alive by the router's own evidence), ready nodes that serve it."""
        out: dict[str, list[NodeState]] = {}
        for node in self.nodes.values():
            if node.ready and self.is_live(node, now_ms):
                for name in node.load.models:
                    out.setdefault(name, []).append(node)
        return out

    def table(self, model: str) -> ModelTable:
        """The nodes of `serving(model)`, in that order, as column arrays (telemetry.cluster.table): patched from
        an earlier view's table where the nodes serving the model are the same, else built."""
        table = self._tables.get(model)
        if table is None:
            src = self._table_src
            old = None if src is None else src[0].get(model)
            if old is not None and src is not None:
                pos = old.pos
                table = old.patched([s for k, s in src[1].items() if k in pos])
            else:
                table = ModelTable(model, self.serving(model))
            self._tables[model] = table
        return table

    def outstanding_all(self, table: ModelTable) -> IntArray:
        """`outstanding` of every node of `table`, as an array in its row order."""
        overlay = self.overlay
        if overlay is None:
            return table.reported
        return overlay.estimate_many(table)

    def with_node(self, state: NodeState, built_at_ms: float) -> ClusterView:
        return self.with_nodes([state], built_at_ms)

    def with_nodes(
        self, states: Iterable[NodeState], built_at_ms: float, repeated: Mapping[str, NodeState] | None = None
    ) -> ClusterView:
        """This view with `states` (new reports) and `repeated` (by node id: reports of nodes it holds
        that say again what their last said, ViewStore.apply_many's repeats: the same models and
        partition, so nothing indexed changes)."""
        states = list(states)
        nodes = _copied(self.nodes)
        newest = self.newest_heard_ms
        index = self._by_model
        parts = self._partitions
        joined: dict[str, list[str]] = {}  # model -> ids of the nodes that joined, in the order they did
        get = nodes.get
        for state in states:
            node_id = state.node_id
            old = get(node_id)
            if old is None:
                # a node joins at the end of `nodes`, so at the end of each of its models' ids: the index
                # grows by it (a rebuild walks `nodes` in order and finds the same), where a fleet of
                # thousands joining over its first reports would otherwise rebuild it per batch
                if index is not None:
                    for name in state.load.models:
                        joined.setdefault(name, []).append(node_id)
                if parts is not None and state.partition not in parts:
                    parts = None  # a node joined a new partition: rebuild when asked
            else:
                models = state.load.models
                if index is not None and old.load.models is not models and old.load.models.keys() != models.keys():
                    index = None  # a node changed its models: rebuild the index when asked
                if parts is not None and old.partition != state.partition:
                    parts = None  # ... or left a partition (maybe its last)
            nodes[node_id] = state
            if state.heard_at_ms > newest:
                newest = state.heard_at_ms
        if repeated:
            nodes.update(repeated)
            newest = max(newest, max(state.heard_at_ms for state in repeated.values()))
        if index is not None and joined:
            index = {**index, **{m: index.get(m, ()) + tuple(ids) for m, ids in joined.items()}}
        src: tuple[dict[str, ModelTable], dict[str, NodeState]] | None = None
        if index is not None and not joined:  # the same nodes serve each model: patch the tables of the changed rows
            if self._tables:
                src = (self._tables, {})
            elif self._table_src is not None:
                src = (self._table_src[0], dict(self._table_src[1]))
            if src is not None:
                for state in states:
                    src[1][state.node_id] = state
                if repeated:
                    src[1].update(repeated)
                if len(src[1]) > len(nodes) // 2:  # most rows changed: a rebuild costs no more
                    src = None
        return self._rebuilt(nodes, built_at_ms, newest, index, parts, src)

    def without(self, node_ids: Iterable[str], built_at_ms: float) -> ClusterView:
        """This view without `node_ids` (nodes silent past the store's eviction age)."""
        nodes = _copied(self.nodes)
        for node_id in node_ids:
            nodes.pop(node_id, None)
        newest = max((n.heard_at_ms for n in nodes.values()), default=float("-inf"))
        return self._rebuilt(nodes, built_at_ms, newest, None, None, None)

    def _rebuilt(
        self,
        nodes: dict[str, NodeState],
        built_at_ms: float,
        newest: float,
        index: dict[str, tuple[str, ...]] | None,
        parts: frozenset[str] | None,
        tables: tuple[dict[str, ModelTable], dict[str, NodeState]] | None,
    ) -> ClusterView:
        """A new view of `nodes`, without this one's overlay; the caches kept where still valid."""
        return replace(
            self,
            nodes=MappingProxyType(nodes),
            built_at_ms=built_at_ms,
            newest_heard_ms=newest,
            overlay=None,
            _by_model=index,
            _partitions=parts,
            _tables={},
            _table_src=tables,
        )

    def with_outstanding(
        self,
        overlay: Overlay | Mapping[str, int] | None,
        health: Health | None = None,
        links: Links | None = None,
        evidence: Evidence | None = None,
    ) -> ClusterView:
        """This view with the router's own state attached for reading: its outstanding estimates, its
        node health, its link table (None keeps the view's links) and its own evidence of life."""
        if isinstance(overlay, Mapping):
            overlay = FixedOverlay(overlay)
        # same nodes, only the load estimate differs: share the index (building it first if needed)
        return replace(
            self, overlay=overlay, health=health, links=links or self.links, evidence=evidence, _by_model=self._index()
        )

    @classmethod
    def of(cls, loads: list[NodeLoad], heard_at_ms: float, stale_after_ms: float = 1000.0) -> ClusterView:
        """A view of `loads`, all heard at `heard_at_ms` (tests and tools)."""
        return cls(stale_after_ms=stale_after_ms).with_nodes((NodeState.of(m, heard_at_ms) for m in loads), heard_at_ms)
