"""The engine: filter -> weighted score -> pick.

`Pipeline.choose` runs the filters in order (each may only drop candidates), combines the scorers as
a weighted mean of clamped [0, 1] scores, and lets the picker choose. If a filter leaves no candidate
the answer is a 503 `Rejection` naming that filter, so an operator can see which constraint bit.

Fast path. Filters that judge one node at a time implement `Admitter` (a per-node predicate); a filter
may also be a `CandidateSource`, an indexed starting set (`has_model` gives the view's per-model index)
whose members its own admitter would all accept, so that admitter is not asked again.
The engine fuses the leading per-node filters into one predicate over that set, and when the next
filter is a `Sampler`, it samples by rejection instead of
filtering every node first: a `p2c` decision then costs O(1) in the cluster size, not O(nodes). The
result has the same distribution as filter-then-sample (uniform over the admitted nodes); the slow
path runs only to name the filter that rejected everything.

Columnar path. A pipeline whose candidates come from `has_model` and whose every plugin implements
its columnar hook (`RowAdmitter`, `RowFilter`/`RowGate`, `RowScorer`, `RowPicker`) judges a model
served by `COLUMNS_MIN` or more nodes on the view's column table (policies.columns): each filter and
scorer is a few array operations whatever the number of candidates, so a decision over 1,000 nodes
costs tens of microseconds instead of milliseconds. It chooses exactly what the per-node path chooses
(same numbers, same random draws); smaller sets take the per-node path, which is cheaper there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from policies.api import (
    Admitter,
    CandidateSource,
    ClusterView,
    Context,
    Decision,
    Defer,
    Filter,
    Gate,
    Learner,
    NodeState,
    Picker,
    Rejection,
    RejectStatus,
    RouteRequest,
    RowAdmitter,
    RowFilter,
    RowGate,
    RowPicker,
    RowScorer,
    Sampler,
    Scorer,
    Stateful,
    UnitRowScorer,
)
from policies.columns import Columns, Frame, clamp01_rows
from telemetry.cluster.view import BoolArray, FloatArray

COLUMNS_MIN = 3  # a model served by this many nodes or more is judged on its column table (bench decide)


_ONES: dict[int, FloatArray] = {}


def _ones(n: int) -> FloatArray:
    """n scores of 1 (read-only, shared: every candidate scores the same)."""
    x = _ONES.get(n)
    if x is None:
        if len(_ONES) >= 256:
            _ONES.clear()
        x = _ONES[n] = np.ones(n)
        x.flags.writeable = False
    return x


def clamp01(x: float) -> float:
    if x != x:  # NaN scores count as worst
        return 0.0
    return 0.0 if x < 0.0 else 1.0 if x > 1.0 else x


def _without_health(view: ClusterView) -> ClusterView | None:
    """Ejection and slow start never refuse service outright: when they leave a request no candidate,
    the engine asks again on this view, the same without the router's health (None: it has none)."""
    return None if view.health is None else view.with_outstanding(view.overlay, None)


def _accept(n: NodeState) -> bool:
    return True


def _all_of(preds: list[Callable[[NodeState], bool]]) -> Callable[[NodeState], bool]:
    """One predicate from several, without a generator per node (this runs per candidate)."""
    if not preds:
        return _accept
    if len(preds) == 1:
        return preds[0]
    if len(preds) == 2:
        a, b = preds
        return lambda n: a(n) and b(n)
    if len(preds) == 3:
        a, b, c = preds
        return lambda n: a(n) and b(n) and c(n)
    return lambda n: all(p(n) for p in preds)


