"""A policy canary on the local stack (real nodes, one far too slow for the deadline), with requests
over HTTP, gRPC and MQTT at once: a worse candidate is rolled back and a better one promoted while
traffic runs, both arms see every door (the capture records each request's door and arm), and every
request gets exactly one answer (a result or a refusal), none lost or answered twice when the arms
change."""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import orjson

from scenarios.stack.broker import EmbeddedBroker
from scenarios.stack.launcher import Stack
from scenarios.stack.mosquitto import mosquitto_binary
from telemetry.oip import wire
from tests.integration.conftest import make_stack
from tests.integration.http import call, infer_body
from tests.integration.test_mqtt import DEVICE_SECRETS, Device, _door_open, closed_broker

DEADLINE_MS = 25
GUARD = {"interval_s": 0.5, "min_requests": 60, "min_rollback": 30, "promote_after_s": 2.0, "margin": 0.02}
ANSWERED = {200, 429, 503, 504}


def _canary(candidate: str) -> dict[str, Any]:
    return {"canary": {"candidate": {"preset": candidate}, "share": 0.5, "by": "request", "guard": GUARD}}


class Doors:
    """Requests over the three doors from a thread each, until `stop`; every answer kept per door."""

    def __init__(self, stack: Stack, device: Device | None) -> None:
        self.stack = stack
        self.device = device
        self.stop = threading.Event()
        self.answers: dict[str, list[int]] = {"http": [], "grpc": [], "mqtt": []}
        self.sent = Counter[str]()
        self.errors: list[str] = []

    def _http(self) -> None:
        headers = {wire.DEADLINE_MS: str(DEADLINE_MS)}
        while not self.stop.is_set():
            self.sent["http"] += 1
            status = call(f"{self.stack.router_url}/v2/models/sensor_mlp/infer", infer_body(), headers=headers)[0]
            self.answers["http"].append(status)

    def _grpc(self) -> None:
        import numpy as np
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import InferenceServerException

        assert self.stack.router is not None
        client = grpcclient.InferenceServerClient(self.stack.router.grpc)
        codes = {
            "StatusCode.UNAVAILABLE": 503,
            "StatusCode.DEADLINE_EXCEEDED": 504,
            "StatusCode.RESOURCE_EXHAUSTED": 429,
        }
        try:
            inp = grpcclient.InferInput("readings", [1, 16], "FP32")
            inp.set_data_from_numpy(np.zeros((1, 16), np.float32))
            while not self.stop.is_set():
                self.sent["grpc"] += 1
                try:  # (the deadline rides as metadata; the client's own timeout is a backstop)
                    client.infer("sensor_mlp", [inp], headers={wire.DEADLINE_MS: str(DEADLINE_MS)}, client_timeout=5)
                    self.answers["grpc"].append(200)
                except InferenceServerException as exc:
                    self.answers["grpc"].append(codes.get(str(exc.status()), 500))
        finally:
            client.close()

    def _mqtt(self) -> None:
        assert self.device is not None
        seq = 0
        while not self.stop.is_set():
            seq += 1
            self.sent["mqtt"] += 1
            self.device.ask(
                "sensor_mlp", infer_body(), seq, expiry_s=5, topic="canary/models/sensor_mlp/infer",
                user=[("deadline_ms", str(DEADLINE_MS))],
            )  # fmt: skip
            got = self.device.collect(1, within_s=5)
            if len(got) != 1 or got[0][0] != seq:
                self.errors.append(f"mqtt request {seq}: {[(s, p.get('status')) for s, p, _ in got]}")
                continue
            self.answers["mqtt"].append(int(got[0][1]["status"]))

    def run(self) -> list[threading.Thread]:
        doors = [self._http, self._grpc] + ([self._mqtt] if self.device is not None else [])
        threads = [threading.Thread(target=d, daemon=True) for d in doors]
        for t in threads:
            t.start()
        return threads


def _wait_verdict(stack: Stack, within_s: float) -> list[dict[str, Any]]:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        state = call(f"{stack.router_url}/admin/canary", headers=stack.admin_headers)[1]
        if state["running"] is None and state["log"] and state["log"][-1]["step"] != "start":
            return list(state["log"])
        time.sleep(0.25)
    raise AssertionError("no verdict")


