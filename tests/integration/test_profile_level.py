"""`edgeroute profile`'s load level on a real stack: pooled and per-model overhead, and the nodes' own
slot wake-up times (their samples from `/admin/stats?samples=1`)."""

from __future__ import annotations

import asyncio
from typing import Any

from scenarios.calibrate.profile import measure_level
from scenarios.stack.loadgen import fetch_payloads
from scenarios.stack.procs import http_json


def test_a_level_measures_overhead_per_model_and_the_wake_up_distribution(own_stack: Any) -> None:
    # as the profiler's nodes: every run on a slot thread, whose wake-ups the level measures
    stack = own_stack([{"id": "n1", "partition": "edge-a", "inline_max_ms": 0, "models": ["echo", "sensor_mlp"]}])
    payloads = asyncio.run(fetch_payloads(stack.router_url, {"echo", "sensor_mlp"}, 1))
    level = measure_level(stack, 60.0, {"echo": 0.5, "sensor_mlp": 0.5}, payloads, site="edge-a", seconds=2.0)
    assert level["completed"] == level["sent"] > 60
    assert set(level["overhead_ms_by_model"]) == {"echo", "sensor_mlp"}
    assert 0 < level["overhead_ms"][50] < 50 and level["overhead_ms"] == sorted(level["overhead_ms"])
    stats = http_json(f"{stack.nodes['n1'].url}/admin/stats?samples=1", headers=stack.node_headers)[1]
    samples = stats["wakeup_samples_ms"]
    assert len(samples) == min(stats["wakeups"], 4096) > 0
    q = level["wakeup_ms_q"]
    assert q is not None and len(q) == 101 and q[0] <= level["wakeup_ms"] <= q[100]
    assert (
        "wakeup_samples_ms" not in http_json(f"{stack.nodes['n1'].url}/admin/stats", headers=stack.node_headers)[1]
    ), "only when asked"
