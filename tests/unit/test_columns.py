"""The engine's columnar path chooses exactly what the per-node path chooses.

Every preset whose plugins have columnar hooks is run both ways on the same views (realistic and
odd telemetry: nodes not ready or stale, waits and EWMAs missing, loads under way, ejected and
ramping nodes, reports the overlay has not counted from, retries, workflow stages), with the same
seeded random generator: the decision, the random generator's state afterwards and the delay timers
must all be equal. The column tables patched from view to view must equal tables built afresh, and the
overlay's estimate of every node at once must equal its estimate of each.
"""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest

from policies import RouteRequest, build_policy, pipeline
from policies.api import Context, Decision, Defer, Rejection
from policies.columns import Frame
from policies.completion import best_over, predicted_wait_ms
from policies.presets import PRESETS
from router.lifecycle import Lifecycle, LifecycleSettings
from router.lifecycle.links import LinkState
from scenarios.bench.decide import MODELS, SITES, node_load
from telemetry.cluster.schema import NodeLoad
from telemetry.cluster.store import ViewStore
from telemetry.cluster.table import ModelTable
from telemetry.cluster.view import ClusterView

NOW = 1_000_000.0
COLUMNAR = tuple(p for p in PRESETS if p != "p2c")  # p2c samples two nodes instead


def odd_load(i: int, rng: random.Random) -> NodeLoad:
    """A bench node, sometimes draining, without waits, without EWMAs or load times, or loaded."""
    load = node_load(i, rng)
    changes: dict[str, object] = {"seq": rng.randrange(1, 5)}
    roll = rng.random()
    if roll < 0.1:
        changes["status"] = "draining"
    elif roll < 0.25:
        changes["expected_wait_ms"] = {}
    elif roll < 0.35:
        changes["expected_wait_ms"] = {"10": 3.0}  # none at or below priority 0: the largest counts
    models = dict(load.models)
    for name, m in list(models.items()):
        r = rng.random()
        if r < 0.15:
            models[name] = m.replace(ewma_ms_by_batch={})
        elif r < 0.25:
            models[name] = m.replace(load_ms=None, resident=False)
    changes["models"] = models
    return load.replace(**changes)


