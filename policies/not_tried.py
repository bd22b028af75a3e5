"""Filter `not_tried`: drop nodes this request already failed on, so a retry goes elsewhere.

Inputs: none from telemetry (the request's `exclude` set). Parameters: none.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import numpy as np

from policies.api import ClusterView, Context, NodeState, Params, RouteRequest
from telemetry.cluster.view import BoolArray, ModelTable


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

    def admit_rows(
        self, req: RouteRequest, view: ClusterView, table: ModelTable, ctx: Context, mask: BoolArray | None
    ) -> BoolArray | None:
        if not req.exclude:
            return mask
        out = np.ones(len(table), dtype=np.bool_) if mask is None else mask.copy()
        pos = table.pos
        for node_id in req.exclude:
            i = pos.get(node_id)
            if i is not None:
                out[i] = False
        return out

    def filter(self, req: RouteRequest, view: ClusterView, nodes: list[NodeState], ctx: Context) -> list[NodeState]:
        if not req.exclude:
            return nodes
        return [n for n in nodes if n.node_id not in req.exclude]
