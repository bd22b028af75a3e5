"""Per-stage SLO budgets for a workflow DAG, from its end-to-end SLO (ESG's budget split).

A workflow (a camera frame to a detector, each crop to a classifier) has one end-to-end SLO; each
stage needs its own deadline to be scheduled and batched on its own. The split is proportional to the
stages' expected execution times along the critical path:

    s = SLO / (longest path, in expected ms, from any source to any sink)
    latest_finish(v) = SLO - s x tail(v)        tail(v): longest expected path after v to a sink
    budget(v) = latest_finish(v) - max(latest_finish(p) for p in predecessors(v), default 0)

On a chain this is exactly profile-proportional (budget_i = SLO x t_i / sum t). Where the DAG forks
and joins, the stages that every path passes through (the dominators of the sink) get one share each,
and a branch off the critical path gets all the time its slower sibling branch takes, the same as
ESG's grouping of the parallel branches between a dominator and its post-dominator into one
super-stage. Every path's budgets sum to at most the SLO, and the critical path's to exactly it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from graphlib import CycleError, TopologicalSorter


class WorkflowError(ValueError):
    pass


def split_budget(
    slo_ms: float, expected_ms: Mapping[str, float], edges: Sequence[tuple[str, str]]
) -> dict[str, tuple[float, float]]:
    """Per stage: (budget ms, latest finish ms from the workflow's start)."""
    if slo_ms <= 0:
        raise WorkflowError("the end-to-end SLO must be positive")
    stages = set(expected_ms)
    preds: dict[str, set[str]] = {v: set() for v in stages}
    succs: dict[str, set[str]] = {v: set() for v in stages}
    for a, b in edges:
        if a not in stages or b not in stages:
            raise WorkflowError(f"edge {a} -> {b} names a stage that is not in the workflow")
        preds[b].add(a)
        succs[a].add(b)
    try:
        order = list(TopologicalSorter(preds).static_order())
    except CycleError as exc:
        raise WorkflowError(f"the workflow has a cycle: {' -> '.join(exc.args[1])}") from None
    tail: dict[str, float] = {}
    for v in reversed(order):
        tail[v] = max((expected_ms[w] + tail[w] for w in succs[v]), default=0.0)
    critical = max(expected_ms[v] + tail[v] for v in order if not preds[v])
    if critical <= 0:
        raise WorkflowError("the stages' expected times must add up to more than zero")
    scale = slo_ms / critical
    finish = {v: slo_ms - scale * tail[v] for v in order}
    return {v: (finish[v] - max((finish[p] for p in preds[v]), default=0.0), finish[v]) for v in order}
