"""Column tables of the nodes serving one model, so policies can judge every candidate at once.

A policy that scores every node serving a model (least outstanding, earliest predicted completion)
costs a few microseconds per candidate when it walks `NodeState` objects one by one: at 1,000 nodes
that is milliseconds per decision. A `ModelTable` holds what those policies read, one numpy array per
field, in the order of the view's per-model index: capacity, reported outstanding, when each node was
heard, its report's key, partition, residency and last load time, and, built on first use, the
expected wait at a priority and the execution time at a batch size. Each column is computed with the
same scalar function the per-node path uses (`NodeLoad.wait_ms`, `ModelLoad.ewma_ms`), so only the
arithmetic that combines them is vectorised and both paths give the same numbers.

Tables are kept from view to view: a new view (one telemetry batch) patches the rows of the nodes
whose reports changed into copies of the previous view's tables (`patched`), so a batch of k reports
costs O(k) rows, not a rebuild; a node joining, leaving or changing its model set rebuilds the
model's table on its next use. Tables are immutable once published; the lazily built columns are
added to a table by its readers (one event loop) and copied whole when the next table is patched.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from telemetry.cluster.view import Links, NodeState

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]

NAN = float("nan")


def _wait(node: NodeState, priority: int) -> float:
    w = node.load.wait_ms(priority)
    return NAN if w is None else w


def _exec(node: NodeState, model: str, batch: int) -> float:
    m = node.model(model)
    e = m.ewma_ms(batch) if m is not None else None
    return e if e is not None and e > 0 else NAN


def _resident(node: NodeState, model: str) -> bool:
    m = node.model(model)
    return m is not None and m.resident


def _kept(cache: dict[Any, Any], key: Any, col: Any, limit: int) -> Any:
    """`col` made read-only (tables share it with every decision) and kept under `key` in a cache of at
    most `limit` entries (cleared whole when full: the keys come from requests)."""
    col.flags.writeable = False
    if len(cache) >= limit:
        cache.clear()
    cache[key] = col
    return col


class ModelTable:
    """The nodes serving `model`, as columns (see the module docstring). Row i is `nodes[i]`."""

    __slots__ = (
        "model",
        "nodes",
        "pos",
        "capacity",
        "reported",
        "heard",
        "ready",
        "seq",
        "sent",
        "part",
        "parts",
        "part_of",
        "resident",
        "load_ms",
        "_waits",
        "_execs",
        "_residents",
        "_slots",
        "_synced",
        "_wait_known",
        "_filled",
        "_rtts",
        "_id_rank",
        "_oldest",
        "_newest",
        "_all_rows",
        "_in_part",
        "_penalty",
    )

    def __init__(self, model: str, nodes: Sequence[NodeState]) -> None:
        self.model = model
        self.nodes: list[NodeState] = list(nodes)
        self.pos: dict[str, int] = {n.node_id: i for i, n in enumerate(self.nodes)}
        parts: dict[str, int] = {}
        for n in self.nodes:
            parts.setdefault(n.partition, len(parts))
        self.part_of = parts
        self.parts: tuple[str, ...] = tuple(parts)
        rows = [self._row(n) for n in self.nodes]
        cols = list(zip(*rows, strict=True)) if rows else [()] * 9
        self.capacity: FloatArray = np.array(cols[0], dtype=np.float64)
        self.reported: IntArray = np.array(cols[1], dtype=np.int64)
        self.heard: FloatArray = np.array(cols[2], dtype=np.float64)
        self.ready: BoolArray = np.array(cols[3], dtype=np.bool_)
        self.seq: IntArray = np.array(cols[4], dtype=np.int64)
        self.sent: FloatArray = np.array(cols[5], dtype=np.float64)
        self.part: IntArray = np.array(cols[6], dtype=np.int64)
        self.resident: BoolArray = np.array(cols[7], dtype=np.bool_)
        self.load_ms: FloatArray = np.array(cols[8], dtype=np.float64)
        self._waits: dict[int, FloatArray] = {}
        self._execs: dict[int, FloatArray] = {}
        self._residents: dict[str, BoolArray] = {}
        self._slots: dict[object, tuple[int, IntArray]] = {}  # per overlay: (its generation, its row numbers)
        self._synced: dict[object, tuple[int, BoolArray | None]] = {}  # per overlay: (its key version, rows)
        self._wait_known: dict[int, bool] = {}  # derived from the columns above: rebuilt, not patched
        self._filled: dict[tuple[int, float], FloatArray] = {}
        self._rtts: dict[tuple[object, str | None], FloatArray] = {}
        self._id_rank: IntArray | None = None
        self._oldest: float | None = None
        self._newest: float | None = None
        self._all_rows: IntArray | None = None
        self._in_part: dict[str, BoolArray] = {}
        self._penalty: dict[float, FloatArray] = {}

    def _row(self, n: NodeState) -> tuple[Any, ...]:
        load = n.load
        m = load.models.get(self.model)
        resident = m is not None and m.resident
        load_ms = NAN if m is None or m.load_ms is None else m.load_ms
        return (
            float(load.capacity),
            n.reported_outstanding,
            n.heard_at_ms,
            n.ready,
            *n.report,  # (seq, sent_at_ms): a repeat's own, where its `load` is the report it repeats
            self._part(n.partition),
            resident,
            load_ms,
        )

    def _part(self, partition: str) -> int:
        i = self.part_of.get(partition)
        if i is None:
            i = self.part_of[partition] = len(self.part_of)
            self.parts = (*self.parts, partition)
        return i

    def __len__(self) -> int:
        return len(self.nodes)

    # --- columns built on first use ------------------------------------------------------------------

    def wait(self, priority: int) -> FloatArray:
        """Each node's reported expected wait at `priority` (`NodeLoad.wait_ms`; NaN where none)."""
        col = self._waits.get(priority)
        if col is None:
            col = self._waits[priority] = np.array([_wait(n, priority) for n in self.nodes], dtype=np.float64)
        return col

    def wait_known(self, priority: int) -> bool:
        """Whether every node reports an expected wait at `priority` (no NaN in `wait(priority)`)."""
        known = self._wait_known.get(priority)
        if known is None:
            known = self._wait_known[priority] = not bool(np.isnan(self.wait(priority)).any())
        return known

    def exec_or(self, batch: int, default_ms: float) -> FloatArray:
        """`exec(batch)` with `default_ms` where a node has none (`completion.exec_estimate_ms`)."""
        key = (batch, default_ms)
        col = self._filled.get(key)
        if col is None:
            e = self.exec(batch)
            col = self._filled[key] = np.where(np.isnan(e), default_ms, e)
        return col

    def exec(self, batch: int) -> FloatArray:
        """Each node's EWMA execution time of the model at `batch` (`ModelLoad.ewma_ms`; NaN where none)."""
        col = self._execs.get(batch)
        if col is None:
            model = self.model
            col = self._execs[batch] = np.array([_exec(n, model, batch) for n in self.nodes], dtype=np.float64)
        return col

    def resident_of(self, model: str) -> BoolArray:
        """Whether each node holds `model` (another model, e.g. a workflow's next stage) resident."""
        if model == self.model:
            return self.resident
        col = self._residents.get(model)
        if col is None:
            col = self._residents[model] = np.array([_resident(n, model) for n in self.nodes], dtype=np.bool_)
        return col

    def in_partition(self, partition: str) -> BoolArray:
        """Whether each row is in `partition` (read-only, kept per partition)."""
        col = self._in_part.get(partition)
        if col is None:
            i = self.part_of.get(partition)
            same = np.zeros(len(self.nodes), dtype=np.bool_) if i is None else self.part == i
            col = _kept(self._in_part, partition, same, 64)
        return col

    def load_penalty(self, default_ms: float) -> FloatArray:
        """0 where the model is resident, else its last load time (`default_ms` where none is known):
        `warm_model.load_penalty_ms` without this router's own loads (read-only, kept per default)."""
        col = self._penalty.get(default_ms)
        if col is None:
            cold = np.where(self.resident, 0.0, np.where(np.isnan(self.load_ms), default_ms, self.load_ms))
            col = _kept(self._penalty, default_ms, cold, 16)
        return col

    def all_rows(self) -> IntArray:
        """0 .. len - 1 (read-only, kept)."""
        rows = self._all_rows
        if rows is None:
            rows = self._all_rows = np.arange(len(self.nodes))
            rows.flags.writeable = False
        return rows

    def all_ready_since(self, horizon_ms: float) -> bool:
        """Whether every row is ready and was heard at `horizon_ms` or later (one comparison per
        decision: the oldest report of a table whose nodes are all ready is kept)."""
        oldest = self._oldest
        if oldest is None:
            oldest = self._oldest = float(self.heard.min()) if len(self) and self.ready.all() else NAN
        return oldest >= horizon_ms  # (False for NaN: a row not ready)

    def heard_by(self, now_ms: float) -> bool:
        """Whether every row was heard at `now_ms` or before (no report from the future: then every
        report's age is `now_ms - heard` without a clamp at 0)."""
        newest = self._newest
        if newest is None:
            newest = self._newest = float(self.heard.max()) if len(self) else NAN
        return newest <= now_ms  # (False for NaN)

    def id_rank(self) -> IntArray:
        """Each row's place in node-id order."""
        rank = self._id_rank
        if rank is None:
            order = sorted(range(len(self.nodes)), key=lambda i: self.nodes[i].node_id)
            rank = np.empty(len(order), dtype=np.int64)
            rank[order] = np.arange(len(order))
            self._id_rank = rank
        return rank

    def rtt(self, links: Links | None, site: str | None) -> FloatArray:
        """`links.rtt_ms(site, partition)` of every row (0 without links); link tables are immutable
        (swapped whole), so this is cached per table and site."""
        key = (links, site)
        col = self._rtts.get(key)
        if col is None:
            if links is None:
                rtts = np.zeros(len(self.nodes))
            else:
                per_part = np.array([links.rtt_ms(site, p) for p in self.parts], dtype=np.float64)
                rtts = per_part[self.part]
            col = _kept(self._rtts, key, rtts, 64)
        return col

    def slots(self, owner: object, generation: int, build: Any) -> IntArray:
        """Row numbers of these nodes in an overlay's own arrays (cached per overlay and generation)."""
        cached = self._slots.get(owner)
        if cached is None or cached[0] != generation:
            cached = (generation, np.array(build(self.nodes), dtype=np.int64))
            self._slots[owner] = cached
        return cached[1]

    def synced(self, owner: object, version: int, build: Any) -> BoolArray | None:
        """An overlay's rows synced with these reports (`build(self)`), cached per overlay and version."""
        cached = self._synced.get(owner)
        if cached is None or cached[0] != version:
            cached = (version, build(self))
            self._synced[owner] = cached
        return cached[1]

    # --- the next view's table -----------------------------------------------------------------------

    def patched(self, changed: Iterable[NodeState]) -> ModelTable:
        """A copy with the rows of `changed` (nodes already in this table) replaced by their new reports."""
        t = ModelTable.__new__(ModelTable)
        t.model = self.model
        t.nodes = list(self.nodes)
        t.pos = self.pos
        t.part_of = dict(self.part_of)
        t.parts = self.parts
        for name in ("capacity", "reported", "heard", "ready", "seq", "sent", "part", "resident", "load_ms"):
            setattr(t, name, getattr(self, name).copy())
        waits, execs, residents = dict(self._waits), dict(self._execs), dict(self._residents)
        t._waits = {k: v.copy() for k, v in waits.items()}
        t._execs = {k: v.copy() for k, v in execs.items()}
        t._residents = {k: v.copy() for k, v in residents.items()}
        t._slots = dict(self._slots)  # same nodes in the same rows
        t._synced = {}  # new report keys
        t._wait_known = {}
        t._filled = {}
        t._rtts = {}
        t._id_rank = self._id_rank  # the same node ids in the same rows
        t._oldest = None
        t._newest = None
        t._all_rows = self._all_rows  # as many rows
        t._in_part = {}  # a node may have moved
        t._penalty = {}
        model = t.model
        for n in changed:
            i = t.pos[n.node_id]
            t.nodes[i] = n
            (t.capacity[i], t.reported[i], t.heard[i], t.ready[i], t.seq[i], t.sent[i], t.part[i],
             t.resident[i], t.load_ms[i]) = t._row(n)  # fmt: skip
            for p, col in t._waits.items():
                col[i] = _wait(n, p)
            for b, col in t._execs.items():
                col[i] = _exec(n, model, b)
            for m, warm in t._residents.items():
                warm[i] = _resident(n, m)
        return t
