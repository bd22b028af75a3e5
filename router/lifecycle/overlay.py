"""The router's overlay of outstanding requests per node, between telemetry messages.

Telemetry is up to `interval_ms` old; a burst routed on it alone herds onto whichever node last looked
idle. So, per node, the router counts what it dispatched (`d`) and saw settle (`s`) since the node's
latest report (of `r` outstanding), and estimates

    outstanding = max(pending, r + d - s)

where `pending` is this router's own unanswered requests there, plus, with active-active routers
(telemetry.kafka.peers), the other routers' requests in flight there as they last published them. With
peers, `s` also counts the answers the other routers got from the node since its report (from their
published running sums), and their new dispatches are in `pending`: without that, requests of the
other routers that finished since the report would keep the node looking busier than it is until
the next report, for every decision in between.
`r + d - s` is exact when every request counted in the report settles after the router saw the
report; requests that settled between the node's send and the router's receipt make it an
overestimate until the next report, which is the safe side. `max(pending, ...)` keeps it from
dropping below what the routers know to be there.

Estimates are computed when asked, per node, so a decision over a sample of two nodes costs O(1)
whatever the cluster size, and asking never changes anything: the per-report counters are reset and
restarts noticed where telemetry is applied (`applied`) or a request is dispatched (`dispatch`), both
writes. A read of a node whose newer report has not been applied yet counts nothing since it (as the
reset would). Single-threaded: the router's event loop, or the simulator.

Loads in progress: a request dispatched to a node whose report shows its model not resident sets off
a load there (`loading`), expected to end `load_ms` later. Until a report shows the model resident (or
twice that time has passed), the view answers `load_ready_at(node, model)`, so the next requests for
that model see the load already under way on that node (`warm_model` charges only what is left of it)
instead of each one starting a load on another node; and a load of another model there waits for
those (`loader_busy_ms`: a node loads one model at a time), so cold models spread over the nodes
instead of queueing up on the one that looks idlest.
"""

from __future__ import annotations

from collections.abc import Callable, KeysView, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from router.lifecycle.health import OutlierDetector
from telemetry.cluster.table import BoolArray, IntArray, ModelTable
from telemetry.cluster.view import ClusterView, Evidence, Links, NodeState

NAN = float("nan")
MAX_REFUSED = 1024  # the refusal penalty of one node at most


@dataclass(slots=True)
class _Node:
    pending: int = 0
    dispatched: int = 0
    settled: int = 0
    report: tuple[int, float] = (-1, -1.0)
    remote_settled: int = 0  # the other routers' settled sum for this node when the report came
    started: float | None = None  # the node's started_at_ms as first seen, to notice a restart
    total_dispatched: int = 0  # running sums, published to the other routers
    total_settled: int = 0
    refused: int = 0  # recent refusals (429/503) by the node: counted as outstanding, halved per report


