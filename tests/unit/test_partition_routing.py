"""Partition-aware routing on fixed views: locality, delay-and-spill decisions and the delay tuner,
outlier ejection and slow start."""

from __future__ import annotations

import random

import pytest

from policies import Context, Decision, RouteRequest, build_policy
from policies.api import Defer
from policies.delay_spill import DelaySpill, DelaySpillParams
from router.lifecycle.health import HealthConfig, OutlierDetector
from router.lifecycle.links import LinkState, LinkTable
from router.lifecycle.overlay import OutstandingTracker
from telemetry.cluster.schema import NodeLoad
from telemetry.cluster.view import ClusterView
from tests.helpers import load

NOW = 10_000.0
LINKS = LinkTable([LinkState("edge-a", "cloud", rtt_ms=40), LinkState("edge-a", "edge-b", rtt_ms=25)])


def node(node_id: str, partition: str, *, wait0: float = 0.0, exec_ms: float = 5.0, queued: int = 0) -> NodeLoad:
    return load(
        node_id,
        models={"m": exec_ms},
        queued=queued,
        partition=partition,
        sent_at_ms=NOW,
        wait={"0": wait0, "10": 0.0},
    )


def view(*loads: NodeLoad) -> ClusterView:
    return ClusterView.of(list(loads), NOW).with_links(LINKS)


def ctx(now: float = NOW) -> Context:
    return Context(now, random.Random(0))


def req(deadline: float | None = 150.0, waited: float = 0.0, site: str | None = "edge-a") -> RouteRequest:
    return RouteRequest("m", 0, deadline, site, waited_ms=waited)


def test_edge_first_stays_local_while_the_site_can_make_the_deadline() -> None:
    v = view(node("a1", "edge-a", wait0=20), node("c1", "cloud"))
    out = build_policy("edge_first").choose(req(), v, ctx())
    assert isinstance(out, Decision) and out.node_id == "a1", "25 ms locally beats 45 ms in the cloud"
    # p2c is blind to the site: over many picks it sends a share across the WAN
    picks = {build_policy("p2c").choose(req(), v, Context(NOW, random.Random(s))).node_id for s in range(20)}  # type: ignore[union-attr]
    assert "c1" in picks


def test_a_full_site_holds_the_request_then_spills_after_the_delay() -> None:
    v = view(node("a1", "edge-a", wait0=200, queued=20), node("c1", "cloud"))
    policy = build_policy({"preset": "edge_first", "params": {"delay_spill": {"initial_ms": 15, "tune": False}}})
    first = policy.choose(req(deadline=250), v, ctx())  # local: 205 ms > 250 x 0.8
    assert isinstance(first, Defer) and first.partition == "edge-a"
    assert first.wait_ms == pytest.approx(15)
    later = policy.choose(req(deadline=235, waited=15), v, ctx(NOW + 15))
    assert isinstance(later, Decision) and later.node_id == "c1", "after D the request spills to the cloud"


def test_no_hold_when_the_deadline_leaves_no_slack_over_the_round_trip() -> None:
    v = view(node("a1", "edge-a", wait0=200, queued=20), node("c1", "cloud"))
    policy = build_policy({"preset": "edge_first", "params": {"delay_spill": {"initial_ms": 15, "tune": False}}})
    # budget 60 x 0.8 = 48 ms, the cloud needs 45: hold at most the 3 ms of slack, not D
    out = policy.choose(req(deadline=60), v, ctx())
    assert isinstance(out, Defer) and out.wait_ms == pytest.approx(3)
    # budget 55 x 0.8 = 44 ms: no slack at all, spill at once
    out = policy.choose(req(deadline=55), v, ctx())
    assert isinstance(out, Decision) and out.node_id == "c1"


def test_no_local_node_up_spills_at_once_and_no_site_means_no_locality() -> None:
    policy = build_policy("edge_first")
    out = policy.choose(req(), view(node("c1", "cloud"), node("b1", "edge-b", wait0=500)), ctx())
    assert isinstance(out, Decision) and out.node_id == "c1"
    anywhere = policy.choose(req(site=None), view(node("a1", "edge-a", wait0=30), node("c1", "cloud")), ctx())
    assert isinstance(anywhere, Decision) and anywhere.node_id == "c1", "no site: no RTT, the faster node"


def test_a_held_request_that_finds_room_is_counted_and_stays_local() -> None:
    gate = DelaySpill(DelaySpillParams(initial_ms=10, tune=False))
    full = view(node("a1", "edge-a", wait0=200, queued=20), node("c1", "cloud"))
    assert isinstance(gate.gate(req(), full, list(full), ctx()), Defer)
    free = view(node("a1", "edge-a"), node("c1", "cloud"))
    kept = gate.gate(req(waited=4), free, list(free), ctx(NOW + 4))
    assert [n.node_id for n in kept] == ["a1"]  # type: ignore[union-attr]
    sites = gate.state()["sites"]["edge-a"]
    assert sites["deferred"] == 1 and sites["local_after_wait"] == 1


