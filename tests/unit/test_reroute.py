"""Re-routing queued work (router.lifecycle.reroute): when an attempt is taken back, where it goes, the
per-request and per-node bounds, displacement by high-priority arrivals, and the simulator's slow-node
replay with the same lifecycle."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from policies import RouteRequest, build_policy
from policies.api import Decision
from router.config import parse_config
from router.lifecycle import Attempts, Lifecycle, LifecycleSettings, Send
from router.lifecycle.reroute import RerouteConfig
from scenarios.replay.run import execution_check
from scenarios.replay.simulated import replay_sim
from scenarios.spec.schema import Scenario, load_scenario
from telemetry.cluster.store import ViewStore
from tests.helpers import load

NOW = 1_000.0
ROOT = Path(__file__).resolve().parents[2]


def make(slow_wait_ms: float = 400.0, **reroute: object) -> Lifecycle[str]:
    """Node `slow` (2 slots, 80 ms per execution, a long queue) and an idle node `fast` (5 ms)."""
    cfg = RerouteConfig(**{"enabled": True, "margin_ms": 20.0, **reroute})  # type: ignore[arg-type]
    store = ViewStore()
    lc: Lifecycle[str] = Lifecycle(LifecycleSettings(reroute=cfg), store, lambda e: True)
    store.apply(load("slow", models={"m": 80.0}, capacity=2, queued=8, in_flight=2, wait={"0": slow_wait_ms}), NOW)
    store.apply(load("fast", models={"m": 5.0}, capacity=2), NOW)
    return lc


def sent_to(
    lc: Lifecycle[str], node: str, deadline_ms: float, priority: int = 0, policy: str = "p2c", at: float = NOW
) -> tuple[Attempts, Send]:
    """A request begun `at` and sent to `node` (as if its policy chose it), watched as the drivers do."""
    a = lc.begin(RouteRequest("m", priority=priority), build_policy(policy), at, at + deadline_ms)
    state = lc.view().get(node)
    assert state is not None
    a.attempt += 1
    a.tried.add(node)
    send = Send(Decision(node, state.endpoint, policy), state, a.attempt)
    lc.dispatched(state)
    lc.watch(a, send, at, f"handle-{a.uid}")
    return a, send


def test_an_attempt_whose_deadline_is_at_risk_moves_to_a_node_that_finishes_sooner() -> None:
    lc = make()
    a, _ = sent_to(lc, "slow", deadline_ms=300)
    moves = lc.moves(NOW + 30)
    assert len(moves) == 1
    move = moves[0]
    assert move.node_id == "slow" and move.target == "fast" and move.reason == "late"
    assert move.here_ms > 300 - 30 and move.there_ms < 50
    assert move.watched.handle == f"handle-{a.uid}"
    lc.taken(move, True, NOW + 31)
    assert lc.reroute.moves == 1 and lc.reroute.moved_wait_ms == pytest.approx(31.0)
    assert not lc.reroute.watched, "taken back: no longer watched"
    step = lc.decide(a, NOW + 31)
    assert isinstance(step, Send) and step.decision.node_id == "fast", "decided again, the slow node excluded"


def test_no_move_when_the_deadline_is_safe_or_reroute_is_off() -> None:
    lc = make()
    sent_to(lc, "slow", deadline_ms=5_000)
    assert lc.moves(NOW + 30) == [], "predicted to finish well within its deadline where it is"
    off = make(enabled=False)
    sent_to(off, "slow", deadline_ms=300)
    assert off.moves(NOW + 30) == [] and not off.reroute.watched


def test_no_move_when_elsewhere_is_not_better_by_the_margin() -> None:
    lc = make(slow_wait_ms=60.0, margin_ms=500.0)
    sent_to(lc, "slow", deadline_ms=150)
    assert lc.moves(NOW + 10) == []


def test_a_young_attempt_stays_and_a_request_moves_at_most_once() -> None:
    lc = make(min_queued_ms=20.0)
    a, _ = sent_to(lc, "slow", deadline_ms=300)
    assert lc.moves(NOW + 5) == [], "it may not have reached the node yet"
    (move,) = lc.moves(NOW + 25)
    assert a.moves == 1
    lc.taken(move, False, NOW + 26)  # the node had started it: it stays, and is not tried again
    assert lc.reroute.misses == 1 and lc.reroute.moves == 0
    assert lc.moves(NOW + 40) == []
    # sent again (after a move) it is not watched at all
    state = lc.view().get("fast")
    assert state is not None
    lc.watch(a, Send(move.watched.send.decision, state, 2), NOW + 41, "again")
    assert not lc.reroute.watched


def test_moves_per_node_are_bounded_per_second() -> None:
    lc = make(max_moves_per_s=2)
    for _ in range(5):
        sent_to(lc, "slow", deadline_ms=300)
    assert len(lc.moves(NOW + 30)) == 2
    assert lc.moves(NOW + 40) == [], "the node's two moves of this second are spent"
    later = NOW + 1000
    for msg in make(max_moves_per_s=2).store.view:  # the same reports, a second later
        lc.store.apply(msg.load.replace(seq=2, sent_at_ms=later), later)
    for _ in range(3):
        sent_to(lc, "slow", deadline_ms=300, at=later)
    assert len(lc.moves(later + 31)) == 2, "a second later, two more"


def test_nothing_moves_from_a_node_with_a_free_slot() -> None:
    store = ViewStore()
    lc: Lifecycle[str] = Lifecycle(LifecycleSettings(reroute=RerouteConfig(enabled=True)), store, lambda e: True)
    store.apply(load("slow", models={"m": 80.0}, capacity=4), NOW)
    store.apply(load("fast", models={"m": 5.0}, capacity=2), NOW)
    sent_to(lc, "slow", deadline_ms=90)
    assert lc.moves(NOW + 30) == [], "it started at once: a cancel would only miss"


def test_a_high_priority_arrival_displaces_queued_sheddable_work_on_a_fifo_node() -> None:
    lc = make()
    shed, _ = sent_to(lc, "slow", deadline_ms=5_000, priority=-1)
    keep, _ = sent_to(lc, "slow", deadline_ms=5_000, priority=0)
    hi, hi_send = sent_to(lc, "slow", deadline_ms=300, priority=10)
    move = lc.displace(hi, hi_send, NOW + 10)
    assert move is not None and move.reason == "displaced" and move.watched.a is shed and move.target == "fast"
    lc.taken(move, True, NOW + 11)
    assert lc.reroute.displaced == 1 and keep.moves == 0
    low, low_send = sent_to(lc, "slow", deadline_ms=300, priority=0)
    assert lc.displace(low, low_send, NOW + 12) is None, "only priorities at displace_min_priority displace"


def test_reroute_settings_are_validated() -> None:
    cfg = parse_config({"reroute": {"enabled": True, "margin_ms": 5, "max_moves_per_s": 50}})
    assert cfg.reroute.enabled and cfg.reroute.max_moves_per_s == 50
    for bad in ({"enabled": True, "margn_ms": 5}, {"max_moves_per_s": 0}, {"margin_ms": -1}, {"check_ms": 0}):
        with pytest.raises(ValidationError):
            RerouteConfig.model_validate(bad)


def test_a_run_may_set_reroute_and_nothing_else_of_the_router() -> None:
    base = load_scenario(ROOT / "scenarios" / "slow-node.yaml").model_dump(by_alias=True)
    base["policies"] = [{"name": "x", "preset": "p2c", "router": {"reroute": {"enabled": True}}}]
    assert Scenario.model_validate(base).policies[0].router == {"reroute": {"enabled": True}}
    for bad in ({"hedging": {}}, {"reroute": {"enabled": True, "nope": 1}}):
        base["policies"] = [{"name": "x", "preset": "p2c", "router": bad}]
        with pytest.raises(ValidationError):
            Scenario.model_validate(base)


def test_execution_check_counts_requests_that_ran_twice() -> None:
    ids = ["r.1-1", "r.2-1", "r.2-2", "r.3-h", "r.3-1", "r.4-2"]
    assert execution_check(ids, 3) == {"executions": 6, "duplicate_executions": 2, "wasted_executions": 3}


def test_slow_node_simulated_rerouting_raises_slo_without_losing_a_request() -> None:
    scenario = load_scenario(ROOT / "scenarios" / "slow-node.yaml")
    report = replay_sim(scenario, scenario.policies[:2])
    plain, moved = report["policies"]["p2c"], report["policies"]["p2c-reroute"]
    for p in (plain, moved):
        assert p["lost"] == 0 and p["sent"] == p["completed"] + sum(p["errors"].values())
    assert moved["reroute"]["moves"] > 100
    # nodes that refuse what they cannot finish in time (the default) already send most of the slow
    # node's work elsewhere; moving queued work keeps SLO at least as high and wastes nothing more
    assert plain["slo_attainment"] >= 0.9 and moved["slo_attainment"] >= plain["slo_attainment"] - 0.01
    assert moved["executions"]["wasted_executions"] <= plain["executions"]["wasted_executions"] + 2


def test_the_router_moves_a_queued_attempt_even_when_the_cancelled_answer_overtakes_the_delete() -> None:
    """The node answers the moved attempt 499 before its answer to the DELETE arrives: the request is
    decided again (answered by the other node), never answered 499."""
    import asyncio
    import json
    from collections.abc import Mapping

    from router.dispatch import Dispatcher, PolicyHolder
    from router.node_client import InMemoryNodeClient, NodeReply

    async def scenario() -> tuple[int, str, list[tuple[str, str]], dict[str, object]]:
        cancelled = asyncio.Event()

        async def slow(method: str, path: str, body: bytes, headers: Mapping[str, str]) -> NodeReply:
            if method == "DELETE":
                cancelled.set()
                await asyncio.sleep(0.05)  # the DELETE's own answer comes late
                return NodeReply(200, b'{"cancelled": "x"}')
            await cancelled.wait()
            return NodeReply(499, b'{"error": "cancelled by the router"}')

        async def fast(method: str, path: str, body: bytes, headers: Mapping[str, str]) -> NodeReply:
            return NodeReply(200, json.dumps({"node": "fast"}).encode(), {"x-edgeroute-node": "fast"})

        store = ViewStore()
        store.apply(load("slow", models={"m": 80.0}, capacity=2, queued=8, in_flight=2, wait={"0": 400.0}), NOW)
        store.apply(load("fast", models={"m": 5.0}, capacity=2, queued=20), NOW)
        client = InMemoryNodeClient({"http://slow": slow, "http://fast": fast})
        t = [NOW]
        settings = LifecycleSettings(reroute=RerouteConfig(enabled=True))
        policy = build_policy("least_outstanding")
        d = Dispatcher(settings, store, PolicyHolder(policy, "least_outstanding"), client, lambda: t[0])
        req = RouteRequest("m", deadline_ms=300)
        task = asyncio.create_task(d.dispatch(req, "/v2/models/m/infer", b"{}", {}, NOW + 300))
        await asyncio.sleep(0.01)
        t[0] = NOW + 30
        moves = d.lifecycle.moves(t[0])
        assert len(moves) == 1 and moves[0].node_id == "slow"
        d._start_move(moves[0])
        outcome = await asyncio.wait_for(task, 5)
        await asyncio.sleep(0.1)  # the DELETE's answer arrives after all
        return outcome.status, outcome.node, client.calls, d.lifecycle.reroute.as_json()

    status, node, calls, stats = asyncio.run(scenario())
    assert (status, node) == (200, "fast")
    assert ("http://slow", "/admin/requests/router.1-1") in calls
    assert stats["moves"] == 1 and stats["watched"] == 0
