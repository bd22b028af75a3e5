"""What keeps overload from feeding itself: the answer margin, the retry budget, refusals that keep a
node looking busy (router.lifecycle), and on the node controlled delay, refusal on arrival and
estimates that recover after a stall (nodes.scheduler). Driven by hand with an explicit clock."""

from __future__ import annotations

import random

import pytest

from nodes.estimates import RISE_ALPHA, learn_ms
from nodes.scheduler import (
    MAX_STALE_AFTER_MS,
    REFUSED_LATE,
    STALE_AFTER_MS,
    Scheduler,
    Work,
)
from policies import RouteRequest, build_policy
from router.lifecycle import Failure, Lifecycle, LifecycleSettings, Send
from router.lifecycle.budgets import (
    EVERY,
    MAX_SHARE,
    MIN_MARGIN_MS,
    WINDOW,
    AnswerMargin,
    RetryBudget,
    RetryBudgetConfig,
)
from telemetry.cluster.store import ViewStore
from telemetry.measure.quantiles import nearest_rank
from tests.helpers import load

NOW = 1_000.0


# --- the answer margin ---------------------------------------------------------------------------


def test_the_margin_is_a_high_quantile_of_what_the_node_did_not_see() -> None:
    m = AnswerMargin()
    assert m.margin_ms == MIN_MARGIN_MS, "nothing learnt yet: the least margin"
    rng = random.Random(1)
    for _ in range(1000):
        m.observe(2.0 + rng.random())  # 2-3 ms of transit
    m.observe(500.0)  # one outlier of a thousand does not move a p99
    assert 2.9 <= m.margin_ms <= 3.0
    for bad in (float("nan"), -5.0, float("inf")):
        m.observe(bad)  # clamped or dropped: never a NaN or negative margin
    assert 0 < m.margin_ms <= 1000.0


def test_the_margin_is_the_nearest_rank_p99_of_the_last_window_at_each_recompute() -> None:
    """The window is a ring read by selection: at every recompute (while it holds fewer than EVERY
    values, then after each EVERY new ones) the margin is `nearest_rank` of the last WINDOW clamped
    values, as a sorted window would give; in between it holds."""
    m = AnswerMargin()
    rng = random.Random(7)
    seen: list[float] = []
    new = recomputes = 0
    expected = MIN_MARGIN_MS
    for i in range(3 * WINDOW + 5):
        u = rng.random()
        x = -1.0 if u < 0.01 else 2000.0 if u < 0.015 else rng.expovariate(0.5)
        m.observe(x)
        seen.append(min(1000.0, max(0.0, x)))
        new += 1
        if new >= EVERY or len(seen) < EVERY:
            new = 0
            recomputes += 1
            expected = max(MIN_MARGIN_MS, nearest_rank(seen[-WINDOW:], 0.99))
        assert m.margin_ms == expected, i
    assert recomputes > 3 * WINDOW // EVERY and len({m.margin_ms, expected}) == 1


def test_the_node_is_told_the_budget_less_the_way_back_and_at_most_a_share_of_it() -> None:
    m = AnswerMargin()
    for _ in range(600):
        m.observe(20.0)
    assert m.node_budget_ms(1000.0) == pytest.approx(980.0)
    assert m.node_budget_ms(1000.0, back_ms=30.0) == pytest.approx(950.0), "the link's way back too"
    # a short budget keeps most of itself: the margin is at most MAX_SHARE of what is left
    assert m.node_budget_ms(40.0) == pytest.approx(40.0 * (1 - MAX_SHARE))


# --- the retry budget ----------------------------------------------------------------------------


def test_retries_and_hedges_are_bounded_by_a_share_of_first_tries_over_a_sliding_window() -> None:
    b = RetryBudget(RetryBudgetConfig(ratio=0.2, window_s=10, min_retries=3))
    for i in range(100):
        b.first_try(NOW + i * 10.0)  # 100 first tries in the first second
    spent = sum(b.spend(NOW + 999.0) for _ in range(50))
    assert spent == 20 and b.refused == 30, "20% of 100"
    # ten seconds on, the first second's counts have left the window: only the minimum is allowed
    later = NOW + 11_000.0
    assert sum(b.spend(later) for _ in range(10)) == 3


