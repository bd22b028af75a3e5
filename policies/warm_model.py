"""Scorer `warm_model`: Compass-style finish estimate, preferring nodes where the model is warm.

finish(node) = rtt(site, partition) + wait(priority) + load + exec, where `rtt`, `wait` and `exec`
are as in `completion`, and `load` is 0 when the model is resident on the node and otherwise the
node's last measured load time for it (`models.load_ms`), else `default_load_ms`. A node that would
have to load the model first is chosen only when the warm ones are busier than the load costs.

score = min_finish / finish. Inputs: models.resident, models.load_ms, plus those of `completion`.
Parameters: `default_load_ms` (> 0, default 500), `default_exec_ms` (default 5).
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from policies.api import ClusterView, Context, NodeState, Params, RouteRequest
from policies.completion import predicted_completion_ms


class WarmModelParams(Params):
    default_load_ms: float = Field(500.0, gt=0)
    default_exec_ms: float = Field(5.0, gt=0)


def load_penalty_ms(node: NodeState, model: str, default_load_ms: float) -> float:
    state = node.model(model)
    if state is None or state.resident:
        return 0.0
    return state.load_ms if state.load_ms is not None else default_load_ms


class WarmModel:
    name: ClassVar[str] = "warm_model"
    reads: ClassVar[frozenset[str]] = frozenset(
        {
            "models.resident",
            "models.load_ms",
            "expected_wait_ms",
            "models.ewma_ms_by_batch",
            "queued_by_priority",
            "in_flight",
            "capacity",
            "partition",
        }
    )
    Params = WarmModelParams

    def __init__(self, params: WarmModelParams | None = None) -> None:
        self.params = params or WarmModelParams()

    def score(self, req: RouteRequest, view: ClusterView, nodes: list[NodeState], ctx: Context) -> list[float]:
        p = self.params
        finish = [
            predicted_completion_ms(view, n, req, p.default_exec_ms, ctx.now_ms)
            + load_penalty_ms(n, req.model, p.default_load_ms)
            for n in nodes
        ]
        best = min(finish)
        return [best / f if f > 0 else 1.0 for f in finish]
