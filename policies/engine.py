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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

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
    Sampler,
    Scorer,
    Stateful,
)


def clamp01(x: float) -> float:
    if x != x:  # NaN scores count as worst
        return 0.0
    return 0.0 if x < 0.0 else 1.0 if x > 1.0 else x


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
        self._admitters = lead
        self._source: CandidateSource | None = next((f for f in lead if isinstance(f, CandidateSource)), None)
        rest = list(self.filters[self._lead :])
        self._sampler: Sampler | None = rest[0] if rest and isinstance(rest[0], Sampler) else None
        self._rest: list[Filter] = rest
        self._gates: dict[int, Gate] = {id(f): f for f in rest if isinstance(f, Gate)}
        self._observers: list[Learner] = [
            p for p in [*self.filters, *(s for s, _ in self.scorers), self.picker] if isinstance(p, Learner)
        ]
        self._stateful: list[tuple[str, Stateful]] = [(f.name, f) for f in self.filters if isinstance(f, Stateful)]

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
        admits: list[Callable[[NodeState], bool]] = []
        skip: object = source  # its candidates are exactly the nodes its own admitter accepts
        for adm in self._admitters:
            if adm is skip:
                continue
            a = adm.admitter(req, view, ctx)
            if a is not None:
                admits.append(a)

        admit = _all_of(admits)

        rest = self._rest
        nodes: list[NodeState] | None = None
        if self._sampler is not None:
            nodes = self._sampler.sample_from(base, admit, ctx)
            if nodes is not None:
                rest = rest[1:]
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
        nodes = self._candidates(req, view, ctx)
        if nodes is None and view.health is not None:
            # ejection and slow start never refuse service outright: without them, if they left nothing
            view = view.with_outstanding(view.overlay, None)
            nodes = self._candidates(req, view, ctx)
        if nodes is None:
            return self._rejection(req, view, ctx)
        if isinstance(nodes, Defer):
            return nodes
        if self.scorers and len(nodes) > 1:
            total_weight = sum(w for _, w in self.scorers)
            combined = [0.0] * len(nodes)
            if total_weight > 0:
                for scorer, weight in self.scorers:
                    if weight == 0:
                        continue
                    for i, s in enumerate(scorer.score(req, view, nodes, ctx)):
                        combined[i] += weight * clamp01(s)
                scores: list[float] = [c / total_weight for c in combined]
            else:
                scores = [1.0] * len(nodes)
        else:
            scores = [1.0] * len(nodes)
        chosen = self.picker.pick(req, nodes, scores, ctx)
        return Decision(chosen.node_id, chosen.endpoint, self.name)
