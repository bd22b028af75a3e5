"""Priority scheduling, early refusal and hedging on a live stack."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from scenarios.spec.schema import Scenario
from scenarios.stack.broker import EmbeddedBroker
from scenarios.stack.launcher import Stack
from tests.integration.http import call, infer_body


def stack_of(broker: EmbeddedBroker, tmp: Path, nodes: list[dict[str, object]], router: dict[str, object]) -> Stack:
    scenario = Scenario.model_validate(
        {
            "name": "it-prio",
            "topology": {"partitions": ["site"], "nodes": nodes},
            "workload": {"sites": [{"site": "site", "rate_rps": 1, "models": {"sensor_mlp": 1}}]},
            "router": router,
            "policies": ["round_robin"],
        }
    )
    return Stack(scenario, kafka=broker.bootstrap, log_dir=tmp, topic=f"edgeroute.telemetry.prio.{time.time_ns()}")


def test_hedged_loser_is_cancelled_at_its_node(broker: EmbeddedBroker, tmp_path: Path) -> None:
    stack = stack_of(
        broker,
        tmp_path,
        [
            # on the CPU: on a GPU the priority lane would run the critical request beside the blockers
            {"id": "a", "partition": "site", "speed": 0.0003, "device": "cpu", "models": ["sensor_mlp"]},
            {"id": "b", "partition": "site", "models": ["sensor_mlp"]},
        ],
        router={"hedging": {"min_priority": 10, "after_ms": 20}, "policy": {"preset": "round_robin"}},
    )
    try:
        stack.start()
        node_a = stack.nodes["a"].url
        # keep node a busy: three low-priority requests straight to it (about 230 ms each: the cancel of the
        # duplicate sent there must land before the one running ends, on a loaded host too)
        blockers = [
            threading.Thread(target=call, args=(f"{node_a}/v2/models/sensor_mlp/infer", infer_body())) for _ in range(3)
        ]
        for t in blockers:
            t.start()
        # (until node a holds all three: on a busy host the threads' requests may not have landed yet)
        until = time.monotonic() + 5.0
        while True:
            busy = call(f"{node_a}/admin/stats", headers=stack.node_headers)[1]
            if busy["queued"] + busy["in_flight"] >= 3 or time.monotonic() > until:
                break
            time.sleep(0.002)
        t0 = time.perf_counter()
        status, _, headers = call(
            f"{stack.router_url}/v2/models/sensor_mlp/infer",
            infer_body(),
            headers={"x-edgeroute-priority": "10", "x-edgeroute-deadline-ms": "2000"},
        )
        elapsed_ms = (time.perf_counter() - t0) * 1000
        assert status == 200 and headers["x-edgeroute-node"] == "b", "the duplicate on the idle node wins"
        assert elapsed_ms < 150, "the answer did not wait for node a's queue"
        for t in blockers:
            t.join(10)
        stats = call(f"{node_a}/admin/stats", headers=stack.node_headers)[1]
        assert stats["cancelled"] == 1, stats
        assert stats["served"] == 3, "the cancelled duplicate never ran on node a"
        hedging = call(f"{stack.router_url}/admin/view")[1]["hedging"]
        assert hedging == {"sent": 1, "won": 1, "cancelled": 1}
    finally:
        stack.stop()


def test_priority_node_runs_critical_first_and_sheds_low_priority_with_429(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    stack = stack_of(
        broker,
        tmp_path,
        [
            {
                "id": "a",
                "partition": "site",
                "speed": 0.001,
                "scheduler": "priority",
                "max_block_ms": 200,
                "queue_limits": {0: 2, 10: 8},
                "models": ["sensor_mlp"],
            }
        ],
        router={"policy": {"preset": "round_robin"}, "default_deadline_ms": 5000},
    )
    try:
        stack.start()
        node = stack.nodes["a"].url
        results: dict[str, tuple[int, float]] = {}

        def send(name: str, priority: int, delay: float) -> None:
            time.sleep(delay)
            t0 = time.perf_counter()
            status, doc, _ = call(
                f"{node}/v2/models/sensor_mlp/infer", infer_body(), headers={"x-edgeroute-priority": str(priority)}
            )
            results[name] = (status, time.perf_counter() - t0)
            if status != 200:
                results[name + "-reason"] = (status, 0.0)
                results[name + "-doc"] = (status, 0.0) if doc is None else (status, len(json.dumps(doc)))

        threads = [threading.Thread(target=send, args=("running", 0, 0.0))]
        threads += [threading.Thread(target=send, args=(f"bulk{i}", 0, 0.01)) for i in range(3)]
        threads += [threading.Thread(target=send, args=("critical", 10, 0.03))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert results["critical"][0] == 200
        bulk = [results[f"bulk{i}"] for i in range(3)]
        assert sorted(s for s, _ in bulk) == [200, 200, 429], "the third queued bulk request is over its limit"
        finished_bulk = [t for s, t in bulk if s == 200]
        # the critical request jumped the queued bulk work: it finished before both of them
        assert results["critical"][1] + 0.03 < min(finished_bulk) + 0.01
    finally:
        stack.stop()
