"""The MQTT v5 front door through a real Mosquitto, with a stock client (paho-mqtt) as the devices:
answers equal the HTTP path's for every zoo model; deadlines from the message expiry and `deadline_ms`
(an expired request is never run); QoS 1 redeliveries run once; sheddable work waits out a node outage
within its deadline; hostile messages get an error answer or are dropped and counted, and never harm
another client. Skipped where Mosquitto is not installed (`apt install mosquitto`)."""

from __future__ import annotations

import json
import os
import queue
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from scenarios.stack.broker import EmbeddedBroker
from scenarios.stack.launcher import Stack
from scenarios.stack.mosquitto import Mosquitto, mosquitto_binary
from tests.integration.conftest import ALL_MODELS, make_stack
from tests.integration.http import call

mqtt = pytest.importorskip("paho.mqtt.client")
from paho.mqtt.enums import CallbackAPIVersion  # noqa: E402
from paho.mqtt.packettypes import PacketTypes  # noqa: E402
from paho.mqtt.properties import Properties  # noqa: E402

pytestmark = pytest.mark.skipif(mosquitto_binary() is None, reason="Mosquitto is not installed")


# the device accounts of the brokers these tests start (Mosquitto as `edgeroute up` runs it: closed, an
# account per device, an ACL); with the router's auth on, a device's secret is its token too
DEVICE_SECRETS = {f"cam-{i}": f"cam-{i}-secret-{os.getpid()}-xyz" for i in range(12)}
PREFIXES = ("edgeroute", "shed", "load", "kafkaout", "bounce", "third", "canary")


def closed_broker(log_path: str, port: int = 0) -> Mosquitto:
    return Mosquitto(port=port, log_path=log_path, devices=DEVICE_SECRETS, topic_prefixes=PREFIXES).start()


class Device:
    """A paho MQTT v5 client logged in with a device account, with its own answer topic; `ask`
    publishes and `answers` collects; `token` goes with each request (`authorization`) when given."""

    def __init__(
        self,
        broker: Mosquitto,
        name: str,
        token: str | None = None,
        password: str | None = None,
        ca: str | None = None,
    ) -> None:
        host, port = broker.url.split("://")[1].split(":")
        self.name = name
        self.token = token
        self.topic = f"devices/{name}/answers"
        self.answers: queue.Queue[tuple[int, dict[str, str], bytes]] = queue.Queue()
        self.client = mqtt.Client(
            callback_api_version=CallbackAPIVersion.VERSION2,
            client_id=f"{name}-{os.urandom(4).hex()}",
            protocol=mqtt.MQTTv5,
        )
        secret = password if password is not None else broker.devices.get(name) or broker.users.get(name)
        if secret is not None:
            self.client.username_pw_set(name, secret)
        if broker.url.startswith("mqtts://"):
            import ssl

            self.client.tls_set_context(ssl.create_default_context(cafile=ca))
        self.client.on_message = self._on_message
        subscribed = threading.Event()
        self.client.on_subscribe = lambda *a: subscribed.set()
        self.client.connect(host, int(port), 30)
        self.client.loop_start()
        self.client.subscribe(self.topic, qos=1)
        assert subscribed.wait(10)

    def _on_message(self, client: Any, userdata: Any, msg: Any) -> None:
        props = msg.properties
        corr = getattr(props, "CorrelationData", b"\0" * 8)
        seq = struct.unpack(">q", corr[:8])[0] if len(corr) >= 8 else -1
        self.answers.put((seq, dict(getattr(props, "UserProperty", []) or []), msg.payload))

    def ask(
        self,
        model: str,
        body: bytes,
        seq: int,
        expiry_s: int | None = 10,
        user: list[tuple[str, str]] | None = None,
        topic: str | None = None,
        response_topic: str | None = "",
        correlation: bytes | None = None,
    ) -> None:
        props = Properties(PacketTypes.PUBLISH)
        if response_topic is not None:
            props.ResponseTopic = response_topic or self.topic
        props.CorrelationData = correlation if correlation is not None else struct.pack(">q", seq)
        if expiry_s is not None:
            props.MessageExpiryInterval = expiry_s
        user = [*(user or []), *([("authorization", f"Bearer {self.token}")] if self.token else [])]
        if user:
            props.UserProperty = user
        self.client.publish(topic or f"edgeroute/models/{model}/infer", body, qos=1, properties=props).wait_for_publish(
            10
        )

    def collect(self, n: int, within_s: float = 10.0) -> list[tuple[int, dict[str, str], bytes]]:
        out = []
        deadline = time.monotonic() + within_s
        while len(out) < n and time.monotonic() < deadline:
            try:
                out.append(self.answers.get(timeout=0.1))
            except queue.Empty:
                pass
        return out

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