class OutstandingTracker:
    def __init__(
        self,
        health: OutlierDetector | None = None,
        remote: Callable[[str], int] | None = None,
        remote_settled: Callable[[str], int] | None = None,
    ) -> None:
        self.health = health  # attached to every overlaid view for the `healthy` filter
        self.remote = remote  # other routers' in flight per node (telemetry.kafka.peers), if shared
        self.remote_settled = remote_settled  # ... and their running sum of answers per node
        self._nodes: dict[str, _Node] = {}
        # nodes whose counters are not as a new report leaves them (something pending, dispatched,
        # settled or refused since their report): a report that only repeats the last one needs no
        # reset anywhere else (`repeated`)
        self._counting: set[str] = set()
        self._loads: dict[str, dict[str, tuple[float, float]]] = {}  # node -> model -> (ready at, load ms)
        self._loader_free_at: dict[str, float] = {}  # a node loads one model at a time: when its loader frees
        self.links: Links | None = None  # attached to every overlaid view (the lifecycle's link table)
        self.evidence: Evidence | None = None  # attached to every overlaid view (the lifecycle's evidence)
        self._base: tuple[ClusterView, Links | None] | None = None
        self._overlaid: ClusterView | None = None
        self.on_change: Callable[[], None] | None = None  # called after every dispatch and settle
        # The same counters as arrays, for `estimate_many` (a policy judging every node of a model at
        # once): a row per node id, given when a model table first asks for it; `_gen` changes when
        # the rows are renumbered (then the tables ask again).
        self._row: dict[str, int] = {}
        self._gen = 0
        self._keys = 0  # changes whenever a row's report key (_rseq, _rsent) may have changed
        self._pend: IntArray = np.zeros(0, dtype=np.int64)
        self._delta: IntArray = np.zeros(0, dtype=np.int64)  # dispatched - settled since the report
        self._refused: IntArray = np.zeros(0, dtype=np.int64)  # the refusal penalty (halved per report)
        self._rseq: IntArray = np.zeros(0, dtype=np.int64)  # the report counted from (-1, NaN: none)
        self._rsent = np.zeros(0, dtype=np.float64)

    def _mirror(self, node_id: str, n: _Node | None) -> None:
        """Copy one node's counters into its array row (if it has one)."""
        i = self._row.get(node_id)
        if i is None:
            return
        if n is None:
            self._pend[i] = self._delta[i] = self._refused[i] = 0
            self._rseq[i], self._rsent[i] = -1, NAN
            return
        self._pend[i] = n.pending
        self._delta[i] = n.dispatched - n.settled
        self._refused[i] = n.refused
        self._rseq[i], self._rsent[i] = n.report if n.report[0] >= 0 else (-1, NAN)

    def _rows(self, nodes: Sequence[NodeState]) -> list[int]:
        """Array rows for `nodes`, giving new ones (and growing the arrays) where needed."""
        rows = self._row
        out: list[int] = []
        new: list[str] = []
        for state in nodes:
            i = rows.get(state.node_id)
            if i is None:
                i = rows[state.node_id] = len(rows)
                new.append(state.node_id)
            out.append(i)
        if len(rows) > len(self._pend):
            size = max(64, 2 * len(rows))
            grow = size - len(self._pend)
            self._pend = np.concatenate((self._pend, np.zeros(grow, dtype=np.int64)))
            self._delta = np.concatenate((self._delta, np.zeros(grow, dtype=np.int64)))
            self._refused = np.concatenate((self._refused, np.zeros(grow, dtype=np.int64)))
            self._rseq = np.concatenate((self._rseq, np.full(grow, -1, dtype=np.int64)))
            self._rsent = np.concatenate((self._rsent, np.full(grow, NAN)))
        for node_id in new:
            self._mirror(node_id, self._nodes.get(node_id))
        self._keys += 1
        return out

    def estimate_many(self, table: ModelTable) -> IntArray:
        """`estimate` for every node of `table` at once (the same formula, on arrays)."""
        if self.remote is not None:  # the other routers' counts are per node: ask per node
            return np.array([self.estimate(n) for n in table.nodes], dtype=np.int64)
        rows = table.slots(self, self._gen, self._rows)
        synced = table.synced(self, self._keys, self._synced_rows)
        reported = table.reported
        refused: IntArray = self._refused[rows]
        counted: IntArray = reported + self._delta[rows] + refused
        out: IntArray = np.maximum(
            self._pend[rows], counted if synced is None else np.where(synced, counted, reported + refused)
        )
        return out

    def _synced_rows(self, table: ModelTable) -> BoolArray | None:
        """Which rows of `table` this tracker counts from the report the table holds (None: all of
        them, the usual case). Report keys change only when telemetry is applied, so `ModelTable.synced`
        keeps this from one decision to the next."""
        rows = table.slots(self, self._gen, self._rows)
        synced: BoolArray = (self._rseq[rows] == table.seq) & (self._rsent[rows] == table.sent)
        return None if np.count_nonzero(synced) == len(synced) else synced

    def load_exceptions(self) -> KeysView[str]:
        """Nodes where this router set off loads (`loader_busy_ms`, `load_ready_at` may be nonzero): a
        view, not a copy (this runs on every columnar decision of `warm_model`). A node's loader entry
        lives exactly as long as its loads (`loading` sets both, `_expire` and `forget_missing` drop both)."""
        return self._loads.keys()

    def _sync(self, state: NodeState) -> _Node:
        n = self._nodes.get(state.node_id)
        if n is None:
            n = self._nodes[state.node_id] = _Node()
        key = state.report
        if key != n.report:
            n.report = key
            self._keys += 1
            n.dispatched = n.settled = 0
            n.refused >>= 1  # (a node that keeps refusing keeps looking busy; one that stopped, soon not)
            n.remote_settled = 0 if self.remote_settled is None else self.remote_settled(state.node_id)
            if not n.pending and not n.refused:
                self._counting.discard(state.node_id)
            started = state.load.started_at_ms
            if started != n.started:
                if n.started is not None and self.health is not None:  # a new process: slow start
                    self.health.restarted(state.node_id, state.heard_at_ms - (state.report[1] - started))
                n.started = started
            if self._row:
                self._mirror(state.node_id, n)
        return n

    def applied(self, states: list[NodeState]) -> None:
        """New reports were applied to the view: reset their counters, notice restarts, drop the
        loads they show done."""
        for state in states:
            self._sync(state)
            self._expire(state)

    def repeated(self, states: Mapping[str, NodeState]) -> None:
        """Reports that say again what their node's last report said but for their key (seq and send
        time) were applied: as `applied`, but only where that changes something.

        A new key resets a node's counters (dispatched, settled, the refusal penalty's halving) and
        drops the loads it shows done; a node with nothing counted, no load under way and the same
        process (a repeat's start time is its report's) has nothing to reset, and an estimate of it
        is the same from either key (`estimate`: `max(pending, reported)` either way; a dispatch
        syncs to the view's key first, and a settle needs something pending). So only the nodes this
        router counts something for or loads on are synced; the others keep the key they were synced
        to until they are next dispatched to. With the other routers' counts (`remote_settled`, read
        at each new key), every one is synced. A repeat's process start is its node's since the
        report it repeats, which this router has seen (the simulator repeats only nodes that never
        restarted): no restart to notice."""
        if self.remote is not None or self.remote_settled is not None:
            self.applied(list(states.values()))
            return
        busy = self._counting & states.keys()
        if self._loads:
            busy |= self._loads.keys() & states.keys()
        for node_id in busy:
            state = states[node_id]
            self._sync(state)
            self._expire(state)

    def forget_missing(self, view: ClusterView) -> int:
        """Drop what is kept for nodes no longer in `view` (evicted) with nothing of this router's pending
        there, so the tracker holds no more nodes than the view (and what is in flight). Returns how
        many were dropped."""
        gone = [k for k, n in self._nodes.items() if view.get(k) is None and n.pending == 0]
        for k in gone:
            del self._nodes[k]
            self._counting.discard(k)
            self._loads.pop(k, None)
            self._loader_free_at.pop(k, None)
            self._mirror(k, None)
        self._keys += 1
        if len(self._row) > 2 * len(self._nodes) + 1024:  # rows of long-gone nodes: renumber
            self._row = {}
            self._gen += 1
            self._pend = self._delta = self._refused = self._rseq = np.zeros(0, dtype=np.int64)
            self._rsent = np.zeros(0, dtype=np.float64)
        return len(gone)

    def estimate(self, state: NodeState) -> int:
        n = self._nodes.get(state.node_id)
        if n is None or n.report != state.report:
            # nothing counted since this report yet (not applied, or never dispatched to)
            pending, refused = (0, 0) if n is None else (n.pending, n.refused)
            if self.remote is not None:
                pending += self.remote(state.node_id)
            return max(pending, state.reported_outstanding + refused)
        refused = n.refused
        if self.remote is None:
            return max(n.pending, state.reported_outstanding + n.dispatched - n.settled + refused)
        pending = n.pending + self.remote(state.node_id)
        settled = n.settled
        if self.remote_settled is not None:
            settled += max(0, self.remote_settled(state.node_id) - n.remote_settled)
        return max(pending, state.reported_outstanding + n.dispatched - settled + refused)

    def sent_model(self, state: NodeState, model: str, now_ms: float, default_load_ms: float = 500.0) -> None:
        """A request for `model` went to `state`: if its report shows the model cold, a load starts."""
        m = state.load.models.get(model)
        if state.node_id in self._loads:  # (loads set off here, seldom: most sends skip the check)
            self._expire(state)
        if m is not None and not m.resident and self.load_ready_at(state, model) is None:
            self.loading(state, model, now_ms, m.load_ms if m.load_ms is not None else default_load_ms)

    def loading(self, state: NodeState, model: str, now_ms: float, load_ms: float) -> None:
        """A load of `model` is queued on `state` now, expected to take `load_ms` once the node's loader
        is free (a node loads one model at a time)."""
        loads = self._loads.setdefault(state.node_id, {})
        entry = loads.get(model)
        if entry is None or entry[0] + entry[1] < now_ms:
            ready = max(now_ms, self._loader_free_at.get(state.node_id, 0.0)) + load_ms
            loads[model] = (ready, load_ms)
            self._loader_free_at[state.node_id] = ready

    def _expire(self, state: NodeState) -> dict[str, tuple[float, float]]:
        """Drop the loads on `state` its report shows done (or that are long overdue: the node's reports
        will tell); when none is left, its loader is free from that report on, even if the loads ended
        earlier than expected. Returns the loads still under way there."""
        loads = self._loads.get(state.node_id)
        if not loads:
            return {}
        for model, (ready, load_ms) in list(loads.items()):
            if self._done(state, model, ready, load_ms):
                del loads[model]
        if not loads:
            # none left: the loader is free from this report on (or earlier), which is now or before,
            # so nothing is kept (a node once loaded would otherwise stay an exception for
            # `load_exceptions` for good, and every columnar decision would ask it one by one)
            del self._loads[state.node_id]
            self._loader_free_at.pop(state.node_id, None)
            return {}
        return loads

    @staticmethod
    def _done(state: NodeState, model: str, ready: float, load_ms: float) -> bool:
        m = state.model(model)
        return (m is not None and m.resident and state.heard_at_ms >= ready - load_ms) or (
            state.heard_at_ms > ready + load_ms
        )

    def loader_busy_ms(self, state: NodeState, now_ms: float) -> float:
        """How long the loads this router set off on `state` keep its loader busy from `now_ms` (a read:
        loads that `state` shows done free the loader from its report on, as `_expire` will record)."""
        free = self._loader_free_at.get(state.node_id, 0.0)
        loads = self._loads.get(state.node_id)
        if loads and free > state.heard_at_ms and all(self._done(state, m, *e) for m, e in loads.items()):
            free = state.heard_at_ms
        return max(0.0, free - now_ms)

    def loads_under_way(self, view: ClusterView) -> dict[str, int]:
        """Per model, the loads this router set off (a cold send's, the copy planner's) not done yet."""
        out: dict[str, int] = {}
        for node_id, loads in self._loads.items():
            state = view.get(node_id)
            for model in loads:
                if state is not None and self.load_ready_at(state, model) is not None:
                    out[model] = out.get(model, 0) + 1
        return out

    def load_ready_at(self, state: NodeState, model: str) -> float | None:
        entry = self._loads.get(state.node_id, {}).get(model)
        if entry is None or self._done(state, model, *entry):
            return None
        return entry[0]

    def dispatch(self, state: NodeState) -> None:
        n = self._sync(state)
        n.pending += 1
        n.dispatched += 1
        n.total_dispatched += 1
        self._counting.add(state.node_id)
        if self._row:  # (rows exist once a model table asked for them: columnar policies)
            self._mirror(state.node_id, n)
        if self.on_change is not None:
            self.on_change()

    def settle(self, node_id: str, refused: bool = False) -> None:
        """An attempt at `node_id` ended. `refused` (the node answered 429/503): the node also counts one
        more outstanding for a while, halved at each of its reports. A node that refuses holds a short
        queue, so its reports alone make it look idle, and it would draw the very traffic it refuses."""
        n = self._nodes.get(node_id)
        if n is None:
            n = self._nodes[node_id] = _Node()
        n.pending = max(0, n.pending - 1)
        n.settled += 1
        self._counting.add(node_id)
        if refused:
            n.refused = min(n.refused + 1, MAX_REFUSED)
        n.total_settled += 1
        if self._row:
            self._mirror(node_id, n)
        if self.on_change is not None:
            self.on_change()

    def totals(self) -> tuple[dict[str, int], dict[str, int]]:
        """Running sums of dispatches and settles per node (what active-active routers publish)."""
        nodes = self._nodes.items()
        return (
            {k: n.total_dispatched for k, n in nodes if n.total_dispatched},
            {k: n.total_settled for k, n in nodes if n.total_settled},
        )

    def pending(self, node_id: str) -> int:
        n = self._nodes.get(node_id)
        return 0 if n is None else n.pending

    def overlay(self, view: ClusterView) -> ClusterView:
        """`view` with this router's estimates, health, links and evidence attached (computed when asked;
        the overlaid view is cached per view and link table)."""
        base = self._base
        if base is None or base[0] is not view or base[1] is not self.links or self._overlaid is None:
            self._base = (view, self.links)
            self._overlaid = view.with_outstanding(self, self.health, self.links, self.evidence)
        return self._overlaid
