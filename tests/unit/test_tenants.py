"""Tenants: who a request is (router.lifecycle.tenants), quotas, the fair share at the node's queue
(nodes.fairshare), the router's holds and retry budget, and the replay's fairness figures."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from pydantic import ValidationError

from nodes.scheduler import PUSHED_OUT, Scheduler, Work
from router.lifecycle.budgets import RetryBudgetConfig, RetryBudgets
from router.lifecycle.holds import HoldQueue
from router.lifecycle.tenants import MAX_LABELS, OTHER, TenantsConfig, TenantTable
from scenarios.replay.tenants import fairness, jain, max_min
from scenarios.spec.workload import Arrival, Result


def table(**named: dict) -> TenantTable:
    return TenantTable(TenantsConfig.model_validate({"default": "public", "named": named}))


# --- who ------------------------------------------------------------------------------------------


def test_with_auth_the_client_decides_the_tenant_and_its_hint_is_ignored() -> None:
    t = table(acme={"clients": ["cam-1", "acme-*"]}, beta={"clients": ["beta-?"]})
    assert t.of("cam-1", None, authenticated=True) == "acme"
    assert t.of("acme-77", "beta", authenticated=True) == "acme", "a client cannot choose another tenant"
    assert t.of("beta-3", None, authenticated=True) == "beta"
    assert t.of("stranger", "acme", authenticated=True) == "public", "nor make itself one by naming it"


def test_without_auth_the_hint_counts_only_when_it_names_a_configured_tenant() -> None:
    t = table(acme={})
    assert t.of("10.0.0.1", "acme", authenticated=False) == "acme"
    assert t.of("10.0.0.1", "made-up", authenticated=False) == "public"
    assert t.of("10.0.0.1", None, authenticated=False) == "public"
    assert t.unknown_hints == 1
    assert set(t.states) == {"acme", "public"}, "names no config lists never become tenants"


def test_a_certificate_subject_names_a_configured_tenant_first() -> None:
    t = table(acme={}, beta={"clients": ["b"]})
    assert t.of("b", None, True, subject="acme") == "acme"
    assert t.of("b", None, True, subject="nobody") == "beta"


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        ({"named": {"bad name": {}}}, "not a tenant name"),
        ({"named": {"a": {"weight": 0}}}, "greater than or equal"),
        ({"named": {"a": {"clients": ["x"]}, "b": {"clients": ["x"]}}}, "is in tenants 'a' and 'b'"),
        ({"named": {"a": {"quota": {"rps": -1}}}}, "greater than 0"),
        ({"named": {"a": {"quota": {"rsp": 1}}}}, "Extra inputs"),
        ({"header": "x edgeroute"}, "not a header name"),
        ({"named": {f"t{i}": {} for i in range(1001)}}, "at most 1000"),
    ],
)
def test_a_bad_tenants_section_is_refused_with_the_field_named(raw: dict, needle: str) -> None:
    with pytest.raises(ValidationError, match=needle):
        TenantsConfig.model_validate(raw)


def test_metric_labels_stay_bounded_however_often_the_tenants_change() -> None:
    t = table()
    for i in range(MAX_LABELS + 200):
        t.configure(TenantsConfig.model_validate({"named": {f"t{i}": {}}}))
    labels = {t.label(name) for name in t.states}
    assert labels <= {OTHER, "default"} | {f"t{i}" for i in range(MAX_LABELS)}
    assert len(t._labels) <= MAX_LABELS


def test_a_live_change_keeps_a_tenants_requests_in_flight_and_buckets() -> None:
    t = table(acme={"quota": {"in_flight": 2}})
    assert t.admit("acme", 0.0) is None and t.admit("acme", 0.0) is None
    assert t.admit("acme", 0.0) is not None
    t.configure(TenantsConfig.model_validate({"named": {"acme": {"weight": 3, "quota": {"in_flight": 2}}}}))
    assert t.weight("acme") == 3 and t.states["acme"].in_flight == 2
    t.done("acme", 200, 5.0, 100.0)
    assert t.admit("acme", 1.0) is None


# --- quotas ---------------------------------------------------------------------------------------


def test_a_rate_quota_holds_within_a_few_percent_over_a_minute() -> None:
    t = table(acme={"quota": {"rps": 50}})
    admitted = 0
    rng = random.Random(1)
    now = 0.0
    while now < 60_000.0:
        now += rng.expovariate(200 / 1000.0)  # offered 4x the quota
        if t.admit("acme", now) is None:
            admitted += 1
            t.done("acme", 200, 1.0, 100.0)
    assert abs(admitted / 60.0 - 50.0) / 50.0 <= 0.05, admitted


def test_a_refusal_says_when_to_come_back() -> None:
    t = table(acme={"quota": {"rps": 0.5, "burst": 1}})
    assert t.admit("acme", 0.0) is None
    over = t.admit("acme", 10.0)
    assert over is not None and over.kind == "quota_rps" and over.retry_after_s == 2
    assert "0.5 requests/s" in over.reason


def test_the_gpu_seconds_quota_is_charged_by_each_answers_execution() -> None:
    t = table(acme={"quota": {"gpu_s_per_s": 0.1}})  # 100 ms of execution a second
    now, admitted = 0.0, 0
    while now < 10_000.0:
        if t.admit("acme", now) is None:
            admitted += 1
            t.done("acme", 200, 30.0, 100.0, exec_ms=20.0)
        now += 5.0
    # 10 s at 100 ms/s is 1 s of execution, plus the one-second bucket: ~1.1 s / 20 ms each
    assert 50 <= admitted <= 60, admitted
    assert t.states["acme"].refused["quota_gpu"] > 0


def test_an_in_flight_quota_counts_until_the_answer() -> None:
    t = table(acme={"quota": {"in_flight": 1}})
    assert t.admit("acme", 0.0) is None
    assert t.admit("acme", 0.0).kind == "quota_in_flight"  # type: ignore[union-attr]
    t.done("acme", 504, 100.0, 50.0)
    assert t.admit("acme", 1.0) is None


def test_over_share_names_the_tenant_that_floods_the_intake() -> None:
    t = table(a={}, b={"weight": 2}, c={})
    now = 0.0
    for i in range(400):
        now = i * 2.5
        t.admit("a", now)  # 400/s
        if i % 4 == 0:
            t.admit("b", now)  # 100/s with twice the weight
            t.admit("c", now)
    assert t.over_share("a", now + 300.0)
    assert not t.over_share("b", now + 300.0) and not t.over_share("c", now + 300.0)


# --- the node's queue -----------------------------------------------------------------------------


def ms(model: str, rows: int) -> float:
    return 10.0 * rows


def tw(name: str, tenant: str, at: float, weight: float = 1.0, priority: int = 0) -> Work:
    return Work(name, "m", priority, None, 1, at, tenant=tenant, weight=weight)


def test_inside_a_band_tenants_take_turns_by_weight_whoever_queued_first() -> None:
    s = Scheduler("priority", ms)
    for i in range(20):
        s.push(tw(f"noisy{i}", "noisy", 0.0))
    for i in range(5):
        s.push(tw(f"quiet{i}", "quiet", 1.0))
    order = []
    while s.queued:
        order += [w.handle for w in s.next(10.0).batch]
    first_ten = order[:10]
    assert sum(h.startswith("quiet") for h in first_ten) == 5, first_ten


def test_weights_split_the_band_in_proportion() -> None:
    s = Scheduler("fifo", ms)
    for i in range(300):
        s.push(tw(f"a{i}", "a", 0.0, weight=3.0))
        s.push(tw(f"b{i}", "b", 0.0, weight=1.0))
    served = Counter(s.next(1.0).batch[0].tenant for _ in range(200))
    assert served["a"] == pytest.approx(150, abs=2) and served["b"] == pytest.approx(50, abs=2)


def test_across_bands_priority_stays_strict_and_within_a_tenant_its_own_order_holds() -> None:
    s = Scheduler("priority", ms)
    s.push(Work("b-late", "m", 0, 900.0, 1, 0.0, tenant="b"))
    s.push(Work("b-soon", "m", 0, 100.0, 1, 0.0, tenant="b"))
    s.push(Work("a-bulk", "m", 0, 500.0, 1, 0.0, tenant="a"))
    s.push(Work("a-critical", "m", 10, 800.0, 1, 0.0, tenant="a"))
    order = [s.next(0.0).batch[0].handle for _ in range(4)]
    assert order[0] == "a-critical"
    assert order.index("b-soon") < order.index("b-late"), "earliest deadline first inside a tenant"


def test_an_idle_tenant_earns_no_credit_for_its_idleness() -> None:
    s = Scheduler("fifo", ms)
    for i in range(50):
        s.push(tw(f"a{i}", "a", 0.0))
    for _ in range(40):
        s.next(0.0)  # a alone runs 40 requests
    for i in range(10):
        s.push(tw(f"b{i}", "b", 1.0))
    order = [s.next(1.0).batch[0].tenant for _ in range(10)]
    assert order.count("b") <= 6, f"b starts at a's virtual time, not 40 runs behind it: {order}"


def test_a_quiet_tenants_wait_is_its_fair_turn_not_the_whole_backlog() -> None:
    s = Scheduler("priority", ms, queue_target_ms=50.0)
    for i in range(30):
        s.push(tw(f"n{i}", "noisy", 0.0))
    plain = s.expected_wait_ms(0, [5.0], 1)
    quiet = s.expected_wait_ms(0, [5.0], 1, "quiet", 1.0)
    noisy = s.expected_wait_ms(0, [5.0], 1, "noisy", 1.0)
    assert quiet <= 20.0 < noisy and noisy == pytest.approx(5.0 + 300.0)
    assert plain <= 20.0, "telemetry's wait is a newcomer tenant's (the one a quiet tenant sees)"


def test_controlled_delay_stands_for_the_flooding_tenant_only() -> None:
    s = Scheduler("priority", ms, queue_target_ms=30.0, queue_interval_ms=100.0)
    now = 0.0
    for step in range(30):  # noisy keeps 20 queued; quiet brings one now and then
        while s.fair is None or s.fair.tenants["noisy"] < 20:
            s.push(tw(f"n{step}", "noisy", now))
        if step % 5 == 0:
            s.push(tw(f"q{step}", "quiet", now))
        now += 10.0
        s.next(now)
    noisy = s.refuse_late("m", 1, 0, None, [5.0], 1, now, None, "noisy", 1.0)
    quiet = s.refuse_late("m", 1, 0, None, [5.0], 1, now, None, "quiet", 1.0)
    assert noisy is not None and noisy[0] == 429 and "standing" in noisy[1]
    assert quiet is None


def test_a_full_queue_pushes_out_the_tenant_over_its_share_for_one_below() -> None:
    s = Scheduler("priority", ms, max_queue=10)
    for i in range(10):
        s.push(tw(f"n{i}", "noisy", float(i)))
    assert s.refuse(0) is not None
    victim = s.make_room(0, "quiet", 1.0)
    assert victim is not None and victim.handle == "n9", "the newest of the tenant over its share"
    s.push(tw("q0", "quiet", 11.0))
    assert s.queued == 10
    for i in range(4):
        assert s.make_room(0, "quiet", 1.0) is not None
        s.push(tw(f"q{i + 1}", "quiet", 12.0))
    assert s.make_room(0, "quiet", 1.0) is None, "at its share (5 of 10) it is the one refused"
    assert s.make_room(0, "noisy", 1.0) is None
    assert "tenant" in PUSHED_OUT


def test_no_tenant_no_change_and_the_tables_stay_bounded() -> None:
    s = Scheduler("priority", ms)
    assert s.fair is None
    for i in range(5000):  # a router naming a new tenant for every request: nothing grows with it
        s.push(tw(f"w{i}", f"t{i}", float(i)))
        s.next(float(i))
    assert s.fair is not None and len(s.fair.vt) <= 4096 + 1 and len(s._queues) <= 4096 + 2


# --- the router's holds and retry budget ----------------------------------------------------------


def test_a_freed_slot_wakes_the_tenant_furthest_behind() -> None:
    q: HoldQueue[str] = HoldQueue(lambda e: True)
    for i in range(10):
        q.hold("site", f"n{i}", "noisy")
    q.hold("site", "q0", "quiet")
    q.hold("site", "q1", "quiet")
    woken = [q.wake("site") for _ in range(6)]
    assert woken.index("q0") <= 2 and woken.index("q1") <= 4, woken


def test_a_full_hold_queue_refuses_only_the_tenant_past_its_share() -> None:
    q: HoldQueue[str] = HoldQueue(lambda e: True)
    for i in range(8):
        q.hold("site", f"n{i}", "noisy")
    assert q.full("site", 8, "noisy") and not q.full("site", 8, "quiet")


def test_holds_without_tenants_stay_first_in_first_out() -> None:
    q: HoldQueue[str] = HoldQueue(lambda e: True)
    for i in range(5):
        q.hold("p", f"e{i}")
    assert [q.wake("p") for _ in range(5)] == [f"e{i}" for i in range(5)]
    assert q.full("p", 0) and not q.full("p", 6)


def test_one_tenants_refusals_cannot_spend_anothers_retries() -> None:
    budgets = RetryBudgets(RetryBudgetConfig(ratio=0.2, window_s=10, min_retries=2))
    for _ in range(1000):
        budgets.first_try("noisy", 500.0)
    for _ in range(100):
        budgets.first_try("quiet", 500.0)
    spent = sum(budgets.spend("noisy", 600.0) for _ in range(1000))
    assert spent == 200
    assert sum(budgets.spend("quiet", 600.0) for _ in range(100)) == 20, "the quiet tenant keeps its own"
    assert budgets.all.as_json()["retries_and_hedges"] == 220


# --- the replay's figures -------------------------------------------------------------------------


def test_max_min_fills_the_small_demands_and_splits_the_rest_by_weight() -> None:
    assert max_min(100.0, {"a": 10.0, "b": 500.0, "c": 500.0}, {}) == pytest.approx({"a": 10, "b": 45, "c": 45})
    fair = max_min(100.0, {"a": 500.0, "b": 500.0}, {"a": 3.0})
    assert fair == pytest.approx({"a": 75.0, "b": 25.0})
    assert jain([1.0, 1.0, 1.0]) == 1.0 and jain([1.0, 0.0]) == 0.5


def test_fairness_compares_each_tenants_goodput_with_its_fair_share() -> None:
    def result(tenant: str, ok: bool) -> Result:
        return Result(Arrival(0.0, "s", "m", 0, 100.0, 0, tenant), 200 if ok else 429, 10.0, "n")

    rows = [result("quiet", True)] * 10 + [result("noisy", i < 30) for i in range(100)]
    fair = fairness(rows, 1.0)
    assert fair["tenants"]["quiet"]["of_fair"] == 1.0 and fair["tenants"]["noisy"]["of_fair"] == 1.0
    assert fair["wants_more"] == ["noisy"] and fair["jain_over_share"] is None and fair["jain"] == 1.0


# --- the simulator: the same rules on virtual time ------------------------------------------------


def _two_floods(tenants: dict | None) -> dict:
    from scenarios.replay.simulated import replay_sim
    from scenarios.spec.schema import Scenario

    def stream(tenant: str, rate: float) -> dict:
        return {"site": "s", "tenant": tenant, "rate_rps": rate, "models": {"mobilenet_s": 1.0},
                "priorities": {0: 1.0}, "deadline_ms": {0: 250}}  # fmt: skip

    node = {"partition": "s", "slots": 1, "speed": 0.01, "models": ["mobilenet_s"]}
    doc = {
        "name": "two-floods",
        "seed": 3,
        "topology": {"partitions": ["s"], "nodes": [{"id": "b1", **node}, {"id": "b2", **node}]},
        "router": {} if tenants is None else {"tenants": tenants},
        "workload": {"duration_s": 12, "warmup_s": 2, "sites": [stream("a", 300), stream("b", 300), stream("c", 15)]},
        "policies": ["p2c"],
    }
    s = Scenario.model_validate(doc)
    return replay_sim(s, list(s.policies))["policies"]["p2c"]


def test_two_flooding_tenants_split_what_is_left_by_weight_and_a_quiet_one_keeps_its_answers() -> None:
    fair = _two_floods({"named": {"a": {"weight": 2}, "b": {"weight": 1}, "c": {}}})
    by = fair["fairness"]["tenants"]
    assert by["a"]["goodput_rps"] / by["b"]["goodput_rps"] == pytest.approx(2.0, rel=0.1), by
    assert fair["fairness"]["wants_more"] == ["a", "b"] and fair["fairness"]["jain_over_share"] >= 0.95
    assert fair["by_tenant"]["c"]["slo_attainment"] >= 0.99
    plain = _two_floods(None)
    assert plain["by_tenant"]["c"]["slo_attainment"] < 0.8, "without tenants the quiet one is refused with the rest"


def test_a_tenant_that_stopped_offering_leaves_the_other_its_whole_share() -> None:
    """One tenant after another (a's traffic ends, b's begins): a's past intake in the meter does not
    make b, the only tenant offering now, over its share."""
    t = table(a={}, b={})
    now = 0.0
    for i in range(100):  # a alone for a second, 100/s
        now = i * 10.0
        t.admit("a", now)
    for i in range(1, 400):  # then b alone
        now = 1000.0 + i * 2.5
        t.admit("b", now)
        if now >= 1000.0 + 600.0:  # (a stopped more than COMPETING_MS ago)
            assert not t.over_share("b", now + 260.0), now
    for i in range(100):  # both at once again: the one offering four times as much is over
        now = 3000.0 + i * 2.5
        t.admit("b", now)
        if i % 4 == 0:
            t.admit("a", now)
    assert t.over_share("b", now + 300.0) and not t.over_share("a", now + 300.0)
