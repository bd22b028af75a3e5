"""Picker `weighted_random`: choose with probability proportional to score ** `power` (ctx.rng).

Spreads load in proportion to headroom instead of sending everything to the single best node, which
helps when the view is stale. All-zero scores fall back to uniform.
Parameters: `power` (>= 0, default 1; 0 is uniform, large values approach `max`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from pydantic import Field

from policies.api import Context, NodeState, Params, RouteRequest


class WeightedRandomParams(Params):
    power: float = Field(1.0, ge=0)


class WeightedRandom:
    name: ClassVar[str] = "weighted_random"
    reads: ClassVar[frozenset[str]] = frozenset()
    Params = WeightedRandomParams

    def __init__(self, params: WeightedRandomParams | None = None) -> None:
        self.params = params or WeightedRandomParams()

    def pick(self, req: RouteRequest, nodes: list[NodeState], scores: Sequence[float], ctx: Context) -> NodeState:
        weights = [max(0.0, s) ** self.params.power for s in scores]
        if sum(weights) <= 0:
            return ctx.rng.choice(nodes)
        return ctx.rng.choices(nodes, weights=weights, k=1)[0]
