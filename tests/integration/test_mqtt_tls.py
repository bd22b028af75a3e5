"""The MQTT door to a broker that asks for TLS and a password (Mosquitto with a TLS listener and a
password file): the router connects with the CA and its credentials and answers a device over TLS as
over HTTP; a router given the wrong CA or password never connects, says so in its metrics, and keeps
serving HTTP. Skipped where Mosquitto or openssl is not installed."""

from __future__ import annotations

import json
import queue
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from scenarios.stack.broker import EmbeddedBroker
from scenarios.stack.launcher import Stack
from scenarios.stack.mosquitto import Mosquitto, mosquitto_binary
from tests.integration.conftest import make_stack
from tests.integration.http import call
from tests.integration.test_tls import OPENSSL, make_pki

mqtt = pytest.importorskip("paho.mqtt.client")
from paho.mqtt.enums import CallbackAPIVersion  # noqa: E402
from paho.mqtt.packettypes import PacketTypes  # noqa: E402
from paho.mqtt.properties import Properties  # noqa: E402

pytestmark = pytest.mark.skipif(mosquitto_binary() is None or OPENSSL is None, reason="needs Mosquitto and openssl")
ROUTER_PASSWORD = "router-secret-7f3a"
DEVICE_PASSWORD = "camera-secret-91c2"
BODY = {"inputs": [{"name": "readings", "datatype": "FP32", "shape": [1, 16], "data": [0.5] * 16}]}


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def secured(pki: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mosquitto]:
    broker = Mosquitto(
        log_path=str(tmp_path_factory.mktemp("mosquitto") / "mosquitto.log"),
        tls=(pki["server"], pki["server_key"]),
        users={"router": ROUTER_PASSWORD, "cam-1": DEVICE_PASSWORD},
    ).start()
    try:
        yield broker
    finally:
        broker.stop()


def _stack(broker: EmbeddedBroker, folder: Path, mqtt_cfg: dict[str, Any]) -> Stack:
    stack = make_stack(broker, folder, [{"id": "n1", "partition": "edge-a", "models": ["sensor_mlp"]}],
                       router={"mqtt": mqtt_cfg})  # fmt: skip
    stack.start()
    return stack


def _connected(stack: Stack) -> str:
    text = str(call(f"{stack.router_url}/metrics")[1])
    return next((line for line in text.splitlines() if line.startswith("edgeroute_mqtt_connected ")), "")


def _ask(broker: Mosquitto, ca: str, password: str) -> tuple[dict[str, str], dict[str, Any]] | None:
    """One request from a paho device over TLS with a password; its answer (user properties, body)."""
    answers: queue.Queue[tuple[dict[str, str], bytes]] = queue.Queue()
    client = mqtt.Client(callback_api_version=CallbackAPIVersion.VERSION2, client_id="cam-1", protocol=mqtt.MQTTv5)
    client.tls_set(ca_certs=ca)
    client.username_pw_set("cam-1", password)
    subscribed = threading.Event()
    client.on_subscribe = lambda *a: subscribed.set()
    client.on_message = lambda c, u, m: answers.put((dict(m.properties.UserProperty or []), m.payload))
    client.connect(broker.host, broker.port, 30)
    client.loop_start()
    try:
        client.subscribe("devices/cam-1/answers", qos=1)
        if not subscribed.wait(5):
            return None
        props = Properties(PacketTypes.PUBLISH)
        props.ResponseTopic = "devices/cam-1/answers"
        props.CorrelationData = struct.pack(">q", 1)
        props.MessageExpiryInterval = 10
        client.publish("edgeroute/models/sensor_mlp/infer", json.dumps(BODY), qos=1, properties=props)
        user, payload = answers.get(timeout=10)
        return user, json.loads(payload)
    finally:
        client.loop_stop()
        client.disconnect()


def test_the_door_speaks_tls_with_a_password(
    broker: EmbeddedBroker, secured: Mosquitto, pki: dict[str, str], tmp_path: Path
) -> None:
    assert secured.url.startswith("mqtts://")
    cfg = {"url": secured.url, "username": "router", "password": ROUTER_PASSWORD, "tls": {"ca_file": pki["ca"]}}
    stack = _stack(broker, tmp_path, cfg)
    try:
        deadline = time.monotonic() + 30
        while _connected(stack) != "edgeroute_mqtt_connected 1.0":
            assert time.monotonic() < deadline, "the MQTT door did not connect over TLS"
            time.sleep(0.1)
        answer = _ask(secured, pki["ca"], DEVICE_PASSWORD)
        assert answer is not None
        user, body = answer
        assert user["status"] == "200"
        status, http_body, _ = call(f"{stack.router_url}/v2/models/sensor_mlp/infer", json.dumps(BODY).encode())
        assert status == 200
        assert body["outputs"] == http_body["outputs"]
        # a device with a wrong password is the broker's to refuse: it never gets to publish
        with pytest.raises(Exception):  # noqa: B017 - paho raises or never subscribes, depending on timing
            assert _ask(secured, pki["ca"], "wrong-password") is not None
    finally:
        stack.stop()


@pytest.mark.parametrize("wrong", ["ca", "password"])
def test_a_door_that_cannot_connect_harms_nothing_else(
    broker: EmbeddedBroker, secured: Mosquitto, pki: dict[str, str], tmp_path: Path, wrong: str
) -> None:
    cfg = {
        "url": secured.url,
        "username": "router",
        "password": "not-the-password" if wrong == "password" else ROUTER_PASSWORD,
        "tls": {"ca_file": pki["other_ca"] if wrong == "ca" else pki["ca"]},
    }
    stack = _stack(broker, tmp_path, cfg)
    try:
        time.sleep(3)  # several connection attempts
        assert _connected(stack) == "edgeroute_mqtt_connected 0.0"
        assert stack.router is not None and stack.router.popen.poll() is None
        assert call(f"{stack.router_url}/v2/health/ready")[0] == 200
        status = call(f"{stack.router_url}/v2/models/sensor_mlp/infer", json.dumps(BODY).encode())[0]
        assert status == 200
    finally:
        stack.stop()
