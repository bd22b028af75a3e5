"""One request lifecycle above the attempt, whatever the door: a sheddable request that finds no node
(its only node killed) waits the outage out inside the lifecycle and is answered once the node is
back, counted as one request (`edgeroute_requests_total`), one first try in the retry budget, and its
attempts as attempts (retries), over HTTP, gRPC and MQTT alike. (The MQTT door waited it out with a
loop of its own: one request made five lifecycle begins, +5 on the request count, +4 first tries.)"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from scenarios.stack.broker import EmbeddedBroker
from scenarios.stack.launcher import Stack
from scenarios.stack.mosquitto import Mosquitto, mosquitto_binary
from telemetry.oip import wire
from tests.integration.conftest import make_stack
from tests.integration.http import call, infer_body
from tests.integration.test_mqtt import DEVICE_SECRETS, Device, _door_open, closed_broker

DEADLINE_MS = 8000


def _requests(stack: Stack) -> float:
    text = str(call(f"{stack.router_url}/metrics")[1])
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("edgeroute_requests_total{") and 'model="sensor_mlp"' in line
    )


def _retries(stack: Stack) -> float:
    text = str(call(f"{stack.router_url}/metrics")[1])
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("edgeroute_retries_total{") and 'model="sensor_mlp"' in line
    )


def _first_tries(stack: Stack) -> int:
    view = call(f"{stack.router_url}/admin/view", headers=stack.admin_headers)[1]
    return int(view["overload"]["retry_budget"]["first_tries"])


def _http(stack: Stack) -> tuple[int, int]:
    status, _, headers = call(
        f"{stack.router_url}/v2/models/sensor_mlp/infer",
        infer_body(),
        headers={wire.PRIORITY: "-1", wire.DEADLINE_MS: str(DEADLINE_MS)},
        timeout_s=DEADLINE_MS / 1000 + 5,
    )
    return status, int(headers.get(wire.ATTEMPTS, "0"))


def _grpc(stack: Stack) -> tuple[int, int]:
    import numpy as np
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    assert stack.router is not None
    client = grpcclient.InferenceServerClient(stack.router.grpc)
    try:
        inp = grpcclient.InferInput("readings", [1, 16], "FP32")
        inp.set_data_from_numpy(np.zeros((1, 16), np.float32))
        # (Triton's client reserves `priority` as unsigned: the hint rides as metadata, the deadline as
        # the call's own)
        client.infer("sensor_mlp", [inp], headers={wire.PRIORITY: "-1"}, client_timeout=DEADLINE_MS / 1000)
        return 200, -1  # (the gRPC answer carries no attempt count: the metrics tell)
    except InferenceServerException as exc:
        return (503 if str(exc.status()) == "StatusCode.UNAVAILABLE" else 500), -1
    finally:
        client.close()


@pytest.fixture
def outage_broker(tmp_path: Path) -> Iterator[Mosquitto | None]:
    if mosquitto_binary() is None:
        yield None
        return
    broker = closed_broker(str(tmp_path / "mosquitto.log"))
    try:
        yield broker
    finally:
        broker.stop()


@pytest.mark.parametrize("door", ["http", "grpc", "mqtt"])
def test_sheddable_work_waits_out_an_outage_as_one_request(
    broker: EmbeddedBroker, outage_broker: Mosquitto | None, tmp_path: Path, door: str
) -> None:
    if door == "mqtt" and outage_broker is None:
        pytest.skip("Mosquitto is not installed")
    router: dict[str, Any] = {"stale_after_ms": 500}
    if door == "mqtt":
        assert outage_broker is not None
        router["mqtt"] = {**outage_broker.router_config(), "topic_prefix": "shed", "group": f"outage-{os.getpid()}"}
    stack = make_stack(broker, tmp_path, [{"id": "s1", "partition": "edge-a", "models": ["sensor_mlp"]}], router=router)
    stack.start()
    device: Device | None = None
    try:
        if door == "mqtt":
            assert outage_broker is not None
            _door_open(stack)
            device = Device(outage_broker, "cam-11", token=DEVICE_SECRETS["cam-11"])
        port = stack.nodes["s1"].port
        stack.kill_node("s1")
        time.sleep(1.5)  # stale, probed and out of rotation
        before = (_requests(stack), _retries(stack), _first_tries(stack))
        got: list[tuple[int, int]] = []

        def ask() -> None:
            if door == "http":
                got.append(_http(stack))
            elif door == "grpc":
                got.append(_grpc(stack))
            else:
                assert device is not None
                device.ask(
                    "sensor_mlp",
                    infer_body(),
                    1,
                    expiry_s=30,
                    topic="shed/models/sensor_mlp/infer",
                    user=[("priority", "-1"), ("deadline_ms", str(DEADLINE_MS))],
                )
                answers = device.collect(1, within_s=DEADLINE_MS / 1000 + 5)
                got.extend((int(p["status"]), int(p.get("attempts", "0"))) for _, p, _ in answers)

        asking = threading.Thread(target=ask)
        asking.start()
        time.sleep(1.0)
        stack.start_node(stack.node_specs["s1"], port)
        asking.join(DEADLINE_MS / 1000 + 10)
        assert [status for status, _ in got] == [200], got
        time.sleep(0.3)  # (the answer is counted on the loop's next turn)
        requests, retries, first_tries = (_requests(stack), _retries(stack), _first_tries(stack))
        assert requests == before[0] + 1, f"counted {requests - before[0]:.0f} times"
        assert first_tries == before[2] + 1, f"{first_tries - before[2]} first tries"
        attempts = got[0][1]
        if attempts > 0:  # (HTTP and MQTT say how many attempts it took: all but the first are retries)
            assert retries - before[1] == attempts - 1, (attempts, retries - before[1])
    finally:
        if device is not None:
            device.close()
        stack.stop()
