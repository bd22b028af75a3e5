from __future__ import annotations

from scenarios.report import format_table, percentile, summarize
from scenarios.workload import Arrival, Result


def r(status: int | None, ms: float, prio: int = 0, node: str = "a", deadline: float = 100.0) -> Result:
    return Result(Arrival(0.0, "s", "m", prio, deadline), status, ms, node if status == 200 else "none")


def test_percentile_nearest_rank() -> None:
    values = [float(i) for i in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 99) == 99.0
    assert percentile(values, 100) == 100.0
    assert percentile([], 50) == 0.0


def test_summary_accounts_for_every_request() -> None:
    results = [
        r(200, 10),
        r(200, 150),
        r(503, 1),
        r(504, 100, prio=5),
        r(None, 5000, prio=5),
        r(200, 20, prio=5, node="b"),
    ]
    s = summarize(results, 2.0)
    assert s["sent"] == 6 and s["completed"] == 3
    assert s["errors"] == {"503": 1, "504": 1, "lost": 1}
    assert s["lost"] == 1
    assert s["sent"] == s["completed"] + sum(s["errors"].values())
    assert s["slo_attainment"] == round(2 / 6, 4)  # 150 ms missed its 100 ms deadline
    assert s["by_node"] == {"a": 2, "b": 1}
    assert set(s["by_priority"]) == {"0", "5"}
    p5 = s["by_priority"]["5"]
    assert p5["sent"] == 3 and p5["completed"] == 1 and p5["lost"] == 1
    assert s["latency_ms"]["max"] == 150
    table = format_table({"scenario": "x", "mode": "live", "policies": {"p": s}})
    assert "p " in table and "lost" in table