def test_a_canary_over_http_grpc_and_mqtt_rolls_back_then_promotes(broker: EmbeddedBroker, tmp_path: Path) -> None:
    mosquitto = closed_broker(str(tmp_path / "mosquitto.log")) if mosquitto_binary() is not None else None
    router: dict[str, Any] = {
        "max_attempts": 1,  # no retry hides a bad choice: each answer is its arm's policy's
        "policy": {"preset": "least_latency"},
        "capture": {"enabled": True},
    }
    if mosquitto is not None:
        router["mqtt"] = {**mosquitto.router_config(), "topic_prefix": "canary", "group": f"canary-{os.getpid()}"}
    nodes = [
        {"id": "fast-1", "partition": "edge-a", "models": ["sensor_mlp"]},
        {"id": "fast-2", "partition": "edge-a", "models": ["sensor_mlp"]},
        {"id": "slow-1", "partition": "edge-a", "speed": 0.001, "models": ["sensor_mlp"]},  # ~60 ms a run
    ]
    stack = make_stack(broker, tmp_path / "stack", nodes, router=router)
    device = None
    doors = None
    try:
        stack.start()
        if mosquitto is not None:
            _door_open(stack)
            device = Device(mosquitto, "cam-10", token=DEVICE_SECRETS["cam-10"])
        stack.set_policy({"preset": "least_latency"})
        time.sleep(1.0)  # (the slow node's estimate learnt before the canary starts)
        doors = Doors(stack, device)
        threads = doors.run()
        stack.set_policy(_canary("round_robin"))  # worse here: a third of its requests go to slow-1
        worse = _wait_verdict(stack, 30)
        assert worse[-1]["step"] == "rollback" and "worse" in worse[-1]["why"], worse[-1]
        assert call(f"{stack.router_url}/admin/policy", headers=stack.admin_headers)[1]["name"] == "least_latency"
        stack.set_policy({"preset": "round_robin"})
        stack.set_policy(_canary("least_latency"))  # better: promoted while the doors keep asking
        better = _wait_verdict(stack, 40)
        assert better[-1]["step"] == "promote", better[-1]
        assert call(f"{stack.router_url}/admin/policy", headers=stack.admin_headers)[1]["name"] == "least_latency"
        time.sleep(1.0)  # (requests under way when the arms changed are answered)
        doors.stop.set()
        for t in threads:
            t.join(10)
        assert not doors.errors, doors.errors[:5]
        for door, statuses in doors.answers.items():
            if door == "mqtt" and device is None:
                continue
            assert len(statuses) == doors.sent[door] and statuses, (door, len(statuses), doors.sent[door])
            assert set(statuses) <= ANSWERED, (door, Counter(statuses))
        if device is not None:  # nothing answered twice: no answer left over after the last one
            assert device.collect(1, within_s=1.0) == []
        time.sleep(0.5)  # (the capture's writer drains every 200 ms)
        _, text, _ = call(f"{stack.router_url}/admin/capture?since_ms=0", headers=stack.admin_headers)
        records = [
            orjson.loads(line) for line in (text if isinstance(text, bytes) else str(text).encode()).splitlines()
        ]
        arms = Counter((r["door"], r["arm"]) for r in records if r.get("k") == "r" and r.get("arm"))
        for door in ("http", "grpc") + (("mqtt",) if device is not None else ()):
            assert arms[(door, "control")] > 0 and arms[(door, "candidate")] > 0, arms
    finally:
        if doors is not None:
            doors.stop.set()
        if device is not None:
            device.close()
        stack.stop()
        if mosquitto is not None:
            mosquitto.stop()


def test_swapping_the_policy_by_hand_rolls_a_running_canary_back(broker: EmbeddedBroker, tmp_path: Path) -> None:
    stack = make_stack(broker, tmp_path / "stack", [{"id": "k1", "partition": "edge-a", "models": ["sensor_mlp"]}])
    try:
        stack.start()
        stack.set_policy({"preset": "p2c"})
        stack.set_policy({"canary": {"candidate": {"preset": "round_robin"}, "share": 0.2}})
        assert call(f"{stack.router_url}/admin/canary", headers=stack.admin_headers)[1]["running"] is not None
        stack.set_policy({"preset": "p2c"})  # the same policy: the canary keeps going
        assert call(f"{stack.router_url}/admin/canary", headers=stack.admin_headers)[1]["running"] is not None
        stack.set_policy({"preset": "random"})
        state = call(f"{stack.router_url}/admin/canary", headers=stack.admin_headers)[1]
        assert state["running"] is None and state["log"][-1]["step"] == "rollback", state["log"]
        assert "replaced" in state["log"][-1]["why"]
    finally:
        stack.stop()