def test_a_quiet_router_still_retries_a_dead_node() -> None:
    b = RetryBudget(RetryBudgetConfig(ratio=0.2, window_s=10, min_retries=3))
    b.first_try(NOW)
    assert b.spend(NOW) and b.spend(NOW) and b.spend(NOW) and not b.spend(NOW)


def make(*loads, **settings) -> tuple[Lifecycle[str], ViewStore]:  # type: ignore[no-untyped-def]
    store = ViewStore()
    lc: Lifecycle[str] = Lifecycle(LifecycleSettings(**settings), store, lambda e: False)
    for msg in loads or (load("a"), load("b")):
        store.apply(msg, NOW)
    return lc, store


def test_the_lifecycle_stops_retrying_when_the_budget_is_spent() -> None:
    lc, _ = make(retry_budget=RetryBudgetConfig(ratio=0.0, window_s=10, min_retries=1))
    policy = build_policy("least_outstanding")
    a = lc.begin(RouteRequest("m"), policy, NOW, NOW + 500)
    assert isinstance(lc.decide(a, NOW), Send)
    assert lc.retry(a, Failure.SHED, 503, "too late here"), "the one retry the minimum allows"
    b = lc.begin(RouteRequest("m"), policy, NOW + 1, NOW + 500)
    assert isinstance(lc.decide(b, NOW + 1), Send)
    assert not lc.retry(b, Failure.SHED, 503, "too late here"), "budget spent: the refusal is the answer"
    assert lc.retry_budget.refused == 1


def test_a_nodes_refusals_are_retried_elsewhere() -> None:
    assert Failure.SHED.retryable
    from router.lifecycle import classify

    assert classify(429) is Failure.SHED and classify(503) is Failure.SHED


def test_a_node_that_refuses_looks_busy_and_the_penalty_halves_at_each_report() -> None:
    lc, store = make(load("a", seq=1, capacity=4), load("b", seq=1, capacity=4))
    view = lc.view()
    a = view.get("a")
    assert a is not None
    for _ in range(4):  # four attempts refused at once: a looks as busy as if they were still there
        lc.dispatched(a)
        lc.settled("a", a.partition, refused=True)
    v = lc.view()
    assert v.outstanding(v.nodes["a"]) == 4 and v.outstanding(v.nodes["b"]) == 0
    a2 = lc.begin(RouteRequest("m"), build_policy("least_outstanding"), NOW, NOW + 500)
    step = lc.decide(a2, NOW)
    assert isinstance(step, Send) and step.decision.node_id == "b"
    # its own report shows a short queue (it refuses): the penalty halves, it does not vanish
    for seq, left in ((2, 2), (3, 1), (4, 0)):
        store.apply(load("a", seq=seq, sent_at_ms=NOW + 50 * seq, capacity=4), NOW + 50 * seq)
        v = lc.view()
        assert v.outstanding(v.nodes["a"]) == left
    # an answer (not a refusal) settles as before
    lc.dispatched(v.nodes["a"])
    lc.settled("a", "edge-a")
    v = lc.view()
    assert v.outstanding(v.nodes["a"]) == 0


# --- the node: refusal on arrival, controlled delay, recovering estimates ------------------------


def exec_ms(model: str, rows: int) -> float:
    return 10.0 * rows


def floor_ms(model: str, rows: int) -> float:
    return 10.0 * rows


def test_an_arrival_that_cannot_make_it_here_is_refused_with_a_retryable_503_reason() -> None:
    s = Scheduler("priority", exec_ms)
    w = Work("w", "m", 0, 5.0, 1, 0.0)  # 10 ms of work, 5 ms left
    d = s.run_now(w, 0.0)
    assert d is not None and d.expired == [w] and not d.batch
    assert REFUSED_LATE.startswith("deadline cannot be met here")


