"""ESG-style per-stage budgets from an end-to-end SLO: chains, a diamond, and bad workflows."""

from __future__ import annotations

import pytest

from policies.budgets import WorkflowError, split_budget


def test_a_chain_is_split_in_proportion_to_expected_times() -> None:
    out = split_budget(100.0, {"kws": 10.0, "intent": 30.0}, [("kws", "intent")])
    assert out["kws"] == pytest.approx((25.0, 25.0)) and out["intent"] == pytest.approx((75.0, 100.0))


def test_a_diamond_gives_the_dominators_one_share_and_the_short_branch_its_siblings_time() -> None:
    # detect -> (classify, ocr) -> merge; critical path detect + classify + merge = 5 ms; SLO 10: x2
    t = {"detect": 1.0, "classify": 3.0, "ocr": 1.0, "merge": 1.0}
    edges = [("detect", "classify"), ("detect", "ocr"), ("classify", "merge"), ("ocr", "merge")]
    out = split_budget(10.0, t, edges)
    assert out["detect"] == pytest.approx((2.0, 2.0))
    assert out["classify"] == pytest.approx((6.0, 8.0))
    assert out["ocr"] == pytest.approx((6.0, 8.0)), "the short branch may take as long as its sibling"
    assert out["merge"] == pytest.approx((2.0, 10.0))
    for path in (["detect", "classify", "merge"], ["detect", "ocr", "merge"]):
        assert sum(out[v][0] for v in path) <= 10.0 + 1e-9
        assert all(out[v][0] >= t[v] * 2 - 1e-9 for v in path), "each stage keeps its share of the slack"


def test_every_path_fits_the_slo_on_a_wider_dag() -> None:
    t = {"a": 2.0, "b": 5.0, "c": 1.0, "d": 4.0, "e": 3.0, "f": 1.0}
    edges = [("a", "b"), ("a", "c"), ("c", "d"), ("b", "e"), ("d", "e"), ("a", "f"), ("f", "e")]
    out = split_budget(50.0, t, edges)
    succ = {v: [b for a, b in edges if a == v] for v in t}

    def paths(v: str) -> list[list[str]]:
        return [[v]] if not succ[v] else [[v, *p] for w in succ[v] for p in paths(w)]

    sums = [sum(out[v][0] for v in p) for p in paths("a")]
    assert max(sums) == pytest.approx(50.0) and all(s <= 50.0 + 1e-9 for s in sums)
    assert all(b > 0 for b, _ in out.values())


@pytest.mark.parametrize(
    ("t", "edges", "needle"),
    [
        ({"a": 1.0, "b": 1.0}, [("a", "b"), ("b", "a")], "cycle"),
        ({"a": 1.0}, [("a", "x")], "not in the workflow"),
        ({"a": 0.0}, [], "more than zero"),
    ],
)
def test_bad_workflows_are_refused_with_a_reason(
    t: dict[str, float], edges: list[tuple[str, str]], needle: str
) -> None:
    with pytest.raises(WorkflowError, match=needle):
        split_budget(100.0, t, edges)
