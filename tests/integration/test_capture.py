"""Capture on a live stack: requests over HTTP and gRPC recorded as they are answered (door, site,
client, model, priority, deadline, outcome), the fleet as seen; `edgeroute capture` reads them from the
router and from the capture topic and writes a scenario folder that `edgeroute replay DIR --mode sim`
runs beside what was recorded. With the capture topic's broker gone, serving goes on (dropped and
counted)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from scenarios.cli.main import main as cli_main
from scenarios.stack.broker import EmbeddedBroker
from scenarios.stack.launcher import Stack
from telemetry.oip import wire
from tests.integration.conftest import make_stack
from tests.integration.http import call, infer_body


def _counter(stack: Stack, result: str) -> float:
    text = str(call(f"{stack.router_url}/metrics")[1])
    for line in text.splitlines():
        if line.startswith(f'edgeroute_capture_records_total{{result="{result}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_live_capture_becomes_a_scenario_the_simulator_replays(broker: EmbeddedBroker, tmp_path: Path) -> None:
    import tritonclient.grpc as grpcclient

    topic = f"edgeroute.capture.t{time.time_ns()}"
    stack = make_stack(
        broker,
        tmp_path / "stack",
        [
            {"id": "e1", "partition": "edge-a", "models": ["sensor_mlp"]},
            {"id": "c1", "partition": "cloud", "tier": "cloud", "models": ["sensor_mlp"]},
        ],
        router={
            "capture": {"enabled": True, "dir": str(tmp_path / "segments"), "kafka_topic": topic, "fleet_every_s": 1},
            "links": [{"a": "edge-a", "b": "cloud", "rtt_ms": 10}],
        },
    )
    stack.start()
    try:
        began = time.time() * 1000
        for i in range(120):
            hints = {wire.PRIORITY: str(i % 3 - 1), wire.DEADLINE_MS: "500", wire.SITE: "edge-a"}
            assert call(f"{stack.router_url}/v2/models/sensor_mlp/infer", infer_body(), headers=hints)[0] == 200
        assert stack.router is not None
        client = grpcclient.InferenceServerClient(stack.router.grpc)
        try:
            inp = grpcclient.InferInput("readings", [1, 16], "FP32")
            inp.set_data_from_numpy(np.ones((1, 16), np.float32))
            for _ in range(10):
                client.infer("sensor_mlp", [inp], headers={wire.SITE: "edge-a"})
        finally:
            client.close()
        time.sleep(1.5)  # the writer's next batches, the fleet's next record
        waited_until = time.monotonic() + 10.0  # (on a loaded host the writer's last batch comes later)
        while True:
            status, raw, _ = call(f"{stack.router_url}/admin/capture?since_ms={began:.0f}")
            assert status == 200
            lines = [json.loads(x) for x in str(raw).splitlines()] if isinstance(raw, str) else []
            records = [x for x in lines if x.get("k") == "r"]
            if len(records) >= 130 or time.monotonic() > waited_until:
                break
            time.sleep(0.5)
        assert len(records) == 130 and {x["door"] for x in records} == {"http", "grpc"}
        first = records[0]
        assert first["site"] == "edge-a" and first["model"] == "sensor_mlp" and first["prio"] == -1
        assert first["deadline_ms"] == 500 and first["status"] == 200 and first["node"] in ("e1", "c1")
        assert {x["id"] for x in lines if x.get("k") == "node"} >= {"e1", "c1"}
        assert _counter(stack, "captured") >= 130
        # the scenario folder, from the router and from the topic alike
        sources = (
            (["--router", stack.router_url], "from-router"),
            (["--kafka", stack.bootstrap, "--topic", topic], "kafka"),
        )
        for source, out in sources:
            assert cli_main(["capture", *source, "--minutes", "5", "--out", str(tmp_path / out)]) == 0
            doc: dict[str, Any] = __import__("yaml").safe_load((tmp_path / out / "scenario.yaml").read_text())
            assert {n["id"] for n in doc["topology"]["nodes"]} == {"e1", "c1"}
            assert (
                doc["workload"]["sites"][0]["arrival"] == "trace"
                and (tmp_path / out / "traces" / "edge-a.csv").is_file()
            )
        report_dir = tmp_path / "replayed"
        replay = ["replay", str(tmp_path / "from-router"), "--mode", "sim", "--policy", "p2c", "--out", str(report_dir)]
        assert cli_main(replay) == 0
        report = json.loads((report_dir / "report.json").read_text())
        assert report["recorded"]["sent"] == 130 and "vs_recorded" in report["policies"]["p2c"]
        assert list((tmp_path / "segments").glob("capture-*.jsonl.gz"))
    finally:
        stack.stop()


def test_serving_goes_on_when_the_capture_topic_cannot_be_reached(tmp_path: Path) -> None:
    kafka = EmbeddedBroker(log_path=str(tmp_path / "kafka.log")).start()
    stack = make_stack(
        kafka,
        tmp_path / "stack",
        [{"id": "k1", "partition": "edge-a", "models": ["sensor_mlp"]}],
        router={"capture": {"enabled": True, "kafka_topic": "edgeroute.capture.gone"}, "stale_after_ms": 500},
    )
    try:
        stack.start()
        kafka.stop()
        time.sleep(1.0)
        began = time.monotonic()
        for _ in range(20):
            assert call(f"{stack.router_url}/v2/models/sensor_mlp/infer", infer_body())[0] == 200
        assert time.monotonic() - began < 10
        deadline = time.monotonic() + 20
        while _counter(stack, "dropped_kafka") < 1:
            assert time.monotonic() < deadline, "nothing counted as dropped"
            time.sleep(0.5)
        while _counter(stack, "captured") < 20:  # (in memory all the same: the topic has its own thread)
            assert time.monotonic() < deadline, "the ring waited for the topic"
            time.sleep(0.2)
    finally:
        stack.stop()
        kafka.stop()
