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


def modes(stack: Stack) -> dict[str, str]:
    status, view, _ = call(f"{stack.router_url}/admin/view")
    return {n["node_id"]: n["mode"] for n in view["nodes"]} if status == 200 else {}


def test_telemetry_is_advice_not_a_lifeline(tmp_path: Path) -> None:
    """With the broker gone far past every age the router would once route on (panic mode off here, so
    telemetry alone would refuse everything after `stale_after_ms`), the router keeps serving on its own
    evidence: every request answered, readiness and metadata 200 throughout; a node killed meanwhile
    leaves rotation within 2 s by its failed answers and probes; and the full view comes back."""
    broker = EmbeddedBroker(log_path=str(tmp_path / "broker.log")).start()
    stack = Stack(
        scenario(
            [
                {"id": "a", "partition": "edge-a", "models": ["sensor_mlp"]},
                {"id": "b", "partition": "edge-a", "models": ["sensor_mlp"]},
            ],
            router={
                "stale_after_ms": 300,
                "policy": {"preset": "p2c", "params": {"healthy": {"panic_max_age_ms": 0}}},
                "probes": {"interval_ms": 200, "fresh_ms": 1000},
            },
        ),
        kafka=broker.bootstrap,
        log_dir=tmp_path,
    )
    try:
        stack.start()
        base = stack.router_url
        url = f"{base}/v2/models/sensor_mlp/infer"
        broker.stop()
        started = time.monotonic()
        statuses: list[int] = []
        while time.monotonic() - started < 4.0:  # four times the probes' evidence window, 13 x stale_after
            statuses.append(call(url, infer_body())[0])
            assert call(f"{base}/v2/health/ready")[0] == 200, "readiness stays while nodes answer"
            assert call(f"{base}/v2/models/sensor_mlp")[0] == 200, "metadata answers from the last view"
            time.sleep(0.05)
        assert set(statuses) == {200}, statuses
        assert modes(stack) == {"a": "own", "b": "own"}, "telemetry stale, both known by the router's evidence"

        stack.kill_node("b")  # dies during the outage
        killed = time.monotonic()
        while modes(stack).get("b") != "out":
            assert time.monotonic() - killed < 2.0, "a node dead during a broker outage must leave within 2 s"
            time.sleep(0.05)
        left_after_s = time.monotonic() - killed
        answers = [call(url, infer_body()) for _ in range(20)]
        assert [s for s, _, _ in answers] == [200] * 20
        assert {h.get("x-edgeroute-node") for _, _, h in answers} == {"a"}, "the dead node is out of rotation"

        broker = EmbeddedBroker(port=broker.port, log_path=str(tmp_path / "broker2.log")).start()
        deadline = time.monotonic() + 45
        while modes(stack).get("a") != "telemetry":
            assert time.monotonic() < deadline, "telemetry did not recover after the broker came back"
            assert call(url, infer_body())[0] == 200, "no blip while telemetry comes back"
            time.sleep(0.1)
        print(f"node left rotation {left_after_s:.2f} s after its death")
    finally:
        stack.stop()
        broker.stop()
