"""Compass-style warm routing on fixed views: a load costs its measured time where the model is cold."""

from __future__ import annotations

import random

import pytest

from policies import Context, Decision, RouteRequest, build_policy
from policies.warm_model import WarmModel, WarmModelParams, load_penalty_ms
from telemetry.schema import ModelLoad, NodeLoad
from telemetry.view import ClusterView
from tests.helpers import load

NOW = 5_000.0


def node(node_id: str, *, resident: bool, wait: float = 0.0, load_ms: float | None = None) -> NodeLoad:
    msg = load(node_id, models={"m": 5.0}, sent_at_ms=NOW, wait={"0": wait})
    state = ModelLoad(resident=resident, load_ms=load_ms, ewma_ms_by_batch={"1": 5.0})
    return msg.model_copy(update={"models": {"m": state}})


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
