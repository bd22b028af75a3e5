"""Filter `sample`: keep `k` candidates drawn uniformly without replacement (ctx.rng).

With `k=2`, followed by the `queue` scorer and the `max` picker, this is power-of-two-choices
(Mitzenmacher): near-least-loaded placement at O(1) cost, and robust to stale load data because two
random candidates rarely both be the node every router currently believes is idle.
Inputs: none. Parameters: `k` (>= 1, default 2).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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

    def sample_from(
        self, nodes: Sequence[NodeState], admit: Callable[[NodeState], bool], ctx: Context
    ) -> list[NodeState] | None:
        """`k` admitted nodes drawn by rejection from `nodes`, or None to ask for the full path.

        Sequential uniform draws, skipping nodes already drawn or not admitted, give a uniform k-subset
        of the admitted nodes, the same distribution as filtering first. Gives up (None) on small sets
        or after `8k + 16` misses, when most nodes are not admitted and a scan is cheaper.
        """
        k, n = self.params.k, len(nodes)
        if n <= 4 * k:
            return None
        chosen: list[NodeState] = []
        seen: set[int] = set()
        drawn = misses = 0  # (len(seen), counted: this runs on every decision)
        most = 8 * k + 16
        draw = ctx.rng.random
        while k:  # (k: nodes still to choose)
            if drawn == n:
                return None
            i = int(draw() * n)
            if i in seen:
                continue
            seen.add(i)
            drawn += 1
            node = nodes[i]
            if admit(node):
                chosen.append(node)
                k -= 1
            else:
                misses += 1
                if misses > most:
                    return None
        return chosen

    def filter(self, req: RouteRequest, view: ClusterView, nodes: list[NodeState], ctx: Context) -> list[NodeState]:
        if len(nodes) <= self.params.k:
            return nodes
        return ctx.rng.sample(nodes, self.params.k)