def test_controlled_delay_refuses_sheddable_work_only_while_a_queue_stands() -> None:
    s = Scheduler("priority", exec_ms, queue_target_ms=30.0, queue_interval_ms=100.0)
    # light load: nothing waits long, nothing is refused
    s.queue_delay(0.0, 0.0)
    assert not s.standing and s.refuse_late("m", 1, 0, None, [5.0], 1, 0.0) is None
    # every delay above the target for a whole interval: the queue stands
    for i in range(6):
        for _ in range(8):
            s.push(Work(i, "m", 0, None, 1, i * 20.0))
        s.queue_delay(60.0, i * 20.0)
    assert s.standing, "first above the target at 0 ms, still above at 100 ms"
    refusal = s.refuse_late("m", 1, 0, None, [5.0], 1, 150.0)
    assert refusal is not None and refusal[0] == 429 and "standing queue" in refusal[1]
    assert s.refuse_late("m", 1, 10, None, [5.0], 1, 150.0) is None, "high priority is never shed for it"
    s.queue_delay(20.0, 210.0)
    assert s.standing, "an interval that needed a refusal keeps it standing"
    # the load falls: an interval with no refusal ends the standing state
    s.queue_delay(20.0, 320.0)
    assert not s.standing


def test_controlled_delay_ends_when_the_queue_is_found_empty() -> None:
    s = Scheduler("fifo", exec_ms, queue_target_ms=30.0)
    s.standing = True
    assert s.run_now(Work("w", "m", 0, None, 1, 0.0), 0.0) is not None
    assert not s.standing


def test_a_slowdown_registers_within_a_few_runs_and_a_speed_up_smoothly() -> None:
    est = 7.0
    runs = 0
    while est <= 60.0:  # a 10x stall: 70 ms runs
        est = learn_ms(est, 70.0, 0.2)
        runs += 1
    assert runs == 1, "a run ten times the estimate moves it most of the way at once (9.1x)"
    assert learn_ms(7.0, 14.0, 0.2) == pytest.approx(10.5), "twice the estimate: weight RISE_ALPHA"
    assert learn_ms(7.0, 28.0, 0.2) == pytest.approx(7.0 * 0.25 + 28.0 * 0.75), "4x: weight 1 - 1/4"
    assert learn_ms(0.07, 0.7, 0.2) == pytest.approx(0.637), "scale-free: a tiny model's jitter stays tiny"
    assert learn_ms(70.0, 7.0, 0.2) == pytest.approx(70.0 * 0.8 + 7.0 * 0.2)
    assert learn_ms(70.0, 7.0, 0.2, probe=True) == 7.0, "a probe replaces a stale estimate"
    assert learn_ms(None, 7.0, 0.2) == 7.0
    assert RISE_ALPHA > 0.2


def test_an_idle_node_probes_a_stale_estimate_and_backs_off_while_the_stall_lasts() -> None:
    estimate = {"m": 70.0}  # raised by a stall

    def learnt(model: str, rows: int) -> float:
        return estimate[model] * rows

    s = Scheduler("priority", learnt, admit_by_deadline=True, floor_ms=floor_ms)
    s.last_start_ms["m"] = 0.0
    # fresh estimate: refused on arrival (70 ms of work, 60 left)
    assert s.refuse_late("m", 1, 10, 60.0, [], 1, 100.0) is not None
    # stale (nothing started for STALE_AFTER_MS) and idle: judged by the best case, run as a probe
    t = STALE_AFTER_MS + 1.0
    assert s.refuse_late("m", 1, 10, 60.0, [], 1, t) is None
    d = s.run_now(Work("p", "m", 10, t + 60.0, 1, t), t, idle=True)
    assert d is not None and d.batch and d.probe
    # the probe was still slow: the next probe waits twice as long
    s.probed("m", 70.0, 70.0)
    assert not s.stale("m", t + STALE_AFTER_MS + 1.0) and s.stale("m", t + 2 * STALE_AFTER_MS + 1.0)
    for _ in range(10):
        s.probed("m", 70.0, 70.0)
    assert not s.stale("m", t + MAX_STALE_AFTER_MS - 1.0), "backed off at most MAX_STALE_AFTER_MS"
    # fast again: back to the short period
    s.probed("m", 70.0, 7.0)
    assert s.stale("m", t + STALE_AFTER_MS + 1.0)
    # busy (a slot running): no probe, the estimate decides
    assert s.refuse_late("m", 1, 10, 60.0, [5.0], 1, t + 10 * MAX_STALE_AFTER_MS) is not None


