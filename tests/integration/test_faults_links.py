"""Live link emulation and fault injection on a real stack."""

from __future__ import annotations

import time
from pathlib import Path

from scenarios.spec.schema import Scenario
from scenarios.stack.broker import EmbeddedBroker
from scenarios.stack.faults import FaultInjector
from scenarios.stack.launcher import Stack
from tests.integration.http import call, infer_body


def two_sites(broker: EmbeddedBroker, tmp: Path, faults: list[dict[str, object]] | None = None) -> Stack:
    scenario = Scenario.model_validate(
        {
            "name": "it-links",
            "topology": {
                "partitions": ["edge", "cloud"],
                "links": [{"a": "edge", "b": "cloud", "rtt_ms": 40}],
                "nodes": [
                    {"id": "e1", "partition": "edge", "models": ["sensor_mlp"]},
                    {"id": "c1", "partition": "cloud", "models": ["sensor_mlp"]},
                ],
            },
            "workload": {"sites": [{"site": "edge", "rate_rps": 1, "models": {"sensor_mlp": 1}}]},
            "router": {"stale_after_ms": 600, "connect_timeout_ms": 200},
            "faults": faults or [],
            "policies": ["round_robin"],
        }
    )
    return Stack(scenario, kafka=broker.bootstrap, log_dir=tmp, topic=f"edgeroute.telemetry.links.{time.time_ns()}")


def timed(stack: Stack, site: str) -> tuple[int, float, str]:
    t0 = time.perf_counter()
    status, _, headers = call(
        f"{stack.router_url}/v2/models/sensor_mlp/infer", infer_body(), headers={"x-edgeroute-site": site}
    )
    return status, (time.perf_counter() - t0) * 1000, headers.get("x-edgeroute-node", "")


def test_crossing_traffic_pays_the_link_and_a_cut_link_fails_over(broker: EmbeddedBroker, tmp_path: Path) -> None:
    stack = two_sites(broker, tmp_path)
    try:
        stack.start()
        runs = [timed(stack, "edge") for _ in range(8)]  # round robin: half local, half to the cloud
        local = [ms for status, ms, node in runs if node == "e1" and status == 200]
        remote = [ms for status, ms, node in runs if node == "c1" and status == 200]
        assert local and remote
        assert min(remote) >= 40.0, "a crossing request pays at least the RTT"
        # (a bound on the local ones would be a timing test on a shared host: a loaded one took 48 ms)
        assert sorted(local)[len(local) // 2] < min(remote), "the local ones do not pay it"
        stack.cut_link("edge", "cloud", True)
        statuses = {timed(stack, "edge")[2] for _ in range(6)}
        assert statuses == {"e1"}, "with the link cut, c1 fails after the connect timeout and e1 answers"
        assert call(f"{stack.router_url}/admin/links")[1][0]["cut"] is True
        health = call(f"{stack.router_url}/admin/view")[1]["health"]
        assert [(e["site"], e["node"]) for e in health["ejected_now"]] == [("edge", "c1")], (
            "five connect failures in a row eject c1 for the edge site"
        )
        stack.cut_link("edge", "cloud", False)
        seen: set[str] = set()
        deadline = time.monotonic() + 10
        while "c1" not in seen and time.monotonic() < deadline:  # back after the ejection (1 s) and slow start
            seen.add(timed(stack, "edge")[2])
            time.sleep(0.05)
        assert "c1" in seen
    finally:
        stack.stop()


def test_fault_injector_kills_and_restarts_on_schedule(broker: EmbeddedBroker, tmp_path: Path) -> None:
    stack = two_sites(
        broker,
        tmp_path,
        faults=[
            {"at_s": 0.5, "kind": "kill_node", "node": "e1", "duration_s": 2},
            {"at_s": 0.2, "kind": "slow_node", "node": "c1", "factor": 3},
        ],
    )
    try:
        stack.start()
        injector = FaultInjector(stack, list(stack.scenario.faults))
        injector.start()
        time.sleep(1.5)
        assert "e1" not in stack.nodes and "e1" in stack.dead
        deadline = time.monotonic() + 5
        while "e1" not in stack.nodes:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        injector.stop()
        assert [label for _, label in injector.events] == ["slow c1 x3", "kill e1", "restart e1"]
        assert not injector.errors
        stack.wait_ready(30)
        stack.restore()
        served: set[str] = set()
        deadline = time.monotonic() + 8
        while served != {"e1", "c1"} and time.monotonic() < deadline:  # e1 ramps up (slow start, 3 s)
            served.add(timed(stack, "cloud")[2])
            time.sleep(0.05)
        assert served == {"e1", "c1"}
    finally:
        stack.stop()