@pytest.fixture(scope="module")
def mosquitto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mosquitto]:
    broker = closed_broker(str(tmp_path_factory.mktemp("mosquitto") / "mosquitto.log"))
    try:
        yield broker
    finally:
        broker.stop()


HTTP_TOKEN = f"http-client-token-{os.getpid()}"
AUTH = {"Authorization": f"Bearer {HTTP_TOKEN}"}


@pytest.fixture(scope="module")
def mqtt_stack(
    broker: EmbeddedBroker, mosquitto: Mosquitto, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    stack = make_stack(
        broker,
        tmp_path_factory.mktemp("mqtt-stack"),
        [
            {"id": "n1", "partition": "edge-a", "models": ALL_MODELS},
            {"id": "n2", "partition": "edge-a", "models": ["sensor_mlp"]},
        ],
        router={
            # the router's account; a fixed router id, so its client id (drawn from the id and its password)
            # is the same after a restart, and it resumes its session (what the broker queued meanwhile)
            "mqtt": {**mosquitto.router_config(), "max_in_flight_per_client": 8},
            "peers": {"router_id": "router-under-test"},
            "max_body_bytes": 1 << 20,
            # auth on: each device is a client of its own, its answers only on its own topics
            "auth": {
                "tokens": {"http": HTTP_TOKEN, **DEVICE_SECRETS},
                "sites": {"http": "*"},
                "admin_clients": ["http"],
            },
        },
    )
    stack.start()
    try:
        _door_open(stack)
        yield stack
    finally:
        stack.stop()


def _door_open(stack: Stack, within_s: float = 30.0) -> None:
    """Until the router's MQTT door is connected and subscribed."""
    deadline = time.monotonic() + within_s
    while "edgeroute_mqtt_connected 1.0" not in str(call(f"{stack.router_url}/metrics")[1]):
        assert time.monotonic() < deadline, "the MQTT door did not open"
        time.sleep(0.1)


_names = iter(DEVICE_SECRETS)


@pytest.fixture
def device(mosquitto: Mosquitto) -> Iterator[Device]:
    name = next(_names)
    d = Device(mosquitto, name, token=DEVICE_SECRETS[name])
    try:
        yield d
    finally:
        d.close()


def _body(stack: Stack, model: str, seed: int = 3) -> dict[str, Any]:
    import numpy as np

    meta = call(f"{stack.router_url}/v2/models/{model}", headers=AUTH)[1]
    rng = np.random.default_rng(seed)
    inputs = []
    for spec in meta["inputs"]:
        shape = [2 if int(d) == -1 else int(d) for d in spec["shape"]]
        inputs.append(
            {
                "name": spec["name"],
                "shape": shape,
                "datatype": spec["datatype"],
                "data": rng.random(shape).astype("float32").ravel().tolist(),
            }
        )
    return {"inputs": inputs}


def _counter(stack: Stack, result: str) -> float:
    text = call(f"{stack.router_url}/metrics")[1]
    for line in text.splitlines():
        if line.startswith(f'edgeroute_mqtt_messages_total{{result="{result}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _executions(stack: Stack, node: str, model: str = "sensor_mlp") -> int:
    """Requests the node ran for `model` (Triton's statistics: successful requests)."""
    stats = call(f"{stack.nodes[node].url}/v2/models/{model}/stats")[1]
    return sum(int(s["inference_stats"]["success"]["count"]) for s in stats["model_stats"])


def test_every_zoo_model_answers_over_mqtt_as_over_http(mqtt_stack: Stack, device: Device) -> None:
    for seq, model in enumerate(ALL_MODELS):
        doc = _body(mqtt_stack, model)
        status, want, _ = call(
            f"{mqtt_stack.router_url}/v2/models/{model}/infer", json.dumps(doc).encode(), headers=AUTH
        )
        assert status == 200, want
        device.ask(model, json.dumps(doc).encode(), seq)
        [(got_seq, props, payload)] = device.collect(1)
        assert got_seq == seq and props["status"] == "200", (props, payload[:300])
        got = json.loads(payload)
        assert [o["name"] for o in got["outputs"]] == [o["name"] for o in want["outputs"]]
        for a, b in zip(got["outputs"], want["outputs"], strict=True):
            assert a["shape"] == b["shape"] and a["datatype"] == b["datatype"]
            assert max(abs(x - y) for x, y in zip(a["data"], b["data"], strict=True)) < 1e-5


def test_an_expired_request_is_never_run(mqtt_stack: Stack, device: Device) -> None:
    body = json.dumps(_body(mqtt_stack, "sensor_mlp")).encode()
    before = _executions(mqtt_stack, "n1") + _executions(mqtt_stack, "n2")
    # a deadline already spent: answered 504, not run
    device.ask("sensor_mlp", body, 1, user=[("deadline_ms", "0")])
    [(_, props, _)] = device.collect(1)
    assert props["status"] == "504", props
    # requests that expire while the router is away: the broker keeps its session's queue and drops them
    # at their expiry; the ones that have time left are answered when it is back
    mqtt_stack.stop_router()
    for seq in range(10, 15):
        device.ask("sensor_mlp", body, seq, expiry_s=1)
    for seq in range(20, 22):
        device.ask("sensor_mlp", body, seq, expiry_s=60)
    time.sleep(2.5)
    mqtt_stack.start_router()
    mqtt_stack.wait_ready(30)
    _door_open(mqtt_stack)
    answers = device.collect(2, within_s=15)
    assert sorted((seq, props["status"]) for seq, props, _ in answers) == [(20, "200"), (21, "200")], answers
    assert device.collect(1, within_s=1) == []
    assert _executions(mqtt_stack, "n1") + _executions(mqtt_stack, "n2") == before + 2


def test_a_redelivered_request_runs_once(mqtt_stack: Stack, device: Device) -> None:
    body = json.dumps(_body(mqtt_stack, "sensor_mlp")).encode()
    before = _executions(mqtt_stack, "n1") + _executions(mqtt_stack, "n2")
    dups = _counter(mqtt_stack, "duplicate")
    for _ in range(3):  # the same request (response topic and correlation data) three times
        device.ask("sensor_mlp", body, 77)
    answers = device.collect(3, within_s=3)
    assert [props["status"] for _, props, _ in answers] == ["200"], answers
    assert _executions(mqtt_stack, "n1") + _executions(mqtt_stack, "n2") == before + 1
    assert _counter(mqtt_stack, "duplicate") == dups + 2


def test_hostile_messages_are_answered_or_dropped_and_harm_no_one(
    mqtt_stack: Stack, mosquitto: Mosquitto, device: Device
) -> None:
    honest_name = next(_names)
    honest = Device(mosquitto, honest_name, token=DEVICE_SECRETS[honest_name])
    try:
        body = json.dumps(_body(mqtt_stack, "sensor_mlp")).encode()
        dropped = {r: _counter(mqtt_stack, r) for r in ("no_response_topic", "bad_property")}
        device.ask("sensor_mlp", body, 1, response_topic=None)  # nowhere to answer
        device.ask("sensor_mlp", body, 2, user=[(f"k{i}", "v") for i in range(40)])  # too many properties
        device.ask("sensor_mlp", body, 3, correlation=b"x" * 1000)  # correlation data too long
        device.ask("sensor_mlp", body, 4, response_topic="devices/+/answers")  # a wildcard to answer to
        device.ask("bad!name", body, 5)  # a name that is not one
        device.ask("sensor_mlp", b"\xff{garbage", 6)
        device.ask("sensor_mlp", body, 7, user=[("priority", "nan")])
        device.ask("nope", body, 8)
        device.ask("sensor_mlp", b"x" * (2 << 20), 9)  # over the body limit (1 MiB): the broker holds it back
        device.ask("sensor_mlp", body, 10, user=[("deadline_ms", "-inf")])
        answered = {seq: props["status"] for seq, props, _ in device.collect(6, within_s=5)}
        assert answered == {5: "400", 6: "400", 7: "400", 8: "404", 10: "400"}, answered
        assert _counter(mqtt_stack, "bad_property") == dropped["bad_property"] + 3
        assert _counter(mqtt_stack, "no_response_topic") == dropped["no_response_topic"] + 1
        # a flood from one client: past its in-flight share it gets 429s; the honest client is served
        heavy = json.dumps(_body(mqtt_stack, "resnet_s")).encode()
        for seq in range(100, 400):  # a resnet_s request in every ten, the rest sensor_mlp
            model, payload = ("resnet_s", heavy) if seq % 10 == 0 else ("sensor_mlp", body)
            device.ask(model, payload, seq, expiry_s=30)
        for seq in range(20):  # ten a second, well within its own share
            honest.ask("sensor_mlp", body, seq, user=[("deadline_ms", "3000")])
            time.sleep(0.1)
        got = honest.collect(20, within_s=15)
        assert sorted(s for s, _, _ in got) == list(range(20)) and all(p["status"] == "200" for _, p, _ in got), got
        flood = device.collect(300, within_s=20)
        assert len(flood) == 300 and {p["status"] for _, p, _ in flood} <= {"200", "429", "503", "504"}
        assert mqtt_stack.router is not None and mqtt_stack.router.popen.poll() is None
    finally:
        honest.close()


def test_sheddable_work_waits_out_a_node_outage(broker: EmbeddedBroker, mosquitto: Mosquitto, tmp_path: Any) -> None:
    stack = make_stack(
        broker,
        tmp_path,
        [{"id": "s1", "partition": "edge-a", "models": ["sensor_mlp"]}],
        router={"mqtt": {**mosquitto.router_config(), "group": "shed", "topic_prefix": "shed"}, "stale_after_ms": 500},
    )
    stack.start()
    _door_open(stack)
    dev = Device(mosquitto, next(_names))
    try:
        body = json.dumps(_body(stack, "sensor_mlp")).encode()
        port = stack.nodes["s1"].port
        stack.kill_node("s1")
        time.sleep(1.5)  # out of rotation
        dev.ask(
            "sensor_mlp",
            body,
            1,
            topic="shed/models/sensor_mlp/infer",
            user=[("priority", "-1"), ("deadline_ms", "8000")],
        )
        dev.ask(
            "sensor_mlp",
            body,
            2,
            topic="shed/models/sensor_mlp/infer",
            user=[("priority", "0"), ("deadline_ms", "8000")],
        )
        time.sleep(1.0)
        stack.start_node(stack.node_specs["s1"], port)
        got = {seq: props["status"] for seq, props, _ in dev.collect(2, within_s=15)}
        assert got == {1: "200", 2: "503"}, got  # the sheddable one waited; the other was refused at once
    finally:
        dev.close()
        stack.stop()


def test_the_door_comes_back_with_a_restarted_broker(broker: EmbeddedBroker, tmp_path: Any) -> None:
    """A site's broker restarts (a reboot, an upgrade): the door notices (`edgeroute_mqtt_connected` 0),
    reconnects by itself once the broker is back on its address, subscribes again, and answers; HTTP is
    served throughout."""
    first = closed_broker(str(tmp_path / "mosquitto-1.log"))
    port = first.port
    stack = make_stack(
        broker,
        tmp_path,
        [{"id": "b1", "partition": "edge-a", "models": ["sensor_mlp"]}],
        router={"mqtt": {**first.router_config(), "group": "bounce", "topic_prefix": "bounce"}},
    )
    stack.start()
    second: Mosquitto | None = None
    try:
        _door_open(stack)
        body = json.dumps(_body(stack, "sensor_mlp")).encode()
        dev = Device(first, "cam-0")
        dev.ask("sensor_mlp", body, 1, topic="bounce/models/sensor_mlp/infer")
        assert [(s, p["status"]) for s, p, _ in dev.collect(1)] == [(1, "200")]
        dev.close()
        first.stop()
        deadline = time.monotonic() + 15
        while "edgeroute_mqtt_connected 0.0" not in str(call(f"{stack.router_url}/metrics")[1]):
            assert time.monotonic() < deadline, "the door did not notice the broker had gone"
            time.sleep(0.1)
        assert call(f"{stack.router_url}/v2/models/sensor_mlp/infer", body)[0] == 200  # HTTP unaffected
        second = Mosquitto(
            port=port,
            log_path=str(tmp_path / "mosquitto-2.log"),
            devices=DEVICE_SECRETS,
            topic_prefixes=PREFIXES,
            routers=dict([first.router_account]),
        ).start()
        _door_open(stack, within_s=30)
        dev = Device(second, "cam-1")
        try:
            dev.ask("sensor_mlp", body, 2, topic="bounce/models/sensor_mlp/infer")
            assert [(s, p["status"]) for s, p, _ in dev.collect(1)] == [(2, "200")]
        finally:
            dev.close()
    finally:
        stack.stop()
        first.stop()
        if second is not None:
            second.stop()


def test_sheddable_work_a_node_refuses_for_load_is_not_tried_again(
    broker: EmbeddedBroker, mosquitto: Mosquitto, tmp_path: Any
) -> None:
    """Waiting out an outage must not turn into load: sheddable work that a live node refused (it could
    not finish in time) is answered with that refusal at once, not sent again every
    `sheddable_retry_ms` until its deadline."""
    stack = make_stack(
        broker,
        tmp_path,
        [{"id": "slow", "partition": "edge-a", "models": ["resnet_s"], "speed": 0.003}],  # ~2 s a run
        router={
            "mqtt": {**mosquitto.router_config(), "group": "load", "topic_prefix": "load"},
            "sheddable_retry_ms": 50,
        },
    )
    stack.start()
    dev = Device(mosquitto, next(_names))
    try:
        _door_open(stack)
        body = json.dumps(_body(stack, "resnet_s")).encode()
        began = time.monotonic()
        dev.ask(
            "resnet_s", body, 1, topic="load/models/resnet_s/infer", user=[("priority", "-1"), ("deadline_ms", "1500")]
        )
        got = dev.collect(1, within_s=10)
        waited = time.monotonic() - began
        assert [(seq, props["status"]) for seq, props, _ in got] == [(1, "503")], got
        text = str(call(f"{stack.nodes['slow'].url}/metrics")[1])
        refusals = sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("edgeroute_node_inference_request_failure_total") and 'status="503"' in line
        )
        # one routing (the node, tried once, is not tried again), no second round of the door's
        assert refusals == 1, f"the node refused it {refusals:.0f} times"
        assert waited < 1.0, f"answered after {waited:.2f} s"
    finally:
        dev.close()
        stack.stop()


def test_devices_are_served_over_mqtt_through_a_kafka_outage(mosquitto: Mosquitto, tmp_path: Any) -> None:
    """Telemetry is advice over MQTT as over HTTP: with the Kafka broker gone past every staleness
    bound, the devices' requests are answered 200 on the nodes the router last knew (and its own
    evidence of their life)."""
    kafka = EmbeddedBroker(log_path=str(tmp_path / "kafka.log")).start()
    stack = make_stack(
        kafka,
        tmp_path,
        [
            {"id": "k1", "partition": "edge-a", "models": ["sensor_mlp"]},
            {"id": "k2", "partition": "edge-a", "models": ["sensor_mlp"]},
        ],
        router={
            "mqtt": {**mosquitto.router_config(), "group": "kafka-out", "topic_prefix": "kafkaout"},
            "stale_after_ms": 500,
        },
    )
    dev: Device | None = None
    try:
        stack.start()
        _door_open(stack)
        dev = Device(mosquitto, next(_names))
        body = json.dumps(_body(stack, "sensor_mlp")).encode()
        kafka.stop()
        time.sleep(1.5)  # every report is now stale
        for seq in range(10):
            dev.ask("sensor_mlp", body, seq, topic="kafkaout/models/sensor_mlp/infer")
        got = {seq: props["status"] for seq, props, _ in dev.collect(10, within_s=15)}
        assert got == dict.fromkeys(range(10), "200"), got
        assert all(proc is not None and proc.popen.poll() is None for proc in [stack.router, *stack.nodes.values()])
    finally:
        if dev is not None:
            dev.close()
        stack.stop()
        kafka.stop()