FULL = view(node("a1", "edge-a", wait0=100_000, queued=20), node("c1", "cloud"))  # (full for the whole test)
FREE = view(node("a1", "edge-a"), node("c1", "cloud"))


def _held(rid: str, waited: float) -> RouteRequest:
    return RouteRequest("m", 0, 150.0 - waited, "edge-a", request_id=rid, waited_ms=waited)


def _holds(gate: DelaySpill, at: float, n: int, slot_at: float, tag: str) -> float:
    """`n` requests held from `at`, each answered: a slot frees `slot_at` ms into each hold, so those
    the timer holds that long find it (local, in time, 20 ms later); the rest run out and spill (in
    time, 45 ms later)."""
    for i in range(n):
        rid = f"{tag}{i}"
        first = gate.gate(_held(rid, 0.0), FULL, list(FULL), ctx(at))
        assert isinstance(first, Defer)
        if first.wait_ms >= slot_at:
            kept = gate.gate(_held(rid, slot_at), FREE, list(FREE), ctx(at + slot_at))
            assert [n.node_id for n in kept] == ["a1"]  # type: ignore[union-attr]
            waited, trip = slot_at, 20.0
        else:
            waited, trip = first.wait_ms, 45.0
            out = gate.gate(_held(rid, waited), FULL, list(FULL), ctx(at + waited))
            assert isinstance(out, list) and {n.node_id for n in out} == {"a1", "c1"}, "ran out: spills"
        answered = RouteRequest("m", 0, 150.0, "edge-a", request_id=rid, waited_ms=waited)
        gate.observe(answered, waited + trip, True, ctx(at + waited + trip))
        at += 1.0
    return at


def test_a_delay_that_shrank_grows_back_when_the_probes_find_slots_past_it() -> None:
    """No ratchet to the floor: holds that run out at a short D say nothing of longer waits, but the
    probes (one hold in eight, allowed up to the cap) find the slots that free at 12 ms, and D follows."""
    gate = DelaySpill(DelaySpillParams(initial_ms=1, max_ms=40))
    at, seen = NOW, []
    for window in range(10):
        at = _holds(gate, at, 40, 12.0, f"w{window}-")
        at = max(at, NOW + 1001 * (window + 1))
        gate.gate(req(), FULL, list(FULL), ctx(at))  # the window closes
        seen.append(gate.sites["edge-a"].delay_ms)
    assert seen[0] > 1.0 and seen == sorted(seen), seen
    assert 12.0 <= seen[-1] <= 14.0, seen
    state = gate.state()["sites"]["edge-a"]
    assert state["probed"] == 10 * 40 // 8 and 12.0 <= state["target_ms"] <= 14.0


def test_a_wait_that_makes_held_requests_late_is_given_up() -> None:
    """Slots that free only after 30 ms come too late (the answer misses its deadline): holding for them
    adds misses and wins nothing, so D stays short of them however long it started."""
    gate = DelaySpill(DelaySpillParams(initial_ms=35, max_ms=40))
    at = NOW
    for window in range(6):
        for i in range(40):
            rid = f"w{window}-{i}"
            assert isinstance(gate.gate(_held(rid, 0.0), FULL, list(FULL), ctx(at)), Defer)
            hold = gate.sites["edge-a"].delay_ms
            if hold >= 30.0:  # found at 30 ms, answered late
                gate.gate(_held(rid, 30.0), FREE, list(FREE), ctx(at + 30))
                gate.observe(
                    RouteRequest("m", 0, 150.0, "edge-a", request_id=rid, waited_ms=30.0), 160.0, False, ctx(at + 190)
                )
            else:
                gate.gate(_held(rid, hold), FULL, list(FULL), ctx(at + hold))
                gate.observe(
                    RouteRequest("m", 0, 150.0, "edge-a", request_id=rid, waited_ms=hold),
                    hold + 45.0,
                    True,
                    ctx(at + 60),
                )
            at += 1.0
        at = max(at, NOW + 1001 * (window + 1))
        gate.gate(req(), FULL, list(FULL), ctx(at))
    assert gate.sites["edge-a"].delay_ms < 30.0, gate.state()


def test_delay_never_exceeds_the_rtt_to_the_nearest_remote_partition() -> None:
    gate = DelaySpill(DelaySpillParams(initial_ms=500, tune=False))
    full = view(node("a1", "edge-a", wait0=900, queued=50), node("b1", "edge-b"), node("c1", "cloud"))
    out = gate.gate(req(deadline=1000), full, list(full), ctx())
    assert isinstance(out, Defer) and out.wait_ms == pytest.approx(25), "capped at the 25 ms edge-b link"


# --- ejection and slow start ----------------------------------------------------------------------


