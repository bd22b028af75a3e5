"""Policies two ways: table-driven on fixed snapshots, and seeded statistical runs over many picks."""

from __future__ import annotations

import ast
import random
from collections import Counter
from pathlib import Path

import pytest

from policies import Context, Decision, Rejection, RouteRequest, build_policy
from policies.latency import Latency
from policies.pick_max import PickMax
from policies.pipeline import Pipeline, clamp01
from policies.queue import Queue
from telemetry.cluster.view import ClusterView
from tests.helpers import load, view

NOW = 1_000.0


def ctx(seed: int = 0) -> Context:
    return Context(NOW, random.Random(seed))


def choose(
    policy: Pipeline, v: ClusterView, model: str = "m", seed: int = 0, exclude: frozenset[str] = frozenset()
) -> Decision | Rejection:
    return policy.choose(RouteRequest(model, exclude=exclude), v, ctx(seed))


# --- table-driven ---------------------------------------------------------------------------------

CASES = [
    # (preset, view, expected node or rejection status)
    ("least_outstanding", view(load("a", queued=3), load("b", queued=1), load("c", in_flight=2)), "b"),
    ("least_outstanding", view(load("a", queued=2, capacity=4), load("b", queued=1)), "a"),
    ("least_latency", view(load("a", models={"m": 10.0}), load("b", models={"m": 2.0}, queued=3)), "b"),
    ("least_latency", view(load("a", models={"m": 10.0}), load("b", models={"m": 2.0}, queued=9)), "a"),
    ("least_outstanding", view(load("a", status="draining"), load("b", queued=5)), "b"),
    ("least_outstanding", view(load("a", models={"other": 1.0}), load("b", queued=5)), "b"),
    ("round_robin", view(load("a", status="draining")), 503),
    ("p2c", view(load("a", models={"x": 1.0})), 503),
    ("p2c", view(), 503),
    ("p2c", view(load("a", queued=4), load("b")), "b"),
]


@pytest.mark.parametrize(("preset", "v", "expected"), CASES)
def test_presets_on_fixed_views(preset: str, v: ClusterView, expected: str | int) -> None:
    out = choose(build_policy(preset), v)
    if isinstance(expected, int):
        assert isinstance(out, Rejection) and out.status == expected
    else:
        assert isinstance(out, Decision) and out.node_id == expected
        assert out.endpoint == f"http://{expected}"


def test_stale_nodes_are_never_chosen() -> None:
    v = ClusterView.of([load("old")], heard_at_ms=NOW - 5_000, stale_after_ms=1_000)
    v = v.with_node(view(load("new", queued=50)).nodes["new"], NOW)
    for preset in ("round_robin", "random", "least_outstanding", "p2c", "least_latency"):
        for seed in range(20):
            out = choose(build_policy(preset), v, seed=seed)
            assert isinstance(out, Decision) and out.node_id == "new"


def test_retry_excludes_tried_nodes_and_rejection_names_the_filter() -> None:
    v = view(load("a"), load("b", queued=9))
    out = choose(build_policy("least_outstanding"), v, exclude=frozenset({"a"}))
    assert isinstance(out, Decision) and out.node_id == "b"
    out = choose(build_policy("least_outstanding"), v, exclude=frozenset({"a", "b"}))
    assert isinstance(out, Rejection) and "not_tried" in out.reason


def test_round_robin_cycles_in_id_order_per_model() -> None:
    policy = build_policy("round_robin")
    v = view(load("c", models={"m": 1, "k": 1}), load("a", models={"m": 1, "k": 1}), load("b", models={"m": 1}))
    picks = [choose(policy, v).node_id for _ in range(6)]  # type: ignore[union-attr]
    assert picks == ["a", "b", "c", "a", "b", "c"]
    k = [choose(policy, v, model="k").node_id for _ in range(3)]  # type: ignore[union-attr]
    assert k == ["a", "c", "a"]


def test_overlay_changes_the_choice_between_telemetry_messages() -> None:
    v = view(load("a"), load("b", queued=1))
    policy = build_policy("least_outstanding")
    assert choose(policy, v).node_id == "a"  # type: ignore[union-attr]
    assert choose(policy, v.with_outstanding({"a": 3})).node_id == "b"  # type: ignore[union-attr]


