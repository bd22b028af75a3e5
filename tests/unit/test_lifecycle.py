"""The pure request lifecycle (router.lifecycle): its imports, its failure table and each step's rule,
driven by hand with an explicit clock, as the router and the simulator drive it."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from policies import RouteRequest, build_policy
from policies.api import HOLD_POLL_MS
from router.lifecycle import (
    NO_TELEMETRY_YET,
    Answer,
    Attempts,
    Ended,
    Failure,
    Hold,
    Lifecycle,
    LifecycleSettings,
    Next,
    Send,
    classify,
)
from router.lifecycle.health import HealthConfig
from router.lifecycle.links import LinkState
from telemetry.cluster.store import ViewStore
from telemetry.cluster.view import ClusterView
from tests.helpers import load

ROOT = Path(__file__).resolve().parents[2]
NOW = 1_000.0


def test_the_lifecycle_imports_no_io() -> None:
    for path in (ROOT / "router" / "lifecycle").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                assert top not in {"asyncio", "aiohttp", "kafka", "time", "socket", "threading"}, (path.name, name)
                if top == "router":
                    assert name.startswith("router.lifecycle"), (path.name, name)
                assert top not in {"nodes", "scenarios"}, (path.name, name)


def test_importing_the_lifecycle_loads_neither_asyncio_nor_aiohttp_nor_kafka() -> None:
    code = (
        "import sys, router.lifecycle; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('asyncio', 'aiohttp', 'kafka')); "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize(
    ("status", "kind", "retryable", "health"),
    [
        (200, Failure.OK, False, True),
        (400, Failure.CLIENT, False, True),
        (429, Failure.SHED, True, True),
        (500, Failure.NODE_ERROR, True, False),
        (502, Failure.NODE_ERROR, True, False),
        (501, Failure.CLIENT, False, True),
        (503, Failure.SHED, True, True),
        (504, Failure.DEADLINE, False, True),
    ],
)
def test_answers_are_classified_once(status: int, kind: Failure, retryable: bool, health: bool) -> None:
    assert classify(status) is kind
    assert kind.retryable is retryable and kind.health is health


def test_faults_without_an_answer() -> None:
    assert Failure.CONNECT.retryable and Failure.CONNECT.health is False
    assert Failure.CUT.retryable and Failure.CUT.health is False
    assert not Failure.TIMEOUT.retryable and Failure.TIMEOUT.health is None, "no answer says nothing of the node"


def make(*loads, **settings) -> tuple[Lifecycle[str], ViewStore]:  # type: ignore[no-untyped-def]
    store = ViewStore()
    lc: Lifecycle[str] = Lifecycle(LifecycleSettings(**settings), store, lambda e: not e.startswith("gone"))
    for msg in loads or (load("a"), load("b", queued=3)):
        store.apply(msg, NOW)
    return lc, store


def test_attempts_exclude_tried_nodes_and_stop_at_max_attempts() -> None:
    lc, _ = make(max_attempts=2)
    a = lc.begin(RouteRequest("m", request_id="r"), build_policy("least_outstanding"), NOW, NOW + 100)
    first = lc.decide(a, NOW)
    assert isinstance(first, Send) and first.decision.node_id == "a" and first.attempt == 1
    assert lc.retry(a, Failure.NODE_ERROR, 500, "boom")
    second = lc.decide(a, NOW + 1)
    assert isinstance(second, Send) and second.decision.node_id == "b", "a was tried"
    assert not lc.retry(a, Failure.SHED, 503, "full"), "two attempts allowed"
    assert lc.retries == 1 and a.last_error == (503, "full")


def test_final_failures_are_not_retried() -> None:
    lc, _ = make()
    a = lc.begin(RouteRequest("m"), build_policy("p2c"), NOW, NOW + 100)
    assert isinstance(lc.decide(a, NOW), Send)
    for kind, status in ((Failure.CLIENT, 400), (Failure.DEADLINE, 504), (Failure.TIMEOUT, 504)):
        assert not lc.retry(a, kind, status, "x")


def test_a_rejection_after_failures_answers_with_the_last_error() -> None:
    lc, _ = make(load("a"))
    a = lc.begin(RouteRequest("m"), build_policy("p2c"), NOW, NOW + 100)
    assert isinstance(lc.decide(a, NOW), Send)
    assert lc.retry(a, Failure.CONNECT, 503, "node a unavailable: refused")
    assert lc.decide(a, NOW + 1) == Answer(503, "node a unavailable: refused")


def test_the_deadline_ends_the_request_with_504_naming_the_attempts() -> None:
    lc, _ = make()
    a = lc.begin(RouteRequest("m"), build_policy("p2c"), NOW, NOW + 50)
    assert isinstance(lc.decide(a, NOW), Send)
    lc.retry(a, Failure.NODE_ERROR, 500, "boom")
    out = lc.decide(a, NOW + 50)
    assert out == Answer(504, "deadline passed after 1 attempt(s); last: boom")


def test_a_stage_budget_shrinks_with_the_job() -> None:
    seen: list[RouteRequest] = []
    lc, _ = make()
    policy = build_policy("p2c")
    choose = policy.choose
    policy.choose = lambda req, view, ctx: (seen.append(req), choose(req, view, ctx))[1]  # type: ignore[method-assign]
    req = RouteRequest("m", deadline_ms=100.0, stage_deadline_ms=40.0)
    a = lc.begin(req, policy, NOW + 15, NOW + 100)  # the job's budget began at NOW; the stage leaves at +15
    lc.decide(a, NOW + 20)
    assert seen[0].deadline_ms == pytest.approx(80.0) and seen[0].stage_deadline_ms == pytest.approx(20.0)


def test_connect_budget_is_half_the_remaining_at_most() -> None:
    lc, _ = make(connect_timeout_ms=500.0)
    a = lc.begin(RouteRequest("m"), build_policy("p2c"), NOW, NOW + 300)
    assert lc.connect_wait_ms(a, NOW) == 150.0
    assert lc.connect_wait_ms(a, NOW + 400) == 0.0
    b = lc.begin(RouteRequest("m"), build_policy("p2c"), NOW, NOW + 5_000)
    assert lc.connect_wait_ms(b, NOW) == 500.0


def test_a_cut_link_fails_the_crossing_and_counts_against_the_node_for_that_site() -> None:
    lc, _ = make(links=(LinkState("edge-a", "cloud", rtt_ms=40.0),))
    assert lc.cross("edge-a", "cloud") == (20.0, 20.0)
    assert lc.cross("edge-a", "edge-a") == (0.0, 0.0)
    lc.set_link("edge-a", "cloud", True)
    assert lc.cross("edge-a", "cloud") is None
    assert lc.view().rtt_ms("edge-a", "cloud") == 40.0, "the policies read the same table"


def test_holds_wake_on_a_settle_in_their_partition() -> None:
    spec = {"preset": "edge_first", "params": {"delay_spill": {"initial_ms": 80, "tune": False}}}
    busy = load("a1", partition="edge-a", queued=20, wait={"0": 900.0})
    lc, _ = make(busy, load("c1", partition="cloud"), links=(LinkState("edge-a", "cloud", rtt_ms=300),))
    a = lc.begin(RouteRequest("m", 0, 1000.0, "edge-a"), build_policy(spec), NOW, NOW + 1000)
    step = lc.decide(a, NOW)
    assert step == Hold("edge-a", min(80.0, HOLD_POLL_MS))
    assert lc.holds == 1 and a.attempt == 0, "holding is not an attempt"
    lc.hold("edge-a", "r1")
    lc.hold("edge-a", "gone-r2")
    lc.hold("edge-a", "r3")
    assert lc.settled("a1", "edge-a") == "r1"
    assert lc.settled("a1", "edge-a") == "r3", "entries no longer waiting are skipped"
    lc.resumed(a, NOW + 30)
    assert a.waited_ms == 30.0


def test_holds_are_bounded_per_partition() -> None:
    spec = {"preset": "edge_first", "params": {"delay_spill": {"initial_ms": 80, "tune": False}}}
    busy = load("a1", partition="edge-a", queued=20, wait={"0": 900.0})
    links = (LinkState("edge-a", "cloud", rtt_ms=300),)
    lc, _ = make(busy, load("c1", partition="cloud"), links=links, max_held=3)
    for i in range(3):
        lc.hold("edge-a", f"r{i}")
    a = lc.begin(RouteRequest("m", 0, 1000.0, "edge-a"), build_policy(spec), NOW, NOW + 1000)
    step = lc.decide(a, NOW)
    assert isinstance(step, Answer) and step.status == 503 and "wait for a slot" in step.reason
    assert lc.hold_refusals == 1 and lc.holds == 0
    assert lc.settled("a1", "edge-a") == "r0"  # one leaves: the next deferral may wait again
    assert lc.decide(a, NOW) == Hold("edge-a", min(80.0, HOLD_POLL_MS))


def test_hedge_timing_uses_the_recent_p95_per_model_and_priority() -> None:
    lc, _ = make(hedge_min_priority=10)
    low = lc.begin(RouteRequest("m", priority=0), build_policy("p2c"), NOW, NOW + 1000)
    high = lc.begin(RouteRequest("m", priority=10), build_policy("p2c"), NOW, NOW + 1000)
    assert lc.hedge_delay_ms(low, NOW) is None
    assert lc.hedge_delay_ms(high, NOW) == 10.0, "default until 20 answers are seen"
    for ms in range(1, 101):
        lc.hedges.record("m", 10, float(ms))
    assert lc.hedge_delay_ms(high, NOW) == 95.0
    assert lc.hedge_delay_ms(high, NOW + 990) == 10.0, "never past the deadline"


def test_a_hedge_goes_to_another_node_and_is_not_an_attempt() -> None:
    lc, _ = make(hedge_min_priority=0)
    a = lc.begin(RouteRequest("m"), build_policy("least_outstanding"), NOW, NOW + 1000)
    first = lc.decide(a, NOW)
    assert isinstance(first, Send)
    dup = lc.hedge(a, NOW + 10)
    assert dup is not None and dup.hedge and dup.decision.node_id != first.decision.node_id
    assert a.attempt == 1 and lc.hedges_sent == 1


def test_health_follows_the_failure_kind() -> None:
    lc, _ = make(health=HealthConfig(consecutive=2))
    a = lc.begin(RouteRequest("m", site="edge-a"), build_policy("p2c"), NOW, NOW + 1000)
    lc.answered(a, "a", Failure.SHED, NOW)
    lc.answered(a, "a", Failure.TIMEOUT, NOW)
    assert lc.health.state(NOW)["ejected_now"] == []
    lc.answered(a, "a", Failure.CONNECT, NOW)
    lc.answered(a, "a", Failure.NODE_ERROR, NOW)
    assert [e["node"] for e in lc.health.state(NOW)["ejected_now"]] == ["a"]


def test_reading_the_view_changes_nothing_and_applying_telemetry_resets_the_counts() -> None:
    lc, store = make(load("a", queued=2, seq=1))
    state = store.view.get("a")
    assert state is not None
    lc.dispatched(state)
    v = lc.view()
    assert v.outstanding(v.nodes["a"]) == 3
    store.apply(load("a", queued=1, seq=2, sent_at_ms=1_010.0), NOW + 10)  # the hook resets the counts
    v2 = lc.view()
    counts = lc.tracker.totals()
    for _ in range(3):
        assert v2.outstanding(v2.nodes["a"]) == 1, "the new report counts what was sent; read thrice, same answer"
    assert lc.tracker.totals() == counts


def test_finish_feeds_a_learning_policy_with_the_whole_wait() -> None:
    observed: list[tuple[float, float, bool]] = []
    lc, _ = make()

    class Learner:
        name = "learner"
        learns = True

        def observe(self, req: RouteRequest, latency: float, ok: bool, ctx: object) -> None:
            observed.append((req.waited_ms, latency, ok))

    a = lc.begin(RouteRequest("m"), Learner(), NOW, NOW + 100)  # type: ignore[arg-type]
    a.held_since_ms, a.waited_ms = NOW, 12.0
    lc.finish(a, 200, NOW + 40)
    lc.finish(a, 200, NOW + 140)
    assert observed == [(12.0, 40.0, True), (12.0, 140.0, False)]


def test_the_policy_sees_every_field_of_the_request() -> None:
    import dataclasses

    lc, _ = make()
    req = RouteRequest("m", 7, 100.0, "edge-a", 3, "r1", frozenset(), 0.0, 40.0, "a", 9, ("n",), 11)
    a = lc.begin(req, build_policy("p2c"), NOW, NOW + 100)
    a.tried.add("b")
    seen = a.route_request(NOW + 10)  # the remaining budget: 90 ms
    adjusted = {"deadline_ms": 90.0, "exclude": frozenset({"b"}), "stage_deadline_ms": 30.0}
    for f in dataclasses.fields(RouteRequest):
        want = adjusted.get(f.name, getattr(req, f.name))
        assert getattr(seen, f.name) == want, f.name


def test_the_simulator_runs_without_the_routers_io_code() -> None:
    code = (
        "import sys, scenarios.sim; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('asyncio', 'aiohttp', 'kafka') "
        "or (m.startswith('router.') and m.split('.')[1] not in ('lifecycle', 'config', 'admission', 'dataplane'))); "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_each_request_gets_the_routers_own_id_whatever_id_the_client_sent() -> None:
    lc, _ = make(router_id="r-a")
    a = lc.begin(RouteRequest("m", request_id="1"), build_policy("p2c"), NOW, NOW + 100)
    b = lc.begin(RouteRequest("m", request_id="1"), build_policy("p2c"), NOW, NOW + 100)
    assert a.uid != b.uid and a.uid.startswith("r-a.") and "1" != a.uid


def test_the_tracker_forgets_nodes_that_left_the_view() -> None:
    store = ViewStore(evict_after_ms=1_000)
    lc: Lifecycle[str] = Lifecycle(LifecycleSettings(), store, lambda e: False)
    for i in range(5000):  # many short-lived node ids (a churning fleet, or forged ids without signing)
        store.apply(load(f"n{i}", sent_at_ms=NOW + i), NOW + i)
    assert len(store.view) <= 2001, "evicted from the view (swept once a second)"
    assert len(lc.tracker._nodes) < 5000, "and from the tracker, once it prunes"
    busy = store.view.get("n4999")
    assert busy is not None
    lc.dispatched(busy)
    assert lc.tracker.forget_missing(ClusterView()) >= 0 and lc.tracker.pending("n4999") == 1, "in flight is kept"


def test_per_try_timeout_bounds_each_attempt_and_is_retried() -> None:
    lc, _ = make(try_timeout_ms=50.0)
    a = lc.begin(RouteRequest("m"), build_policy("p2c"), NOW, NOW + 1000)
    assert lc.try_wait_ms(a, NOW) == 50.0 and lc.try_wait_ms(a, NOW + 980) == 20.0
    unlimited, _ = make()
    b = unlimited.begin(RouteRequest("m"), build_policy("p2c"), NOW, NOW + 1000)
    assert unlimited.try_wait_ms(b, NOW) == 1000.0
    assert Failure.TRY_TIMEOUT.retryable and Failure.TRY_TIMEOUT.health is False
    assert isinstance(lc.decide(a, NOW), Send)
    assert lc.retry(a, Failure.TRY_TIMEOUT, 504, "no answer in time"), "another node gets the rest of the budget"


# --- the end of an attempt: one step for both drivers --------------------------------------------


def _sent(**settings: object) -> tuple[Lifecycle[str], Attempts, Send]:
    lc, _ = make(**settings)  # type: ignore[arg-type]
    a = lc.begin(RouteRequest("m", request_id="r"), build_policy("least_outstanding"), NOW, NOW + 100)
    send = lc.decide(a, NOW)
    assert isinstance(send, Send)
    lc.dispatched(send.state)
    return lc, a, send


def test_a_success_ends_the_request_settles_its_node_and_teaches_the_answer_margin() -> None:
    lc, a, send = _sent()
    lc.hold(send.state.partition, "held")
    assert lc.tracker.estimate(lc.store.view.get("a")) == 1  # type: ignore[arg-type]
    end = lc.ended(a, "a", send.state.partition, 200, "", NOW + 5, transit=(9.0, 4.0))
    assert end == Ended(Next.ANSWER, "held"), "the freed slot wakes the held request"
    assert lc.tracker.estimate(lc.store.view.get("a")) == 0  # type: ignore[arg-type]
    assert lc.margin.margin_ms > 0, "the round trip less the node's own time was learnt"


def test_a_refusal_counts_at_the_node_and_is_retried() -> None:
    lc, a, send = _sent()
    end = lc.ended(a, "a", send.state.partition, 503, "queue full", NOW + 1)
    assert end.next is Next.RETRY and a.last_error == (503, "queue full")
    assert lc.tracker.estimate(lc.store.view.get("a")) >= 1, "a node that refuses does not look idle"  # type: ignore[arg-type]


def test_a_retryable_failure_waits_while_its_hedge_twin_is_out() -> None:
    lc, a, send = _sent()
    end = lc.ended(a, "a", send.state.partition, 500, "boom", NOW + 1, twin_open=True)
    assert end.next is Next.WAIT and a.last_error == (500, "boom") and lc.retries == 0
    assert lc.ended(a, "b", send.state.partition, 200, "", NOW + 2).next is Next.ANSWER


def test_an_attempt_that_never_reached_its_link_is_not_settled() -> None:
    lc, a, _ = _sent()
    other = lc.begin(RouteRequest("m"), build_policy("least_outstanding"), NOW, NOW + 100)
    cut = lc.ended(other, "a", "edge-a", 503, "cut", NOW + 1, Failure.CUT, dispatched=False)
    assert cut.next is Next.RETRY
    assert lc.tracker.estimate(lc.store.view.get("a")) == 1, "only the dispatched attempt counts"  # type: ignore[arg-type]


def test_final_answers_and_exhausted_attempts_end_the_request() -> None:
    lc, a, send = _sent(max_attempts=1)
    assert lc.ended(a, "a", send.state.partition, 400, "bad", NOW + 1).next is Next.ANSWER
    lc, a, send = _sent(max_attempts=1)
    assert lc.ended(a, "a", send.state.partition, 502, "bad answer", NOW + 1).next is Next.ANSWER


def test_no_answer_in_time_is_the_per_try_timeout_only_while_the_deadline_is_away() -> None:
    lc, a, _ = _sent(try_timeout_ms=20.0)
    assert lc.timed_out(a, NOW + 20) is Failure.TRY_TIMEOUT
    assert lc.timed_out(a, NOW + 99.5) is Failure.TIMEOUT, "within 1 ms of the deadline it is the deadline's"
    lc, a, _ = _sent()
    assert lc.timed_out(a, NOW + 20) is Failure.TIMEOUT, "no per-try timeout set"


def test_unknown_models_are_404_and_503_before_anything_was_heard() -> None:
    lc, _ = make()
    assert lc.unknown_model("m") is None
    assert lc.unknown_model("nope") == Answer(404, "unknown model 'nope'")
    empty: Lifecycle[str] = Lifecycle(LifecycleSettings(), ViewStore(), lambda e: True)
    assert empty.unknown_model("m") == Answer(503, NO_TELEMETRY_YET)


def test_each_rule_of_an_attempts_end_exists_once() -> None:
    """Which hedge twin wins, the per-try timeout against the deadline, 429/503 as a refusal, learning
    the answer margin and unknown models are the lifecycle's (`ended`, `timed_out`, `unknown_model`):
    both drivers call them, and neither holds its own copy."""
    drivers = {
        "router/dispatch.py": ROOT / "router" / "dispatch.py",
        "scenarios/sim/router.py": ROOT / "scenarios" / "sim" / "router.py",
    }
    for name, path in drivers.items():
        text = path.read_text()
        for step in (".ended(", ".timed_out(", "twin_open="):
            assert step in text, f"{name} does not call the lifecycle's {step}"
        for copy in ("(429, 503)", "try_timeout_ms is not", ".retry(", ".transit(", ".retryable", "unknown model"):
            assert copy not in text, f"{name} holds its own copy of a lifecycle rule ({copy!r})"
    assert ".unknown_model(" in (ROOT / "router" / "director.py").read_text()
    assert ".unknown_model(" in drivers["scenarios/sim/router.py"].read_text()


def test_a_non_positive_deadline_hint_is_400_over_every_door() -> None:
    """The client's own deadline hint must be positive whichever door it came through; a transport's
    deadline (gRPC's, an MQTT expiry) only shortens it, and one already spent is the director's 504."""
    import pytest

    from router.lifecycle.intake import Hints, IntakeRules, Refused, take

    rules = IntakeRules()
    for hints in (Hints(deadline_ms="-5"), Hints(deadline_ms="-5", transport_ms=10_000.0), Hints(deadline_ms="0")):
        with pytest.raises(Refused) as info:
            take(hints, None, rules)
        assert info.value.status == 400 and "must be positive" in info.value.reason
    assert take(Hints(deadline_ms="50", transport_ms=20.0), None, rules).deadline_ms == 20.0
    assert take(Hints(deadline_ms="50", transport_ms=90.0), None, rules).deadline_ms == 50.0
    assert take(Hints(transport_ms=0.0), None, rules).deadline_ms == 0.0  # (spent: answered 504, not 400)