def detector() -> OutlierDetector:
    return OutlierDetector(HealthConfig(consecutive=3, base_ms=1000, max_ms=4000, max_share=0.5, slow_start_ms=2000))


def test_consecutive_failures_eject_for_that_site_only_with_doubling_times() -> None:
    d = detector()
    v = view(node("a1", "edge-a"), node("c1", "cloud"), node("c2", "cloud"), node("c3", "cloud"))
    c1 = v.nodes["c1"]
    assert not d.failure("edge-b", "c1", NOW, 4) and not d.failure("edge-b", "c1", NOW, 4)
    d.success("edge-b", "c1")  # a success resets the count
    assert not d.failure("edge-b", "c1", NOW, 4) and not d.failure("edge-b", "c1", NOW, 4)
    assert d.failure("edge-b", "c1", NOW, 4)
    assert d.weight("edge-b", c1, NOW + 999) == 0.0
    assert d.weight("edge-a", c1, NOW + 10) == 1.0, "edge-a still reaches c1"
    # back after 1 s: slow start, and one failure while probing ejects again for twice as long
    assert 0.0 < d.weight("edge-b", c1, NOW + 1500) < 1.0
    assert d.failure("edge-b", "c1", NOW + 1500, 4)
    assert d.weight("edge-b", c1, NOW + 3400) == 0.0 and d.weight("edge-b", c1, NOW + 3600) > 0.0


def test_at_most_max_share_of_the_cluster_is_ejected_for_a_site() -> None:
    d = detector()
    for n in ("c1", "c2", "c3"):
        for _ in range(3):
            d.failure("edge-a", n, NOW, 4)
    assert len(d.state(NOW)["ejected_now"]) == 2, "half of four nodes"


def test_slow_start_ramps_a_restarted_node_and_ignores_nodes_seen_first() -> None:
    d = detector()
    tracker = OutstandingTracker(d)
    first = view(node("a1", "edge-a")).nodes["a1"]
    tracker.applied([first])  # first seen: no slow start (every node is new when a router starts)
    assert d.admitter(None, NOW, random.Random(0)) is None, "nothing ejected or ramping: the fast path"
    restarted = ClusterView.of(
        [load("a1", partition="edge-a", sent_at_ms=NOW + 500).replace(started_at_ms=NOW + 400)],
        NOW + 500,
    ).nodes["a1"]
    tracker.estimate(restarted)  # reading never notices anything
    assert d.weight(None, restarted, NOW + 500) == 1.0
    tracker.applied([restarted])  # applying a new report with a new start time: a new process
    assert d.weight(None, restarted, NOW + 500) == pytest.approx(0.1), "just started: the floor"
    assert d.weight(None, restarted, NOW + 1400) == pytest.approx(0.5)
    assert d.weight(None, restarted, NOW + 2400) == 1.0
    assert d.admitter(None, NOW + 2400, random.Random(0)) is None
    admit = d.admitter(None, NOW + 1400, random.Random(3))
    assert admit is not None
    share = sum(admit(restarted) for _ in range(2000)) / 2000
    assert 0.4 < share < 0.6, "admitted about half the time halfway through the ramp"


def test_ejected_nodes_are_skipped_but_never_leave_a_request_without_a_node() -> None:
    d = detector()
    tracker = OutstandingTracker(d)
    v = tracker.overlay(view(node("a1", "edge-a"), node("c1", "cloud")))
    for _ in range(3):
        d.failure("edge-a", "a1", NOW, 2)
    policy = build_policy("least_outstanding")
    out = policy.choose(req(), v, ctx())
    assert isinstance(out, Decision) and out.node_id == "c1"
    lone = OutstandingTracker(d).overlay(view(node("a1", "edge-a")))
    out = policy.choose(req(), lone, ctx())
    assert isinstance(out, Decision) and out.node_id == "a1", "panic: ejection never refuses service outright"


@pytest.mark.parametrize("preset", ["least_outstanding", "slo_priority", "compass", "p2c"])
def test_with_every_node_ejected_each_path_still_chooses_one(preset: str) -> None:
    # four nodes (the columnar presets judge them on the column table, p2c one at a time), all ejected:
    # a detector allowed to eject every node, as when each has failed
    d = OutlierDetector(HealthConfig(consecutive=3, base_ms=1000, max_ms=4000, max_share=1.0, slow_start_ms=2000))
    nodes = [node(f"a{i}", "edge-a") for i in range(4)]
    for n in nodes:
        for _ in range(3):
            d.failure("edge-a", n.node_id, NOW, len(nodes))
    v = OutstandingTracker(d).overlay(view(*nodes))
    admit = d.admitter("edge-a", NOW, random.Random(0))
    assert admit is not None and not any(admit(n) for n in v), "every node is ejected"
    out = build_policy(preset).choose(req(), v, ctx())
    assert isinstance(out, Decision) and out.node_id in {n.node_id for n in nodes}
