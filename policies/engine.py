"""The engine: filter -> weighted score -> pick.

`Pipeline.choose` runs the filters in order (each may only drop candidates), combines the scorers as
a weighted mean of clamped [0, 1] scores, and lets the picker choose. If a filter leaves no candidate
the answer is a 503 `Rejection` naming that filter, so an operator can see which constraint bit.
Cost is O(filters x nodes + scorers x nodes) per decision.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from policies.api import (
    ClusterView,
    Context,
    Decision,
    Filter,
    Picker,
    Rejection,
    RouteRequest,
    Scorer,
)


def clamp01(x: float) -> float:
    if x != x:  # NaN scores count as worst
        return 0.0
    return 0.0 if x < 0.0 else 1.0 if x > 1.0 else x


@dataclass
class Pipeline:
    name: str
    filters: Sequence[Filter]
    scorers: Sequence[tuple[Scorer, float]]
    picker: Picker
    reads: frozenset[str] = field(init=False)

    def __post_init__(self) -> None:
        reads: set[str] = set()
        for f in self.filters:
            reads |= f.reads
        for s, _ in self.scorers:
            reads |= s.reads
        reads |= self.picker.reads
        self.reads = frozenset(reads)

    def choose(self, req: RouteRequest, view: ClusterView, ctx: Context) -> Decision | Rejection:
        nodes = list(view)
        if not nodes:
            return Rejection(503, "no nodes known (no telemetry received yet)")
        for f in self.filters:
            nodes = f.filter(req, view, nodes, ctx)
            if not nodes:
                return Rejection(503, f"no node for model '{req.model}' passed filter '{f.name}'")
        total_weight = sum(w for _, w in self.scorers)
        if total_weight > 0 and len(nodes) > 1:
            combined = [0.0] * len(nodes)
            for scorer, weight in self.scorers:
                if weight == 0:
                    continue
                for i, s in enumerate(scorer.score(req, view, nodes, ctx)):
                    combined[i] += weight * clamp01(s)
            scores: list[float] = [c / total_weight for c in combined]
        else:
            scores = [1.0] * len(nodes)
        chosen = self.picker.pick(req, nodes, scores, ctx)
        return Decision(chosen.node_id, chosen.endpoint, self.name)