def lifecycle(nodes: int, seed: int) -> Lifecycle[object]:
    rng = random.Random(seed)
    store = ViewStore(stale_after_ms=1000.0)
    links = tuple(LinkState(s, "cloud", rtt_ms=40.0 + 2 * k, jitter_ms=4.0) for k, s in enumerate(SITES))
    lc: Lifecycle[object] = Lifecycle(LifecycleSettings(links=links, seed=seed), store, lambda _: False)
    loads = [odd_load(i, rng) for i in range(nodes)]
    store.apply_many(loads, NOW - 50.0)
    stale = rng.sample(loads, nodes // 10)  # not heard for a while
    store.apply_many([m.replace(seq=m.seq + 1, sent_at_ms=m.sent_at_ms + 1) for m in stale], NOW - 1500.0)
    view = store.view
    for state in rng.sample(list(view), nodes // 3):  # this router's work in flight, some settled
        for _ in range(rng.randrange(1, 4)):
            lc.dispatched(state)
        if rng.random() < 0.3:
            lc.settled(state.node_id, state.partition)
    for state in rng.sample(list(view), nodes // 8):  # loads this router set off
        for model in list(state.load.models)[:2]:
            lc.tracker.sent_model(state, model, NOW - rng.uniform(0, 400))
    for state in rng.sample(list(view), 3):  # ejected for a site, and a restart ramping up
        for _ in range(5):
            lc.health.failure(rng.choice(SITES), state.node_id, NOW - 100.0, len(view))
    lc.health.restarted(rng.choice(list(view)).node_id, NOW - 1000.0)
    # newer reports the overlay has not counted from yet (applied to the view, not to the tracker)
    store.on_applied = None
    newer = rng.sample(list(view), nodes // 10)
    store.apply_many([s.load.replace(seq=s.load.seq + 5, sent_at_ms=NOW - 5) for s in newer], NOW - 5)
    return lc


def requests(count: int, seed: int, view: ClusterView) -> list[RouteRequest]:
    rng = random.Random(seed)
    ids = [n.node_id for n in view]
    out = []
    for k in range(count):
        priority = rng.choice((0, 0, 0, 5, 10))
        deadline = rng.choice((None, 20.0, 60.0, 150.0, 500.0))
        stage = rng.random() < 0.2
        out.append(
            RouteRequest(
                rng.choice(MODELS),
                priority,
                deadline,
                rng.choice((*SITES, "cloud", None)),
                rng.choice((1, 1, 2, 4, 8)),
                f"r{k}",
                exclude=frozenset(rng.sample(ids, rng.choice((0, 0, 1, 3)))),
                waited_ms=rng.choice((0.0, 0.0, 3.0)),
                stage_deadline_ms=(deadline or 100.0) / 2 if stage else None,
                input_node=rng.choice(ids) if stage else None,
                input_bytes=rng.randrange(0, 1 << 20) if stage else 0,
                next_models=tuple(rng.sample(MODELS, 2)) if stage and rng.random() < 0.5 else (),
                next_bytes=rng.randrange(0, 1 << 18),
            )
        )
    return out


def outcome(choice: Decision | Rejection | Defer) -> tuple[object, ...]:
    if isinstance(choice, Decision):
        return ("send", choice.node_id, choice.endpoint, choice.policy)
    if isinstance(choice, Rejection):
        return ("reject", choice.status, choice.reason)
    return ("defer", choice.wait_ms, choice.partition, choice.reason)


@pytest.mark.parametrize("preset", COLUMNAR)
@pytest.mark.parametrize("nodes", [40, 160])
def test_columnar_and_per_node_paths_choose_alike(preset: str, nodes: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pipeline, "COLUMNS_MIN", 1)  # every request both ways, small candidate sets too
    lc = lifecycle(nodes, seed=nodes)
    view = lc.view()
    columnar, per_node = build_policy(preset), build_policy(preset)
    assert columnar.columnar, f"{preset} should have a columnar path"
    per_node.columnar = False
    rng_a, rng_b = random.Random(3), random.Random(3)
    kinds: set[str] = set()
    for k, req in enumerate(requests(300, seed=nodes, view=view)):
        now = NOW + k * 7.0  # the delay timers tune as time passes
        a = columnar.choose(req, view, Context(now, rng_a))
        b = per_node.choose(req, view, Context(now, rng_b))
        assert outcome(a) == outcome(b), (preset, req)
        assert rng_a.getstate() == rng_b.getstate(), (preset, req)
        kinds.add(outcome(a)[0])  # type: ignore[arg-type]
    assert columnar.state() == per_node.state()
    assert "send" in kinds


def test_which_presets_take_the_columnar_path() -> None:
    for name in PRESETS:
        policy = build_policy(name)
        assert policy.columnar == (name in COLUMNAR), name


def _columns(t: ModelTable) -> dict[str, object]:
    cols = {k: getattr(t, k).tolist() for k in ("capacity", "reported", "heard", "ready", "seq", "sent", "resident")}
    cols["load_ms"] = [None if x != x else x for x in t.load_ms.tolist()]
    cols["part"] = [t.parts[i] for i in t.part.tolist()]
    cols["ids"] = [n.node_id for n in t.nodes]
    for p in (0, 10):
        cols[f"wait{p}"] = [None if x != x else x for x in t.wait(p).tolist()]
    for b in (1, 3):
        cols[f"exec{b}"] = [None if x != x else x for x in t.exec(b).tolist()]
    cols["warm"] = t.resident_of("resnet_s").tolist()
    return cols


def test_tables_patched_from_view_to_view_equal_tables_built_afresh() -> None:
    rng = random.Random(5)
    store = ViewStore()
    store.apply_many([odd_load(i, rng) for i in range(120)], NOW)
    for model in MODELS:  # built, with lazily built columns, in the first view
        t = store.view.table(model)
        t.wait(0), t.wait(10), t.exec(1), t.exec(3), t.resident_of("resnet_s")
    for step in range(12):
        picked = rng.sample(list(store.view), rng.randrange(1, 8))
        updates = []
        for s in picked:
            fresh = odd_load(int(s.node_id[1:]), random.Random(step * 1000 + int(s.node_id[1:])))
            # the same model set (else the table is rebuilt, not patched), new figures
            models = {m: fresh.models.get(m, s.load.models[m]) for m in s.load.models}
            update = {"models": models, "partition": rng.choice((*SITES, "far")), "seq": s.load.seq + 1,
                      "sent_at_ms": s.load.sent_at_ms + step + 1}  # fmt: skip
            updates.append(fresh.replace(**update))
        store.apply_many(updates, NOW + step + 1)
        view = store.view
        if step % 3 == 0:
            continue  # some views are never read: the next one patches from further back
        for model in MODELS:
            assert view._table_src is not None
            assert _columns(view.table(model)) == _columns(ModelTable(model, view.serving(model))), (step, model)


def test_the_overlay_estimates_every_node_at_once_as_it_does_each() -> None:
    lc = lifecycle(200, seed=9)
    view = lc.view()
    for model in MODELS:
        table = view.table(model)
        many = view.outstanding_all(table).tolist()
        assert many == [view.outstanding(n) for n in table.nodes]
    # after the nodes it kept go away and rows are renumbered, still alike
    tracker = lc.tracker
    tracker._row = {f"gone{i}": i for i in range(5000)}
    tracker.forget_missing(lc.store.view)
    tracker.dispatch(next(iter(view)))
    for model in MODELS:
        table = view.table(model)
        assert view.outstanding_all(table).tolist() == [view.outstanding(n) for n in table.nodes]


def test_a_deep_copy_of_a_table_is_independent_of_patches() -> None:
    rng = random.Random(1)
    view = ClusterView.of([odd_load(i, rng) for i in range(30)], NOW)
    t = view.table("sensor_mlp")
    before = copy.deepcopy(_columns(t))
    s = t.nodes[0]
    t.patched([ClusterView.of([s.load.replace(in_flight=0, queued_by_priority={"0": 9})], NOW + 1).nodes[s.node_id]])
    assert _columns(t) == before, "patching makes a new table; the old one is unchanged"
    assert np.array_equal(t.reported, np.array(before["reported"]))


def test_waits_are_alike_whether_or_not_a_report_comes_from_after_the_decision() -> None:
    """The frame drops the clamp of a report's age at 0 when every row was heard by the decision's
    clock; with a report heard later (another host's clock ahead) it keeps it: same waits both ways."""
    lc = lifecycle(60, seed=4)
    view = lc.view()
    for model in MODELS:
        table = view.table(model)
        newest = float(table.heard.max())
        for now in (NOW + 10.0, newest, newest - 20.0):  # after every report, at the newest, before some
            for priority in (0, 5, 10):
                req = RouteRequest(model, priority, 100.0, SITES[0], 2, "r")
                frame = Frame(view, table, req, Context(now, random.Random(0)))
                exec_ms = frame.exec_ms(5.0).tolist()
                per_node = [predicted_wait_ms(view, n, req, e, now) for n, e in zip(table.nodes, exec_ms, strict=True)]
                assert frame.wait_ms(5.0).tolist() == per_node, (model, now, priority)
                assert table.heard_by(now) == (now >= newest)


def test_best_over_scores_within_0_and_1_and_never_nan() -> None:
    """`best_over` backs the scorers the engine does not clamp (UnitRowScorer): whatever the
    predictions (zero, negative, NaN, infinite), its scores are the per-node path's clamped scores."""
    rng = random.Random(5)
    odd = (0.0, -3.0, float("nan"), float("inf"), 1e-300, 1e300)
    for _ in range(500):
        preds = [rng.choice(odd) if rng.random() < 0.2 else rng.uniform(0.1, 300.0) for _ in range(rng.randrange(1, 9))]
        out = best_over(np.array(preds)).tolist()
        best = min(preds) if not any(p != p for p in preds) else float("nan")
        with np.errstate(all="ignore"):
            expected = [pipeline.clamp01(float(np.float64(best) / p) if p > 0 else 1.0) for p in preds]
        assert out == expected, preds
        assert all(0.0 <= s <= 1.0 for s in out), preds


def test_the_engine_clamps_only_scorers_that_may_leave_0_to_1() -> None:
    for preset, unclamped in (("slo_priority", True), ("compass", True), ("least_latency", True)):
        policy = build_policy(preset)
        ((clamped, _),) = policy._weighted
        assert (getattr(clamped, "__name__", "") == "unit_score_rows") is unclamped, preset
    ((queue, _),) = build_policy("least_outstanding")._weighted
    assert queue.__name__ == "<lambda>", "queue's scores are clamped"
