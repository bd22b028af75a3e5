"""Compass-style warm routing on fixed views: a load costs its measured time where the model is cold."""

from __future__ import annotations

import random

import pytest

from policies import Context, Decision, RouteRequest, build_policy
from policies.warm_model import WarmModel, WarmModelParams, load_penalty_ms
from telemetry.cluster.schema import ModelLoad, NodeLoad
from telemetry.cluster.view import ClusterView
from tests.helpers import load

NOW = 5_000.0


def node(node_id: str, *, resident: bool, wait: float = 0.0, load_ms: float | None = None) -> NodeLoad:
    msg = load(node_id, models={"m": 5.0}, sent_at_ms=NOW, wait={"0": wait})
    state = ModelLoad(resident=resident, load_ms=load_ms, ewma_ms_by_batch={"1": 5.0})
    return msg.replace(models={"m": state})


def choose(*loads: NodeLoad) -> str:
    out = build_policy("compass").choose(
        RouteRequest("m"), ClusterView.of(list(loads), NOW), Context(NOW, random.Random(0))
    )
    assert isinstance(out, Decision)
    return out.node_id


def test_a_busy_warm_node_beats_an_idle_cold_one_until_the_queue_costs_more_than_the_load() -> None:
    assert choose(node("warm", resident=True, wait=120), node("cold", resident=False, load_ms=300)) == "warm"
    assert choose(node("warm", resident=True, wait=400), node("cold", resident=False, load_ms=300)) == "cold"


def test_a_never_loaded_model_costs_the_default_load_time() -> None:
    cold = ClusterView.of([node("cold", resident=False)], NOW).nodes["cold"]
    assert load_penalty_ms(cold, "m", 500.0) == 500.0
    warm = ClusterView.of([node("warm", resident=True, load_ms=250)], NOW).nodes["warm"]
    assert load_penalty_ms(warm, "m", 500.0) == 0.0
    scorer = WarmModel(WarmModelParams(default_load_ms=100))
    v = ClusterView.of([node("a", resident=False), node("b", resident=True, wait=45)], NOW)
    scores = scorer.score(RouteRequest("m"), v, list(v), Context(NOW, random.Random(0)))
    assert scores == pytest.approx([50 / 105, 1.0]), "b finishes at 45 + 5, a at 100 + 5"


def stage(model: str = "m", **kw: object) -> RouteRequest:
    return RouteRequest(model, **kw)  # type: ignore[arg-type]


def pick(policy: str, req: RouteRequest, *loads: NodeLoad) -> str:
    out = build_policy(policy).choose(req, ClusterView.of(list(loads), NOW), Context(NOW, random.Random(0)))
    assert isinstance(out, Decision)
    return out.node_id


def test_a_stage_stays_on_the_node_holding_its_input_until_that_node_is_busier_than_the_move() -> None:
    # 100 kB of crops at the default 100 Mbit/s takes 8 ms to move
    req = stage(input_node="here", input_bytes=100_000)
    assert pick("compass", req, node("here", resident=True, wait=6), node("there", resident=True)) == "here"
    assert pick("compass", req, node("here", resident=True, wait=12), node("there", resident=True)) == "there"
    # without an input elsewhere the idle node wins at once
    assert pick("compass", stage(), node("here", resident=True, wait=6), node("there", resident=True)) == "there"


def test_collocation_across_partitions_counts_the_link_rtt() -> None:
    from router.lifecycle.links import LinkState, LinkTable

    here = node("here", resident=True, wait=20)
    far = node("far", resident=True).replace(partition="cloud")
    v = ClusterView.of([here, far], NOW).with_links(LinkTable([LinkState("edge-a", "cloud", rtt_ms=40.0)]))
    req = stage(input_node="here", input_bytes=1000, site="edge-a")
    scorer = WarmModel()
    here_s, far_s = scorer.score(req, v, [v.nodes["here"], v.nodes["far"]], Context(NOW, random.Random(0)))
    assert here_s == 1.0 and far_s < 1.0, "the far node pays 40 ms to get the input and 40 ms to answer"


def test_finish_estimate_overlaps_the_load_with_the_queue() -> None:
    from policies.warm_model import finish_estimate_ms

    v = ClusterView.of([node("cold", resident=False, load_ms=300, wait=100)], NOW)
    est = finish_estimate_ms(v, v.nodes["cold"], stage(), WarmModelParams(), NOW)
    assert est == pytest.approx(300 + 5), "the queue drains while the node loads"


def test_stage_budget_keeps_the_nodes_that_fit_the_stage_share_else_all() -> None:
    from policies.stage_budget import StageBudget

    f = StageBudget()
    v = ClusterView.of([node("warm", resident=True, wait=10), node("cold", resident=False, load_ms=300)], NOW)
    ctx = Context(NOW, random.Random(0))
    tight = stage(deadline_ms=1000, stage_deadline_ms=50)
    assert [n.node_id for n in f.filter(tight, v, list(v), ctx)] == ["warm"]
    hopeless = stage(deadline_ms=1000, stage_deadline_ms=5)
    assert len(f.filter(hopeless, v, list(v), ctx)) == 2, "nothing fits: placed on the best estimate"
    roomy = stage(deadline_ms=1000)
    assert len(f.filter(roomy, v, list(v), ctx)) == 2, "a single-model request is checked against its deadline"
    assert pick("esg", tight, node("cold", resident=False, load_ms=300), node("warm", resident=True, wait=10)) == "warm"


