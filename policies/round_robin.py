"""Picker `round_robin`: cycle through the candidates in node-id order, ignoring scores.

Keeps one counter per model, so each model's traffic is spread evenly even when models are served by
different node sets. The counter is the policy's only state; it is deterministic (no clock, no RNG),
so the simulator reproduces the live order. Inputs: none. Parameters: none.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import numpy as np

from policies.api import Columns, Context, NodeState, Params, RouteRequest
from telemetry.cluster.view import FloatArray


class RoundRobinParams(Params):
    pass


class RoundRobin:
    name: ClassVar[str] = "round_robin"
    reads: ClassVar[frozenset[str]] = frozenset()
    Params = RoundRobinParams

    def __init__(self, params: RoundRobinParams | None = None) -> None:
        self.params = params or RoundRobinParams()
        self._next: dict[str, int] = {}

    def pick(self, req: RouteRequest, nodes: list[NodeState], scores: Sequence[float], ctx: Context) -> NodeState:
        ordered = sorted(nodes, key=lambda n: n.node_id)
        i = self._next.get(req.model, 0)
        self._next[req.model] = i + 1
        return ordered[i % len(ordered)]

    def pick_row(self, req: RouteRequest, cols: Columns, scores: FloatArray, ctx: Context) -> int:
        by_id = np.argsort(cols.of(cols.frame.table.id_rank()), kind="stable")
        i = self._next.get(req.model, 0)
        self._next[req.model] = i + 1
        return int(by_id[i % len(by_id)])
