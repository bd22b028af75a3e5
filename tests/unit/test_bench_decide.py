"""`edgeroute bench decide` runs every preset through the router's lifecycle and writes its figures
(structure only: the figures themselves are the benchmark's, never a test's)."""

from __future__ import annotations

import json
from pathlib import Path

from policies.presets import PRESETS
from router.lifecycle import Send
from scenarios.bench.decide import bench_decide, build_lifecycle, requests


def test_every_preset_decides_on_a_realistic_view(tmp_path: Path) -> None:
    result = bench_decide(tmp_path, sizes=(10, 100), decisions=20)
    written = json.loads((tmp_path / "decide.json").read_text())
    assert written["rows"] == result["rows"]
    for n in (10, 100):
        names = {r["preset"] for r in result["rows"] if r["nodes"] == n}
        assert names == {"floor", "fixed work", *PRESETS}
    floor = {r["nodes"]: r["p50_us"] for r in result["rows"] if r["preset"] == "floor"}
    for row in result["rows"]:
        assert 0 < row["p50_us"] <= row["p99_us"]
        if row["preset"] == "fixed work":  # the host's own spread at a decision's scale, from the row's figures
            assert row["p99_over_p50"] == round(row["p99_us"] / row["p50_us"], 2)
        elif row["preset"] != "floor":
            assert row["x_floor_p50"] == round(row["p50_us"] / floor[row["nodes"]], 1)
        assert row["decisions"] == 20, "the rounds' shares add up to the decisions asked for"
    assert written["rounds"] == 5


def test_the_benchmark_view_routes_requests_to_nodes_that_serve_them() -> None:
    lc = build_lifecycle(100, seed=1)
    from policies import build_policy

    sent = 0
    for req in requests(50, seed=2):
        a = lc.begin(req, build_policy("p2c"), 1_000_000.0, 1_000_500.0)
        step = lc.decide(a, 1_000_000.0)
        if isinstance(step, Send):
            sent += 1
            assert step.state.serves(req.model)
    assert sent >= 45, "a realistic fleet serves nearly every request"
