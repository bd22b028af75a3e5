"""Filter `not_tried`: drop nodes this request already failed on, so a retry goes elsewhere.

Inputs: none from telemetry (the request's `exclude` set). Parameters: none.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from policies.api import ClusterView, Context, NodeState, Params, RouteRequest


class NotTriedParams(Params):
    pass


class NotTried:
    name: ClassVar[str] = "not_tried"
    reads: ClassVar[frozenset[str]] = frozenset()
    Params = NotTriedParams

    def __init__(self, params: NotTriedParams | None = None) -> None:
        self.params = params or NotTriedParams()

    def admitter(self, req: RouteRequest, view: ClusterView, ctx: Context) -> Callable[[NodeState], bool] | None:
        if not req.exclude:
            return None
        tried = req.exclude
        return lambda n: n.node_id not in tried

    def filter(self, req: RouteRequest, view: ClusterView, nodes: list[NodeState], ctx: Context) -> list[NodeState]:
        if not req.exclude:
            return nodes
        return [n for n in nodes if n.node_id not in req.exclude]
