"""Repeats (ViewStore.apply_many's `repeats`, the simulator's idle nodes' periodic reports): a batch
with repeats leaves the view, the store's counters and every estimate of the router's overlay exactly
as the same batch made into messages does, whatever the batch holds (joins, reports out of order or
again, lags past the catch-up bound) and whatever the router has in flight, settled or refused."""

from __future__ import annotations

import random

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from router.lifecycle import Lifecycle, LifecycleSettings
from scenarios.bench.decide import node_load
from telemetry.cluster.schema import NodeLoad
from telemetry.cluster.store import Repeats, ViewStore
from telemetry.cluster.view import NodeState


def router() -> tuple[ViewStore, Lifecycle[object]]:
    store = ViewStore(stale_after_ms=1000.0)
    return store, Lifecycle(LifecycleSettings(seed=1), store, lambda _: False)


def same(a: ViewStore, b: ViewStore, la: Lifecycle[object], lb: Lifecycle[object], now: float) -> None:
    assert list(a.view.nodes) == list(b.view.nodes)  # (the same nodes, joined in the same order)
    for node_id, sa in a.view.nodes.items():
        sb = b.view.nodes[node_id]
        # (a repeat's state keeps the report it repeats as its load: its own seq and send time are its key)
        as_sent = sa.load.replace(seq=sa.report[0], sent_at_ms=sa.report[1])
        assert (as_sent, sa.heard_at_ms, sa.report) == (sb.load, sb.heard_at_ms, sb.report)
        assert (sb.load.seq, sb.load.sent_at_ms) == sb.report
        assert la.view().outstanding(sa) == lb.view().outstanding(sb)
        assert la.view().loader_busy_ms(sa, now) == lb.view().loader_busy_ms(sb, now)
    for field in ("messages", "out_of_order", "duplicates", "from_history", "from_future", "over_capacity"):
        assert getattr(a, field) == getattr(b, field), field
    assert list(a.lag_ms) == list(b.lag_ms) and a.lag_counts == b.lag_counts and a.lag_sum_s == b.lag_sum_s
    assert a.view.newest_heard_ms == b.view.newest_heard_ms


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 100_000), rounds=st.integers(1, 6))
def test_a_batch_with_repeats_is_the_batch_as_messages(seed: int, rounds: int) -> None:
    rng = random.Random(seed)
    (a, la), (b, lb) = router(), router()
    last: dict[int, NodeLoad] = {}  # each node's latest report, what its repeats say again
    now = 1_000.0
    for i in range(rng.randrange(2, 12)):
        load = node_load(i, rng).replace(seq=1, sent_at_ms=now - 5.0)
        last[i] = load
    first = list(last.values())
    a.apply_many(first, now)
    b.apply_many(first, now)
    for _ in range(rounds):
        now += rng.uniform(1.0, 1500.0)
        for lc in (la, lb):  # the same work in flight, settled and refused at both routers
            r = random.Random(now)
            for state in list(lc.store.view):
                for _ in range(r.choice((0, 0, 1, 2))):
                    lc.dispatched(lc.view().get(state.node_id) or state)
                if r.random() < 0.3 and lc.tracker.pending(state.node_id):  # (an answer: to a dispatch)
                    lc.tracker.settle(state.node_id, refused=r.random() < 0.5)
                if r.random() < 0.1:
                    lc.tracker.loading(state, "sensor_mlp", now - 10.0, r.uniform(5.0, 50.0))
        nodes = list(last)
        rng.shuffle(nodes)
        k = rng.randrange(0, len(nodes) + 1)
        repeated, messaged = nodes[:k], nodes[k:]
        msgs = []
        for i in messaged[: rng.randrange(0, len(messaged) + 1)]:
            load = node_load(i, rng).replace(seq=last[i].seq + 1, sent_at_ms=now - rng.uniform(0.0, 30.0))
            if rng.random() < 0.2:  # out of order, or the same report again
                load = load.replace(sent_at_ms=last[i].sent_at_ms - rng.choice((0.0, 1.0)), seq=last[i].seq)
            msgs.append(load)
            last[i] = max(last[i], load, key=lambda m: (m.sent_at_ms, m.seq))
        if rng.random() < 0.3:  # a node joins
            j = len(last) + 100
            msgs.append(node_load(j, rng).replace(seq=1, sent_at_ms=now - 1.0))
        templates, seqs, sent = [], [], []
        for i in repeated:
            base = last[i]
            at = now - rng.choice((0.0, 2.0, 1200.0, rng.uniform(0.0, 40.0)))
            seq = base.seq + rng.choice((0, 1, 1, 1))
            if rng.random() < 0.15:
                at = base.sent_at_ms  # the same time again (a duplicate, or a newer seq at that time)
            templates.append(NodeState.of(base, 0.0))
            seqs.append(seq)
            sent.append(at)
            if (at, seq) > (base.sent_at_ms, base.seq):
                last[i] = base.replace(seq=seq, sent_at_ms=at)
        before = np.sort(np.array([rng.randrange(0, len(msgs) + 1) for _ in repeated], dtype=np.int64))
        reps = Repeats(templates, seqs, np.array(sent, dtype=np.float64), before)
        na = a.apply_many(msgs, now, repeats=reps)
        nb = b.apply_many(reps.merged(msgs), now)
        assert na == nb
        same(a, b, la, lb, now)
        for lc in (la, lb):  # and what comes next is counted from the same place
            for state in list(lc.store.view)[:3]:
                lc.dispatched(lc.view().get(state.node_id) or state)
        same(a, b, la, lb, now)


def test_a_repeat_of_a_node_with_another_report_in_its_batch_is_refused() -> None:
    store, _ = router()
    load = node_load(1, random.Random(1)).replace(seq=1, sent_at_ms=10.0)
    store.apply_many([load], 11.0)
    reps = Repeats([NodeState.of(load, 0.0)], [2], np.array([20.0]), np.array([0]))
    try:
        store.apply_many([load.replace(seq=3, sent_at_ms=21.0)], 22.0, repeats=reps)
    except ValueError as exc:
        assert "another report in the batch" in str(exc)
    else:
        raise AssertionError("a repeat beside another report of its node was taken")


def test_a_repeat_of_a_node_the_view_lacks_joins_it_where_the_batch_has_it() -> None:
    rng = random.Random(2)
    (a, la), (b, lb) = router(), router()
    loads = [node_load(i, rng).replace(seq=1, sent_at_ms=10.0) for i in range(4)]
    reps = Repeats(
        [NodeState.of(loads[1], 0.0), NodeState.of(loads[3], 0.0)], [2, 2], np.array([12.0, 13.0]), np.array([1, 2])
    )
    msgs = [loads[0], loads[2]]
    assert a.apply_many(msgs, 20.0, repeats=reps) == b.apply_many(reps.merged(msgs), 20.0) == 4
    assert list(a.view.nodes) == ["n00000", "n00001", "n00002", "n00003"]
    same(a, b, la, lb, 20.0)
