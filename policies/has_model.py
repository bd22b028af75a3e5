"""Filter `has_model`: keep nodes that serve the requested model. Inputs: models. Parameters: none."""

from __future__ import annotations

from typing import ClassVar

from policies.api import ClusterView, Context, NodeState, Params, RouteRequest


class HasModelParams(Params):
    pass


class HasModel:
    name: ClassVar[str] = "has_model"
    reads: ClassVar[frozenset[str]] = frozenset({"models"})
    Params = HasModelParams

    def __init__(self, params: HasModelParams | None = None) -> None:
        self.params = params or HasModelParams()

    def filter(
        self, req: RouteRequest, view: ClusterView, nodes: list[NodeState], ctx: Context
    ) -> list[NodeState]:
        return [n for n in nodes if n.serves(req.model)]