def test_latency_predictions_and_default() -> None:
    v = view(load("a", models={"m": 4.0}, queued=1, capacity=2), load("b", models={}))
    scores = Latency().score(RouteRequest("m"), v, list(v), ctx())
    # a: (1/2 + 1) * 4 = 6 ms; b: no model stats -> default 5 ms, idle -> 5 ms
    assert scores == pytest.approx([5 / 6, 1.0])


def test_queue_scores_in_unit_interval() -> None:
    v = view(load("a"), load("b", queued=1), load("c", queued=3, capacity=1))
    assert Queue().score(RouteRequest("m"), v, list(v), ctx()) == pytest.approx([1.0, 0.5, 0.25])


def test_engine_clamps_and_weights_scores() -> None:
    class Fixed:
        name = "fixed"
        reads: frozenset[str] = frozenset()

        def __init__(self, values: list[float]) -> None:
            self.values = values

        def score(self, req, view, nodes, ctx):  # type: ignore[no-untyped-def]
            return self.values

    v = view(load("a"), load("b"))
    # scorer 1 prefers a (clamped 7 -> 1), scorer 2 prefers b; weight 3 on scorer 2 wins
    p = Pipeline("t", [], [(Fixed([7.0, 0.0]), 1.0), (Fixed([0.0, 1.0]), 3.0)], PickMax())
    assert p.choose(RouteRequest("m"), v, ctx()).node_id == "b"  # type: ignore[union-attr]
    p = Pipeline("t", [], [(Fixed([7.0, 0.0]), 3.0), (Fixed([0.0, 1.0]), 1.0)], PickMax())
    assert p.choose(RouteRequest("m"), v, ctx()).node_id == "a"  # type: ignore[union-attr]
    assert clamp01(float("nan")) == 0.0 and clamp01(-1) == 0.0 and clamp01(2) == 1.0


def test_same_seed_same_choices() -> None:
    v = view(*[load(f"n{i}", queued=i % 3) for i in range(8)])
    for preset in ("random", "p2c"):
        a = [choose(build_policy(preset), v, seed=s).node_id for s in range(50)]  # type: ignore[union-attr]
        b = [choose(build_policy(preset), v, seed=s).node_id for s in range(50)]  # type: ignore[union-attr]
        assert a == b


# --- statistical ----------------------------------------------------------------------------------

N = 100_000


def shares(policy: Pipeline, v: ClusterView, seed: int = 1) -> dict[str, float]:
    c = ctx(seed)
    counts: Counter[str] = Counter()
    req = RouteRequest("m")
    for _ in range(N):
        out = policy.choose(req, v, c)
        assert isinstance(out, Decision)
        counts[out.node_id] += 1
    return {k: n / N for k, n in counts.items()}


def test_random_is_uniform_within_one_percent() -> None:
    s = shares(build_policy("random"), view(*[load(f"n{i}") for i in range(4)]))
    for i in range(4):
        assert s[f"n{i}"] == pytest.approx(0.25, abs=0.01)


def test_p2c_shares_match_theory_within_one_percent() -> None:
    # Loads 0 < 1 < 2 < 3 over 4 nodes: of the 6 equally likely pairs the least loaded node wins 3,
    # the next 2, then 1, and the busiest never.
    v = view(*[load(f"n{i}", queued=i) for i in range(4)])
    s = shares(build_policy("p2c"), v)
    assert s.get("n0", 0) == pytest.approx(3 / 6, abs=0.01)
    assert s.get("n1", 0) == pytest.approx(2 / 6, abs=0.01)
    assert s.get("n2", 0) == pytest.approx(1 / 6, abs=0.01)
    assert s.get("n3", 0) == 0.0


def test_p2c_ties_split_evenly() -> None:
    s = shares(build_policy("p2c"), view(*[load(f"n{i}") for i in range(3)]))
    for i in range(3):
        assert s[f"n{i}"] == pytest.approx(1 / 3, abs=0.01)


def test_weighted_random_follows_scores() -> None:
    # queue scores 1, 1/2, 1/4 -> shares 4/7, 2/7, 1/7
    policy = build_policy({"name": "wr", "scorers": [{"type": "queue"}], "picker": {"type": "weighted_random"}})
    s = shares(policy, view(load("a"), load("b", queued=1), load("c", queued=3)))
    assert s["a"] == pytest.approx(4 / 7, abs=0.01)
    assert s["b"] == pytest.approx(2 / 7, abs=0.01)
    assert s["c"] == pytest.approx(1 / 7, abs=0.01)


