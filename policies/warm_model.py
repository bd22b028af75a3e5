"""Scorer `warm_model`: Compass-style finish estimate, preferring nodes where the model is warm.

    finish(node) = rtt(site, partition) + max(wait(priority), load, input arrival) + exec

- `rtt`, `wait` and `exec` are as in `completion`;
- `load` is 0 when the model is resident on the node, what is left of a load this router already set
  off there (`ClusterView.load_ready_at`: a request went there while the model was cold), else the
  node's last measured load time for it (`models.load_ms`, else `default_load_ms`) after the loads of
  other models this router set off there (`loader_busy_ms`: a node loads one at a time); the node
  loads before it queues the request, so the queue ahead drains meanwhile: the two overlap;
- `input arrival` is 0 for a request whose input is already on the node (a workflow stage after a
  stage that ran there: the stages are collocated), else the time to move `input_bytes` at
  `bandwidth_mbps` plus the link RTT between the two nodes' partitions.

For a workflow stage whose output feeds later stages (`next_models`), a node that does not hold those
models resident is charged the move of that output (`next_bytes`): the next stage will either go
elsewhere and fetch it, or load its model here. So a job's stages gather where all of them are warm.

A node that would have to load the model first, or fetch the input from another node, is chosen only
when the warm, collocated ones are busier than that costs. score = min_finish / finish.
Inputs: models.resident, models.load_ms, plus those of `completion`. Parameters: `default_load_ms`
(> 0, default 500), `default_exec_ms` (default 5), `bandwidth_mbps` (node-to-node, default 100: an edge site's LAN).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
from pydantic import Field

from policies.api import ClusterView, Columns, Context, NodeState, Params, RouteRequest
from policies.columns import Frame
from policies.completion import best_over, exec_estimate_ms, predicted_wait_ms
from telemetry.cluster.view import FloatArray


class WarmModelParams(Params):
    default_load_ms: float = Field(500.0, gt=0)
    default_exec_ms: float = Field(5.0, gt=0)
    bandwidth_mbps: float = Field(100.0, gt=0)


def load_penalty_ms(
    node: NodeState, model: str, default_load_ms: float, view: ClusterView | None = None, now_ms: float = 0.0
) -> float:
    """0 where resident; what is left of a load this router already set off there; else a whole load."""
    state = node.model(model)
    if state is None or state.resident:
        return 0.0
    load = state.load_ms if state.load_ms is not None else default_load_ms
    if view is None:
        return load
    ready_at = view.load_ready_at(node, model)
    if ready_at is not None:
        return max(0.0, ready_at - now_ms)
    return view.loader_busy_ms(node, now_ms) + load  # behind the loads already queued there


def load_penalty_rows(frame: Frame, model: str, default_load_ms: float, now_ms: float) -> FloatArray:
    """`load_penalty_ms` of every row of the frame's table (the few nodes where this router set off
    loads asked one by one)."""
    t = frame.table
    out = t.load_penalty(default_load_ms)
    view = frame.view
    if view.overlay is not None:
        pos, resident, nodes = t.pos, t.resident, t.nodes
        copied = False
        for node_id in view.overlay.load_exceptions():
            i = pos.get(node_id)
            if i is not None and not resident[i]:
                if not copied:
                    out, copied = out.copy(), True
                out[i] = load_penalty_ms(nodes[i], model, default_load_ms, view, now_ms)
    return out


def input_arrival_rows(frame: Frame, req: RouteRequest, bandwidth_mbps: float) -> FloatArray | float:
    """`input_arrival_ms` of every row of the frame's table."""
    if req.input_node is None:
        return 0.0
    source = frame.view.get(req.input_node)
    n = len(frame.table)
    rtt = np.zeros(n) if source is None else frame.rtt_from(source.partition)
    out = rtt + req.input_bytes * 8.0 / (bandwidth_mbps * 1000.0)
    i = frame.table.pos.get(req.input_node)
    if i is not None:
        out[i] = 0.0
    return out


