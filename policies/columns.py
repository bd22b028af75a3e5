"""Candidates as columns: the per-decision arrays the columnar path of the engine works on.

On a model served by many nodes the engine (`Pipeline.choose`) judges every candidate at once: the
view's `ModelTable` for the model (telemetry.cluster.table) holds each node's report as arrays, `Frame` adds
what one decision derives from them (the outstanding estimate with the router's overlay, execution
and wait estimates, the link RTT from the request's site, the predicted completion), computed once
per decision over the whole table and shared by every plugin, and `Columns` is the set of rows still
in the running as filters drop candidates. Every formula is the one of the per-node functions in
`policies.completion` and `policies.warm_model`, in the same order of operations, so both paths give
the same numbers and the same choice (tests/unit/test_columns.py runs every preset both ways).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from telemetry.cluster.view import BoolArray, FloatArray, IntArray, ModelTable

if TYPE_CHECKING:
    from policies.api import Context, RouteRequest
    from telemetry.cluster.view import ClusterView, NodeState


_count = np.count_nonzero  # (a C call: far cheaper than the any()/all() reductions on short arrays)
_fmax, _fmin = np.fmax, np.fmin


def clamp01_rows(x: FloatArray) -> FloatArray:
    """`pipeline.clamp01` of every element (fmax and fmin drop NaN for the bound: NaN counts as worst, 0)."""
    return _fmin(_fmax(x, 0.0), 1.0)


def any_row(mask: BoolArray) -> bool:
    """`mask.any()`."""
    return bool(_count(mask))


def all_rows(mask: BoolArray) -> bool:
    """`mask.all()`."""
    return bool(_count(mask) == len(mask))


class Frame:
    """One decision's view of one model table, with the derived columns it has computed (over all rows).

    The columns every completion-based plugin reads (outstanding, load per slot, execution, wait,
    completion) are kept in slots, each with the default execution time it was computed for (a
    decision's plugins almost always share one); anything else a plugin derives is kept by key."""

    __slots__ = ("view", "table", "req", "ctx", "_cache", "_o", "_ops", "_exec", "_wait", "_done")

    def __init__(self, view: ClusterView, table: ModelTable, req: RouteRequest, ctx: Context) -> None:
        self.view = view
        self.table = table
        self.req = req
        self.ctx = ctx
        self._cache: dict[Any, Any] | None = None
        self._o: IntArray | None = None
        self._ops: FloatArray | None = None
        self._exec: tuple[float, FloatArray] | None = None
        self._wait: tuple[float, FloatArray] | None = None
        self._done: tuple[float, FloatArray] | None = None

    def cached(self, key: Any) -> Any:
        """A column a plugin derived for this decision under `key` (None: not yet)."""
        return None if self._cache is None else self._cache.get(key)

    def keep_cached(self, key: Any, column: Any) -> None:
        """Keep a column a plugin derived, for the other plugins of this decision."""
        if self._cache is None:
            self._cache = {}
        self._cache[key] = column

    def outstanding(self) -> IntArray:
        """`ClusterView.outstanding` of every row (the overlay's estimate)."""
        o = self._o
        if o is None:
            o = self._o = self.view.outstanding_all(self.table)
        return o

    def load_per_slot(self) -> FloatArray:
        """outstanding / capacity."""
        x = self._ops
        if x is None:
            x = self._ops = self.outstanding() / self.table.capacity
        return x

    def exec_ms(self, default_exec_ms: float) -> FloatArray:
        """`completion.exec_estimate_ms`: the EWMA at the request's batch size, else the default."""
        kept = self._exec
        if kept is not None and kept[0] == default_exec_ms:
            return kept[1]
        x = self.table.exec_or(self.req.batch, default_exec_ms)
        self._exec = (default_exec_ms, x)
        return x

    def rtt_ms(self) -> FloatArray:
        """`ClusterView.rtt_ms(site, partition)` of every row, from the request's site."""
        return self.table.rtt(self.view.links, self.req.site)

    def rtt_from(self, site: str | None) -> FloatArray:
        """`ClusterView.rtt_ms(site, partition)` of every row, from another partition."""
        return self.table.rtt(self.view.links, site)

    def wait_ms(self, default_exec_ms: float) -> FloatArray:
        """`completion.predicted_wait_ms` at the request's priority (now = the context's clock)."""
        kept = self._wait
        if kept is not None and kept[0] == default_exec_ms:
            return kept[1]
        t = self.table
        exec_ms = self.exec_ms(default_exec_ms)
        o = self.outstanding()
        priority = self.req.priority
        reported_wait = t.wait(priority)
        now = self.ctx.now_ms
        age = now - t.heard if t.heard_by(now) else np.maximum(0.0, now - t.heard)
        extra = np.maximum(0, o - t.reported)
        known = np.maximum(0.0, reported_wait - age) + extra * exec_ms / t.capacity
        x: FloatArray
        if t.wait_known(priority):  # every node reports its wait (the usual case)
            x = known
        else:
            x = np.where(np.isnan(reported_wait), o / t.capacity * exec_ms, known)
        self._wait = (default_exec_ms, x)
        return x

    def completion_ms(self, default_exec_ms: float) -> FloatArray:
        """`completion.predicted_completion_ms`: rtt + wait + exec."""
        kept = self._done
        if kept is not None and kept[0] == default_exec_ms:
            return kept[1]
        x: FloatArray = self.rtt_ms() + self.wait_ms(default_exec_ms) + self.exec_ms(default_exec_ms)
        self._done = (default_exec_ms, x)
        return x

    def in_partition(self, partition: str) -> BoolArray:
        return self.table.in_partition(partition)


class Columns:
    """The rows of a `Frame` still in the running (ascending, so in the per-node path's order)."""

    __slots__ = ("frame", "rows")

    def __init__(self, frame: Frame, rows: IntArray) -> None:
        self.frame = frame
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def of(self, column: np.ndarray[Any, Any]) -> Any:
        """A whole-table column restricted to these rows."""
        return column[self.rows]

    def keep(self, mask: BoolArray) -> Columns:
        """These rows where `mask` (aligned with them) holds."""
        return Columns(self.frame, self.rows[mask])

    def node(self, i: int) -> NodeState:
        """The node of the i-th row in the running."""
        return self.frame.table.nodes[int(self.rows[i])]

    def nodes(self) -> list[NodeState]:
        nodes = self.frame.table.nodes
        return [nodes[i] for i in self.rows.tolist()]
