"""A broker outage is a telemetry fault, not a serving outage: requests keep flowing, then recover."""

from __future__ import annotations

import time
from pathlib import Path

from scenarios.stack.broker import EmbeddedBroker
from scenarios.stack.launcher import Stack
from tests.integration.conftest import scenario
from tests.integration.http import call, infer_body


def fresh_nodes(stack: Stack) -> set[str]:
    status, view, _ = call(f"{stack.router_url}/admin/view")
    return {n["node_id"] for n in view["nodes"] if n["fresh"]} if status == 200 else set()


def test_requests_survive_a_broker_outage_and_telemetry_recovers(tmp_path: Path) -> None:
    broker = EmbeddedBroker(log_path=str(tmp_path / "broker.log")).start()
    stack = Stack(
        scenario(
            [
                {"id": "a", "partition": "edge-a", "models": ["sensor_mlp"]},
                {"id": "b", "partition": "edge-a", "models": ["sensor_mlp"]},
            ],
            router={"stale_after_ms": 500},
        ),
        kafka=broker.bootstrap,
        log_dir=tmp_path,
    )
    try:
        stack.start()
        url = f"{stack.router_url}/v2/models/sensor_mlp/infer"
        broker.stop()
        time.sleep(1.5)  # every node is now stale
        assert fresh_nodes(stack) == set()
        served = [call(url, infer_body())[0] for _ in range(10)]
        assert served == [200] * 10, "panic mode keeps routing on the last known state"

        broker = EmbeddedBroker(port=broker.port, log_path=str(tmp_path / "broker2.log")).start()
        deadline = time.monotonic() + 45
        while fresh_nodes(stack) != {"a", "b"}:
            assert time.monotonic() < deadline, "telemetry did not recover after the broker came back"
            time.sleep(0.25)
        assert call(url, infer_body())[0] == 200
        for proc in [stack.router, *stack.nodes.values()]:
            assert proc is not None and proc.popen.poll() is None
    finally:
        stack.stop()
        broker.stop()