def next_move_rows(frame: Frame, req: RouteRequest, bandwidth_mbps: float) -> FloatArray | float:
    """`next_move_ms` of every row of the frame's table."""
    if not req.next_models:
        return 0.0
    warm = frame.table.resident_of(req.next_models[0])
    for m in req.next_models[1:]:
        warm = warm & frame.table.resident_of(m)
    return np.where(warm, 0.0, req.next_bytes * 8.0 / (bandwidth_mbps * 1000.0))


def input_arrival_ms(view: ClusterView, node: NodeState, req: RouteRequest, bandwidth_mbps: float) -> float:
    """Time for the request's input to reach `node` from the node that produced it (0 if the same)."""
    if req.input_node is None or req.input_node == node.node_id:
        return 0.0
    source = view.get(req.input_node)
    rtt = 0.0 if source is None else view.rtt_ms(source.partition, node.partition)
    return rtt + req.input_bytes * 8.0 / (bandwidth_mbps * 1000.0)


def next_move_ms(node: NodeState, req: RouteRequest, bandwidth_mbps: float) -> float:
    """What the stages after this one pay if they cannot stay on `node`: moving this stage's output."""
    if not req.next_models or all((m := node.model(n)) is not None and m.resident for n in req.next_models):
        return 0.0
    return req.next_bytes * 8.0 / (bandwidth_mbps * 1000.0)


def finish_estimate_ms(
    view: ClusterView, node: NodeState, req: RouteRequest, p: WarmModelParams, now_ms: float
) -> float:
    exec_ms = exec_estimate_ms(node, req, p.default_exec_ms)
    start = max(
        predicted_wait_ms(view, node, req, exec_ms, now_ms),
        load_penalty_ms(node, req.model, p.default_load_ms, view, now_ms),
        input_arrival_ms(view, node, req, p.bandwidth_mbps),
    )
    return view.rtt_ms(req.site, node.partition) + start + exec_ms


def finish_estimate_rows(frame: Frame, req: RouteRequest, p: WarmModelParams, now_ms: float) -> FloatArray:
    """`finish_estimate_ms` of every row of the frame's table (computed once per decision and settings:
    `stage_budget` and `warm_model` in one pipeline share it)."""
    key = ("finish", p.default_exec_ms, p.default_load_ms, p.bandwidth_mbps)
    cached: FloatArray | None = frame.cached(key)
    if cached is not None:
        return cached
    exec_ms = frame.exec_ms(p.default_exec_ms)
    # wait and load are never negative (nor NaN): with no input to move, start is their maximum
    start = np.maximum(frame.wait_ms(p.default_exec_ms), load_penalty_rows(frame, req.model, p.default_load_ms, now_ms))
    arrival = input_arrival_rows(frame, req, p.bandwidth_mbps)
    if not isinstance(arrival, float):
        start = np.maximum(start, arrival)
    finish: FloatArray = frame.rtt_ms() + start + exec_ms
    frame.keep_cached(key, finish)
    return finish


READS = frozenset(
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


class WarmModel:
    name: ClassVar[str] = "warm_model"
    reads: ClassVar[frozenset[str]] = READS
    Params = WarmModelParams

    def __init__(self, params: WarmModelParams | None = None) -> None:
        self.params = params or WarmModelParams()

    def score(self, req: RouteRequest, view: ClusterView, nodes: list[NodeState], ctx: Context) -> list[float]:
        p = self.params
        finish = [
            finish_estimate_ms(view, n, req, p, ctx.now_ms) + next_move_ms(n, req, p.bandwidth_mbps) for n in nodes
        ]
        best = min(finish)
        return [best / f if f > 0 else 1.0 for f in finish]

    def unit_score_rows(self, req: RouteRequest, cols: Columns, ctx: Context) -> FloatArray:
        p = self.params
        finish = finish_estimate_rows(cols.frame, req, p, ctx.now_ms)
        if req.next_models:
            finish = finish + next_move_rows(cols.frame, req, p.bandwidth_mbps)
        return best_over(cols.of(finish))

    score_rows = unit_score_rows
