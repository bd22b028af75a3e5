"""Picker `random`: uniform over the candidates (ctx.rng), ignoring scores. Parameters: none."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from policies.api import Columns, Context, NodeState, Params, RouteRequest
from telemetry.cluster.view import FloatArray


class RandomParams(Params):
    pass


class RandomPick:
    name: ClassVar[str] = "random"
    reads: ClassVar[frozenset[str]] = frozenset()
    Params = RandomParams

    def __init__(self, params: RandomParams | None = None) -> None:
        self.params = params or RandomParams()

    def pick(self, req: RouteRequest, nodes: list[NodeState], scores: Sequence[float], ctx: Context) -> NodeState:
        return ctx.rng.choice(nodes)

    def pick_row(self, req: RouteRequest, cols: Columns, scores: FloatArray, ctx: Context) -> int:
        return ctx.rng.choice(range(len(cols)))  # the same draw as `choice` over the candidates