def test_round_robin_is_exactly_even() -> None:
    s = shares(build_policy("round_robin"), view(*[load(f"n{i}") for i in range(5)]))
    assert all(v == pytest.approx(0.2, abs=1e-9) for v in s.values())


# --- layering -------------------------------------------------------------------------------------


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_api_imports_neither_engine_nor_plugins() -> None:
    root = Path(__file__).resolve().parents[2] / "policies"
    imported = _imports(root / "api.py")
    # the one module of its own it may import: the candidate columns its columnar hooks take
    assert not {m for m in imported if m.startswith("policies") and m != "policies.columns"}, imported


def test_policies_depend_only_on_telemetry_view_types() -> None:
    root = Path(__file__).resolve().parents[2] / "policies"
    for path in root.glob("*.py"):
        for mod in _imports(path):
            top = mod.split(".")[0]
            assert top not in {"router", "nodes", "scenarios", "aiohttp", "kafka", "time"}, (path, mod)
            if top == "telemetry":
                assert mod == "telemetry.cluster.view", (path, mod)


def test_panic_mode_routes_on_last_known_state_when_no_node_is_fresh() -> None:
    # every node stale (telemetry outage): route to recently heard ready nodes rather than refuse all
    v = ClusterView.of([load("a", queued=2), load("b")], heard_at_ms=NOW - 5_000, stale_after_ms=1_000)
    v = v.with_node(ClusterView.of([load("gone")], NOW - 60_000).nodes["gone"], NOW)
    out = choose(build_policy("least_outstanding"), v)
    assert isinstance(out, Decision) and out.node_id == "b"
    for seed in range(30):
        out = choose(build_policy("random"), v, seed=seed)
        assert isinstance(out, Decision) and out.node_id != "gone", "too old for panic mode"
    off = build_policy({"preset": "random", "params": {"healthy": {"panic_max_age_ms": 0}}})
    assert isinstance(choose(off, v), Rejection)


def test_no_panic_while_any_node_is_fresh() -> None:
    stale = ClusterView.of([load("a", models={"other": 1.0})], heard_at_ms=NOW - 5_000)
    v = stale.with_node(ClusterView.of([load("b", models={"m": 1.0})], NOW - 5_000).nodes["b"], NOW)
    v = v.with_node(ClusterView.of([load("c", models={"x": 1.0})], NOW).nodes["c"], NOW)
    # c is fresh (but serves another model): b must stay excluded although it is the only server of m
    assert isinstance(choose(build_policy("p2c"), v), Rejection)


def test_fast_path_samples_uniformly_over_admitted_nodes_only() -> None:
    # 60 nodes: 20 stale, 10 without the model, 30 eligible; `random` after `sample(k=1)` exercises
    # rejection sampling, which must be uniform over the eligible 30 and never pick the others
    fresh = [load(f"ok{i}") for i in range(30)] + [load(f"other{i}", models={"x": 1.0}) for i in range(10)]
    v = ClusterView.of(fresh, heard_at_ms=NOW)
    v = v.with_nodes(ClusterView.of([load(f"stale{i}") for i in range(20)], NOW - 5_000).nodes.values(), NOW)
    policy = build_policy({"name": "one", "filters": [{"type": "sample", "k": 1}], "picker": {"type": "random"}})
    s = shares(policy, v)
    assert set(s) == {f"ok{i}" for i in range(30)}
    for share in s.values():
        assert share == pytest.approx(1 / 30, abs=0.004)


def test_fast_path_p2c_matches_theory_on_a_large_view() -> None:
    # 40 nodes with distinct loads: P(rank r chosen) = (n - 1 - r) / C(n, 2)
    n = 40
    v = view(*[load(f"n{i:02d}", queued=i) for i in range(n)])
    s = shares(build_policy("p2c"), v)
    pairs = n * (n - 1) / 2
    for r in (0, 1, 10, 20):
        assert s.get(f"n{r:02d}", 0.0) == pytest.approx((n - 1 - r) / pairs, abs=0.004)
    assert s.get(f"n{n - 1}", 0.0) == 0.0
