"""Filter `has_model`: keep nodes that serve the requested model. Inputs: models. Parameters: none."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import ClassVar

from policies.api import ClusterView, Context, NodeState, Params, RouteRequest
from telemetry.cluster.view import BoolArray, ModelTable


class HasModelParams(Params):
    pass


class HasModel:
    name: ClassVar[str] = "has_model"
    reads: ClassVar[frozenset[str]] = frozenset({"models"})
    Params = HasModelParams

    def __init__(self, params: HasModelParams | None = None) -> None:
        self.params = params or HasModelParams()

    def candidates(self, req: RouteRequest, view: ClusterView) -> Sequence[NodeState]:
        """The view's per-model index: O(1) instead of a scan."""
        return view.serving(req.model)

    def admit_rows(
        self, req: RouteRequest, view: ClusterView, table: ModelTable, ctx: Context, mask: BoolArray | None
    ) -> BoolArray | None:
        """Every row of the model's table serves the model."""
        return mask

    def admitter(self, req: RouteRequest, view: ClusterView, ctx: Context) -> Callable[[NodeState], bool]:
        model = req.model
        return lambda n: model in n.load.models

    def filter(self, req: RouteRequest, view: ClusterView, nodes: list[NodeState], ctx: Context) -> list[NodeState]:
        return [n for n in nodes if n.serves(req.model)]