def test_a_model_that_never_ran_is_judged_by_its_warm_up_estimate() -> None:
    s = Scheduler("priority", lambda m, r: 70.0, admit_by_deadline=True, floor_ms=floor_ms)
    assert not s.stale("m", 1e9)
    assert s.refuse_late("m", 1, 0, 60.0, [], 1, 1e9) is not None


def test_the_worst_window_is_what_a_report_checks_the_budget_against() -> None:
    b = RetryBudget(RetryBudgetConfig(ratio=0.2, window_s=2, min_retries=0))
    for second, (first, extra) in enumerate([(10, 0), (10, 2), (10, 4), (0, 0)]):
        for _ in range(first):
            b.first_try(second * 1000.0)
        for _ in range(extra):
            b.spend(second * 1000.0 + 999.0)
    worst = b.worst_window(0, 3)
    # seconds 1-2 hold 20 first tries and the 4 retries the budget let through (20% of 20)
    assert worst == {"ratio": 0.2, "first_tries": 20, "retries_and_hedges": 4}
    assert b.worst_window(5, 9)["ratio"] == 0.0


# --- hostile settings and queries on what the overload work added ----------------------------------


@pytest.mark.parametrize(
    ("section", "bad"),
    [
        ({"retry_budget": {"ratio": float("nan")}}, "ratio"),
        ({"retry_budget": {"ratio": float("inf")}}, "ratio"),
        ({"retry_budget": {"ratio": -0.1}}, "ratio"),
        ({"retry_budget": {"window_s": 0}}, "window_s"),
        ({"retry_budget": {"min_retries": -1}}, "min_retries"),
        ({"retry_budget": {"burst": 3}}, "burst"),
        ({"body_timeout_s": 0}, "body_timeout_s"),
        ({"max_answer_bytes": 10}, "max_answer_bytes"),
    ],
)
def test_router_overload_settings_refuse_bad_values(section: dict[str, object], bad: str) -> None:
    from router.config import parse_config
    from telemetry.process.configfile import ConfigError

    with pytest.raises(ConfigError, match=bad):
        parse_config(section)


@pytest.mark.parametrize(
    "bad",
    [
        {"queue_target_ms": float("nan")},
        {"queue_target_ms": -1},
        {"queue_target_ms": float("inf")},
        {"queue_interval_ms": 0},
        {"body_timeout_s": -1},
    ],  # fmt: skip
)
def test_node_overload_settings_refuse_bad_values(bad: dict[str, object]) -> None:
    from pydantic import ValidationError

    from nodes.config import NodeConfig

    with pytest.raises(ValidationError):
        NodeConfig(node_id="n", models=[{"name": "echo"}], **bad)


@pytest.mark.parametrize("since", ["nan", "inf", "-inf", "1e400", "x", "-5", "99999999999999999999", ""])
def test_the_retry_windows_query_takes_any_text(since: str) -> None:
    from router.admin import overload_summary

    lc, _ = make()
    out = overload_summary(lc, since)
    assert out["retry_budget"]["ratio"] == 0.2
    worst = out.get("worst_window")
    assert worst is None or 0.0 <= worst["ratio"] <= 1000