def test_a_load_this_router_set_off_is_charged_only_what_is_left_of_it() -> None:
    from router.lifecycle.overlay import OutstandingTracker

    tracker = OutstandingTracker()
    base = ClusterView.of(
        [node("loading", resident=False, load_ms=400), node("other", resident=False, load_ms=400)], NOW
    )
    view = tracker.overlay(base)
    tracker.sent_model(view.nodes["loading"], "m", NOW)  # a request went there while the model was cold
    assert view.load_ready_at(view.nodes["loading"], "m") == NOW + 400
    assert view.load_ready_at(view.nodes["other"], "m") is None
    later = NOW + 300
    assert load_penalty_ms(view.nodes["loading"], "m", 500.0, view, later) == pytest.approx(100.0)
    assert load_penalty_ms(view.nodes["other"], "m", 500.0, view, later) == 400.0
    scores = WarmModel().score(RouteRequest("m"), view, list(view), Context(later, random.Random(0)))
    assert scores[0] == 1.0 and scores[1] < 0.5, "the next request joins the load under way"
    # a report showing the model resident ends it
    done = node("loading", resident=True).replace(sent_at_ms=NOW + 450, seq=2)
    fresh = tracker.overlay(base.with_node(type(view.nodes["loading"]).of(done, NOW + 460), NOW + 460))
    assert fresh.load_ready_at(fresh.nodes["loading"], "m") is None


def test_a_cold_model_waits_behind_the_loads_already_queued_on_a_node() -> None:
    from router.lifecycle.overlay import OutstandingTracker

    tracker = OutstandingTracker()
    base = ClusterView.of([node("busy", resident=False, load_ms=400), node("idle", resident=False, load_ms=400)], NOW)
    view = tracker.overlay(base)
    tracker.loading(view.nodes["busy"], "other", NOW, 400.0)  # busy's loader is taken for 400 ms
    assert view.loader_busy_ms(view.nodes["busy"], NOW + 100) == 300.0
    assert load_penalty_ms(view.nodes["busy"], "m", 500.0, view, NOW + 100) == 300.0 + 400.0
    assert load_penalty_ms(view.nodes["idle"], "m", 500.0, view, NOW + 100) == 400.0
    tracker.loading(view.nodes["busy"], "m", NOW + 100, 400.0)  # queued behind: ready at NOW + 800
    assert view.load_ready_at(view.nodes["busy"], "m") == NOW + 800


def test_a_load_reported_done_early_frees_the_nodes_loader_at_once() -> None:
    from router.lifecycle.overlay import OutstandingTracker

    tracker = OutstandingTracker()
    base = ClusterView.of([node("n", resident=False, load_ms=400)], NOW)
    view = tracker.overlay(base)
    tracker.loading(view.nodes["n"], "m", NOW, 400.0)
    assert view.loader_busy_ms(view.nodes["n"], NOW + 100) == 300.0
    # the node reports the model resident at NOW + 150, well before the 400 ms expected
    done = node("n", resident=True).replace(sent_at_ms=NOW + 150, seq=2)
    fresh = tracker.overlay(base.with_node(type(view.nodes["n"]).of(done, NOW + 160), NOW + 160))
    assert fresh.loader_busy_ms(fresh.nodes["n"], NOW + 170) == 0.0, "another model's load need not wait"
    assert fresh.load_ready_at(fresh.nodes["n"], "m") is None


def test_a_node_whose_loads_are_done_is_no_longer_an_exception_to_the_columns() -> None:
    """Once its report shows every load done, a node is judged from its table row again: nothing of
    it is kept (a node loaded once would otherwise be asked one by one on every decision for good)."""
    from router.lifecycle.overlay import OutstandingTracker

    tracker = OutstandingTracker()
    base = ClusterView.of([node("n", resident=False, load_ms=400), node("o", resident=False, load_ms=400)], NOW)
    view = tracker.overlay(base)
    tracker.sent_model(view.nodes["n"], "m", NOW)
    assert tracker.load_exceptions() == {"n"}
    done = node("n", resident=True).replace(sent_at_ms=NOW + 450, seq=2)
    state = type(view.nodes["n"]).of(done, NOW + 460)
    tracker.applied([state])
    assert tracker.load_exceptions() == set()
    fresh = tracker.overlay(base.with_node(state, NOW + 460))
    assert fresh.loader_busy_ms(fresh.nodes["n"], NOW + 470) == 0.0
    tracker.loading(fresh.nodes["n"], "m2", NOW + 470, 100.0)  # a later load starts when it is asked for
    assert fresh.load_ready_at(fresh.nodes["n"], "m2") == NOW + 570
