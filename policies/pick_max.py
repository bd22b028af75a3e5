"""Picker `max`: the highest combined score; ties broken uniformly at random (ctx.rng).

Random tie-breaking matters: with equal scores, "first in list" would herd every router onto the same
node. Inputs: none. Parameters: `tolerance` (scores within it of the best count as ties, default 1e-9).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from pydantic import Field

from policies.api import Columns, Context, NodeState, Params, RouteRequest
from telemetry.cluster.view import FloatArray


class MaxParams(Params):
    tolerance: float = Field(1e-9, ge=0)


class PickMax:
    name: ClassVar[str] = "max"
    reads: ClassVar[frozenset[str]] = frozenset()
    Params = MaxParams

    def __init__(self, params: MaxParams | None = None) -> None:
        self.params = params or MaxParams()

    def pick_row(self, req: RouteRequest, cols: Columns, scores: FloatArray, ctx: Context) -> int:
        best = scores[scores.argmax()]  # (argmax and a compare cost less than max(), a reduction)
        ties = (scores >= best - self.params.tolerance).nonzero()[0]
        return int(ties[0]) if len(ties) == 1 else int(ctx.rng.choice(ties.tolist()))

    def pick(self, req: RouteRequest, nodes: list[NodeState], scores: Sequence[float], ctx: Context) -> NodeState:
        if len(nodes) == 2:  # (power of two choices: the same answer without the lists)
            a, b = scores
            tolerance = self.params.tolerance
            if b < a - tolerance:
                return nodes[0]
            if a < b - tolerance:
                return nodes[1]
            return ctx.rng.choice(nodes)
        floor = max(scores) - self.params.tolerance
        ties = [n for n, s in zip(nodes, scores, strict=True) if s >= floor]
        return ties[0] if len(ties) == 1 else ctx.rng.choice(ties)
