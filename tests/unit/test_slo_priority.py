"""Deadline- and priority-aware routing: predictions, early refusal (429) and headroom, on fixed views."""

from __future__ import annotations

import random

import pytest

from policies import Context, Decision, Rejection, RouteRequest, build_policy
from policies.completion import predicted_completion_ms
from router.lifecycle.links import LinkState, LinkTable
from telemetry.cluster.schema import NodeLoad
from telemetry.cluster.view import ClusterView
from tests.helpers import load

NOW = 10_000.0


def node(
    node_id: str,
    *,
    wait: dict[str, float] | None = None,
    exec_ms: float = 5.0,
    queued: int = 0,
    in_flight: int = 0,
    partition: str = "edge",
    heard: float = NOW,
) -> tuple[NodeLoad, float]:
    models = {"m": exec_ms}
    msg = load(
        node_id, models=models, queued=queued, in_flight=in_flight, partition=partition, sent_at_ms=heard, wait=wait
    )
    return msg, heard


def view(*nodes: tuple[NodeLoad, float], links: LinkTable | None = None) -> ClusterView:
    v = ClusterView(stale_after_ms=1000)
    for msg, heard in nodes:
        v = v.with_node(ClusterView.of([msg], heard).nodes[msg.node_id], heard)
    return v.with_links(links)


def ctx() -> Context:
    return Context(NOW, random.Random(0))


def test_prediction_adds_rtt_aged_wait_and_execution() -> None:
    links = LinkTable([LinkState("edge", "cloud", rtt_ms=30)])
    v = view(node("a", wait={"0": 40.0, "10": 12.0}, heard=NOW - 5), node("b", partition="cloud"), links=links)
    a, b = v.nodes["a"], v.nodes["b"]
    assert predicted_completion_ms(v, a, RouteRequest("m", priority=10, site="edge"), 5.0, NOW) == pytest.approx(
        (12 - 5) + 5
    )
    assert predicted_completion_ms(v, a, RouteRequest("m", priority=0, site="edge"), 5.0, NOW) == pytest.approx(
        (40 - 5) + 5
    )
    # no expected-wait telemetry: outstanding x exec; a cloud node pays the RTT
    assert predicted_completion_ms(v, b, RouteRequest("m", site="edge"), 5.0, NOW) == pytest.approx(30 + 5)


def test_slo_priority_picks_the_earliest_completion_at_the_requests_priority() -> None:
    # for priority 10, node a (priority scheduler: 2 ms wait) beats b (FIFO-like: 30 ms for everyone)
    v = view(node("a", wait={"0": 50.0, "10": 2.0}), node("b", wait={"0": 30.0, "10": 30.0}))
    out = build_policy("slo_priority").choose(RouteRequest("m", priority=10, deadline_ms=100), v, ctx())
    assert isinstance(out, Decision) and out.node_id == "a"
    out = build_policy("slo_priority").choose(RouteRequest("m", priority=0, deadline_ms=100), v, ctx())
    assert isinstance(out, Decision) and out.node_id == "b"


def test_low_priority_that_cannot_be_served_in_time_is_refused_early_with_429() -> None:
    v = view(node("a", wait={"0": 80.0}), node("b", wait={"0": 90.0}))
    out = build_policy("slo_priority").choose(RouteRequest("m", priority=0, deadline_ms=50), v, ctx())
    assert isinstance(out, Rejection) and out.status == 429 and "deadline_filter" in out.reason


def test_critical_request_is_always_tried_on_the_best_node() -> None:
    v = view(node("a", wait={"0": 80.0}), node("b", wait={"0": 60.0}))
    out = build_policy("slo_priority").choose(RouteRequest("m", priority=10, deadline_ms=50), v, ctx())
    assert isinstance(out, Decision) and out.node_id == "b"


def test_headroom_keeps_low_priority_off_busy_nodes() -> None:
    v = view(node("busy", queued=3, in_flight=1), node("free", wait={"0": 500.0}))
    policy = build_policy({"preset": "slo_priority", "params": {"priority_headroom": {"max_load": 2}}})
    out = policy.choose(RouteRequest("m", priority=0, deadline_ms=1000), v, ctx())
    assert isinstance(out, Decision) and out.node_id == "free"
    full = view(node("busy", queued=3, in_flight=1))
    out = policy.choose(RouteRequest("m", priority=0, deadline_ms=1000), full, ctx())
    assert isinstance(out, Rejection) and out.status == 429 and "priority_headroom" in out.reason
    out = policy.choose(RouteRequest("m", priority=10, deadline_ms=1000), full, ctx())
    assert isinstance(out, Decision), "high priority is never held back by headroom"


def test_by_default_slo_priority_refuses_only_what_no_node_can_answer_in_time() -> None:
    """No load proxy by default: a node with a request per slot outstanding (eight clients in a closed
    loop on the default stack) still takes low-priority work it is predicted to finish in time."""
    busy = view(node("a", queued=1, in_flight=1), node("b", queued=1, in_flight=1))
    out = build_policy("slo_priority").choose(RouteRequest("m", priority=0, deadline_ms=2000), busy, ctx())
    assert isinstance(out, Decision)
    late = view(node("a", wait={"0": 3000.0}), node("b", wait={"0": 2500.0}))
    out = build_policy("slo_priority").choose(RouteRequest("m", priority=0, deadline_ms=2000), late, ctx())
    assert isinstance(out, Rejection) and out.status == 429 and "deadline_filter" in out.reason