@dataclass
class Pipeline:
    name: str
    filters: Sequence[Filter]
    scorers: Sequence[tuple[Scorer, float]]
    picker: Picker
    reads: frozenset[str] = field(init=False)
    _lead: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        reads: set[str] = set()
        for f in self.filters:
            reads |= f.reads
        for s, _ in self.scorers:
            reads |= s.reads
        reads |= self.picker.reads
        self.reads = frozenset(reads)
        # the optional hooks (policies.api), resolved once here, never probed per request
        lead: list[Admitter] = []
        for f in self.filters:
            if not isinstance(f, Admitter):
                break
            lead.append(f)
        self._lead = len(lead)
        self._source: CandidateSource | None = next((f for f in lead if isinstance(f, CandidateSource)), None)
        # the source's candidates are exactly the nodes its own admitter accepts: it is not asked again
        self._admitters = [a for a in lead if a is not self._source]
        rest = list(self.filters[self._lead :])
        self._sampler: Sampler | None = rest[0] if rest and isinstance(rest[0], Sampler) else None
        self._rest: list[Filter] = rest
        self._after_sampler = rest[1:]  # the filters after a sampler that has drawn its nodes
        self._gates: dict[int, Gate] = {id(f): f for f in rest if isinstance(f, Gate)}
        self._observers: list[Learner] = [
            p for p in [*self.filters, *(s for s, _ in self.scorers), self.picker] if isinstance(p, Learner)
        ]
        self._stateful: list[tuple[str, Stateful]] = [(f.name, f) for f in self.filters if isinstance(f, Stateful)]
        # the columnar path: every plugin has its columnar hook, and the candidates come from the index
        # (the candidate source's table is its model's: its rows are the nodes serving the model)
        # (isinstance on a Protocol is slow: each plugin's columnar step is resolved here, once)
        row_admitters = [a for a in lead if isinstance(a, RowAdmitter)]
        self._row_admits = [a.admit_rows for a in row_admitters]
        self._row_steps: list[tuple[Callable[[RouteRequest, Columns, Context], Columns | Defer], bool]] = []
        for f in rest:
            if isinstance(f, Gate):
                if isinstance(f, RowGate):
                    self._row_steps.append((f.gate_rows, True))
            elif isinstance(f, RowFilter):
                self._row_steps.append((f.filter_rows, False))
        self._row_scorers = [(s, w) for s, w in self.scorers if isinstance(s, RowScorer)]
        self._row_picker = self.picker if isinstance(self.picker, RowPicker) else None
        # the scorers that count (a weight of 0 adds nothing; with no positive total, none counts)
        self._total_weight = sum(w for _, w in self.scorers)
        live = self._total_weight > 0
        self._weighted_nodes = [(s, w) for s, w in self.scorers if w != 0] if live else []
        # each counting columnar scorer's scores, clamped to [0, 1] unless they always are (UnitRowScorer)
        self._weighted: list[tuple[Callable[[RouteRequest, Columns, Context], FloatArray], float]] = (
            [(self._clamped_rows(s), w) for s, w in self._row_scorers if w != 0] if live else []
        )
        self.columnar = (
            self._source is not None
            and self._sampler is None
            and len(row_admitters) == len(lead)
            and len(self._row_steps) == len(rest)
            and len(self._row_scorers) == len(self.scorers)
            and self._row_picker is not None
        )

    def _rejection(self, req: RouteRequest, view: ClusterView, ctx: Context) -> Rejection:
        nodes = list(view)
        if not nodes:
            return Rejection(503, "no nodes known (no telemetry received yet)")
        for f in self.filters:
            nodes = f.filter(req, view, nodes, ctx)
            if not nodes:
                return Rejection(
                    f.reject_status(req) if isinstance(f, RejectStatus) else 503,
                    f"no node for model '{req.model}' passed filter '{f.name}'",
                )
        return Rejection(503, f"no node for model '{req.model}'")

    def _candidates(self, req: RouteRequest, view: ClusterView, ctx: Context) -> list[NodeState] | Defer | None:
        """The nodes that pass every filter, by the fast path where it applies; None if none pass.

        A filter with a `gate` method (delay scheduling) may instead answer `Defer`: hold the request.
        """
        source = self._source
        base: Sequence[NodeState] = list(view) if source is None else source.candidates(req, view)
        admitters = self._admitters
        if len(admitters) == 1:  # (the usual case: `healthy` alone; none admits all, as _all_of says)
            admit = admitters[0].admitter(req, view, ctx) or _accept
        else:
            admits: list[Callable[[NodeState], bool]] = []
            for adm in admitters:
                a = adm.admitter(req, view, ctx)
                if a is not None:
                    admits.append(a)
            admit = _all_of(admits)

        rest = self._rest
        nodes: list[NodeState] | None = None
        if self._sampler is not None:
            nodes = self._sampler.sample_from(base, admit, ctx)
            if nodes is not None:
                rest = self._after_sampler
        if nodes is None:
            nodes = [n for n in base if admit(n)]
        gates = self._gates
        for f in rest:
            if not nodes:
                break
            gate = gates.get(id(f))
            if gate is None:
                nodes = f.filter(req, view, nodes, ctx)
                continue
            held = gate.gate(req, view, nodes, ctx)
            if isinstance(held, Defer):
                return held
            nodes = held
        return nodes or None

    def _rows(self, req: RouteRequest, view: ClusterView, ctx: Context) -> Columns | Defer | None:
        """`_candidates` on the model's column table (the columnar path; see the module docstring)."""
        table = view.table(req.model)
        mask: BoolArray | None = None
        for admit_rows in self._row_admits:
            mask = admit_rows(req, view, table, ctx, mask)
        rows = table.all_rows() if mask is None else mask.nonzero()[0]
        if not len(rows):
            return None
        cols = Columns(Frame(view, table, req, ctx), rows)
        for step, gate in self._row_steps:
            found = step(req, cols, ctx)
            if gate and isinstance(found, Defer):
                return found
            cols = found  # type: ignore[assignment]  # (a filter's step gives Columns)
            if not len(cols.rows):
                return None
        return cols

    @staticmethod
    def _clamped_rows(scorer: RowScorer) -> Callable[[RouteRequest, Columns, Context], FloatArray]:
        """The scorer's columnar scores clamped to [0, 1] (as the per-node path clamps each score)."""
        if isinstance(scorer, UnitRowScorer):
            return scorer.unit_score_rows  # within [0, 1] already: clamping would change nothing
        score_rows = scorer.score_rows
        return lambda req, cols, ctx: clamp01_rows(score_rows(req, cols, ctx))

    def _combined_rows(self, req: RouteRequest, cols: Columns, ctx: Context) -> FloatArray | None:
        """The weighted mean of the clamped scores of `cols`, or None: every candidate scores the same.
        One weighted scorer is its own mean (the per-node path takes the same shortcut: same numbers)."""
        weighted = self._weighted
        if not weighted:
            return None
        if len(weighted) == 1:
            return weighted[0][0](req, cols, ctx)
        combined = np.zeros(len(cols))
        for clamped, weight in weighted:
            combined += weight * clamped(req, cols, ctx)
        total: FloatArray = combined / self._total_weight
        return total

    def _choose_rows(self, req: RouteRequest, view: ClusterView, ctx: Context) -> Decision | Rejection | Defer:
        cols = self._rows(req, view, ctx)
        if cols is None and (unejected := _without_health(view)) is not None:
            view = unejected
            cols = self._rows(req, view, ctx)
        if cols is None:
            return self._rejection(req, view, ctx)
        if isinstance(cols, Defer):
            return cols
        n = len(cols.rows)
        scores = self._combined_rows(req, cols, ctx) if n > 1 else None
        if scores is None:
            scores = _ones(n)
        assert self._row_picker is not None
        chosen = cols.node(self._row_picker.pick_row(req, cols, scores, ctx))
        return Decision(chosen.node_id, chosen.endpoint, self.name)

    @property
    def learns(self) -> bool:
        """True if some plugin learns from outcomes (then the router feeds every answer back)."""
        return bool(self._observers)

    def observe(self, req: RouteRequest, latency_ms: float, met_deadline: bool, ctx: Context) -> None:
        """Feed one answered request back to the plugins that learn from outcomes (delay tuning)."""
        for f in self._observers:
            f.observe(req, latency_ms, met_deadline, ctx)

    def state(self) -> dict[str, Any]:
        """What the stateful plugins have learned (e.g. tuned delay timers), for /admin and reports."""
        return {name: f.state() for name, f in self._stateful}

    def choose(self, req: RouteRequest, view: ClusterView, ctx: Context) -> Decision | Rejection | Defer:
        if self.columnar and view.serving_count(req.model) >= COLUMNS_MIN:
            return self._choose_rows(req, view, ctx)
        nodes = self._candidates(req, view, ctx)
        if nodes is None and (unejected := _without_health(view)) is not None:
            view = unejected
            nodes = self._candidates(req, view, ctx)
        if nodes is None:
            return self._rejection(req, view, ctx)
        if isinstance(nodes, Defer):
            return nodes
        weighted = self._weighted_nodes
        if not weighted or len(nodes) == 1:
            scores: list[float] = [1.0] * len(nodes)
        elif len(weighted) == 1:  # one weighted scorer is its own mean
            scores = [clamp01(s) for s in weighted[0][0].score(req, view, nodes, ctx)]
        else:
            combined = [0.0] * len(nodes)
            for scorer, weight in weighted:
                for i, s in enumerate(scorer.score(req, view, nodes, ctx)):
                    combined[i] += weight * clamp01(s)
            scores = [c / self._total_weight for c in combined]
        chosen = self.picker.pick(req, nodes, scores, ctx)
        return Decision(chosen.node_id, chosen.endpoint, self.name)
