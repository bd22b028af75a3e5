"""Filter `sample`: keep `k` candidates drawn uniformly without replacement (ctx.rng).

With `k=2`, followed by the `queue` scorer and the `max` picker, this is power-of-two-choices
(Mitzenmacher): near-least-loaded placement at O(1) cost, and robust to stale load data because two
random candidates rarely both be the node every router currently believes is idle.
Inputs: none. Parameters: `k` (>= 1, default 2).
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from policies.api import ClusterView, Context, NodeState, Params, RouteRequest


class SampleParams(Params):
    k: int = Field(2, ge=1)


class Sample:
    name: ClassVar[str] = "sample"
    reads: ClassVar[frozenset[str]] = frozenset()
    Params = SampleParams

    def __init__(self, params: SampleParams | None = None) -> None:
        self.params = params or SampleParams()

    def filter(
        self, req: RouteRequest, view: ClusterView, nodes: list[NodeState], ctx: Context
    ) -> list[NodeState]:
        if len(nodes) <= self.params.k:
            return nodes
        return ctx.rng.sample(nodes, self.params.k)
