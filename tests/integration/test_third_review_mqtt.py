"""The third review's MQTT findings, each reproduced through a real Mosquitto with stock paho clients:

1. the door acted before it authenticated (answers published for requests with no token, to any topic;
   another client's correlation ids dropped as duplicates; a token answering on another's topics; an
   unauthenticated flood growing the router; a copy handled after the deadline run again);
2. the brokers `edgeroute up` starts were open (anonymous subscribers read every token, joined the
   routers' shared group, took the router's guessable client id);
3. limits applied to QoS 1 only and a client was keyed by its response topic.

The router's own behaviour is watched on an open broker with a spy subscribed to everything (what the
router publishes, whatever the broker would allow); the stack's broker is attacked as it ships.
Skipped where Mosquitto is not installed."""

from __future__ import annotations

import json
import os
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
from tests.integration.conftest import make_stack, scenario
from tests.integration.http import call, infer_body
from tests.integration.test_mqtt import Device, _counter, _door_open, _executions

mqtt = pytest.importorskip("paho.mqtt.client")
from paho.mqtt.enums import CallbackAPIVersion  # noqa: E402
from paho.mqtt.packettypes import PacketTypes  # noqa: E402
from paho.mqtt.properties import Properties  # noqa: E402

pytestmark = pytest.mark.skipif(mosquitto_binary() is None, reason="Mosquitto is not installed")

TOKENS = {name: f"{name}-token-{os.getpid()}-0123456789" for name in ("cam-a", "cam-b", "ops")}
BODY = infer_body()


class Spy:
    """A client subscribed to every topic of an open broker: what was published where."""

    def __init__(self, broker: Mosquitto) -> None:
        host, port = broker.url.removeprefix("mqtt://").split(":")
        self.seen: list[tuple[str, dict[str, str]]] = []
        self.lock = threading.Lock()
        self.client = mqtt.Client(
            callback_api_version=CallbackAPIVersion.VERSION2, client_id=f"spy-{os.getpid()}", protocol=mqtt.MQTTv5
        )
        ready = threading.Event()
        self.client.on_subscribe = lambda *a: ready.set()
        self.client.on_message = self._on_message
        self.client.connect(host, int(port))
        self.client.loop_start()
        self.client.subscribe("#", qos=0)
        assert ready.wait(10)

    def _on_message(self, client: Any, userdata: Any, msg: Any) -> None:
        with self.lock:
            self.seen.append((msg.topic, dict(getattr(msg.properties, "UserProperty", []) or [])))

    def answers_on(self, topic: str) -> list[dict[str, str]]:
        """What was published on `topic` carrying a `status` (an answer, not a request)."""
        with self.lock:
            return [props for t, props in self.seen if t == topic and "status" in props]

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def _publisher(broker: Mosquitto, name: str) -> Any:
    host, port = broker.url.removeprefix("mqtt://").split(":")
    client = mqtt.Client(
        callback_api_version=CallbackAPIVersion.VERSION2, client_id=f"{name}-{os.getpid()}", protocol=mqtt.MQTTv5
    )
    client.max_queued_messages_set(0)
    client.max_inflight_messages_set(65535)
    client.connect(host, int(port))
    client.loop_start()
    return client


def _publish(
    client: Any, topic: str, payload: bytes, answer_to: str, corr: bytes, user: list[tuple[str, str]], qos: int = 1
) -> Any:
    props = Properties(PacketTypes.PUBLISH)
    props.ResponseTopic = answer_to
    props.CorrelationData = corr
    props.MessageExpiryInterval = 30
    if user:
        props.UserProperty = user
    return client.publish(topic, payload, qos=qos, properties=props)


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def open_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mosquitto]:
    broker = Mosquitto(log_path=str(tmp_path_factory.mktemp("open-mqtt") / "mosquitto.log"), anonymous=True).start()
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture(scope="module")
def guarded(
    broker: EmbeddedBroker, open_broker: Mosquitto, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """A router with auth on, its MQTT door on an open broker (only the router's own rules stand)."""
    stack = make_stack(
        broker,
        tmp_path_factory.mktemp("guarded-mqtt"),
        [{"id": "g1", "partition": "edge-a", "models": ["sensor_mlp", "echo"]}],
        router={
            "mqtt": {"url": open_broker.url, "topic_prefix": "third", "group": "third-guarded"},
            "auth": {"tokens": TOKENS, "admin_clients": ["ops"]},
        },
    )
    stack.start()
    try:
        _door_open(stack)
        yield stack
    finally:
        stack.stop()


def _device(broker: Mosquitto, name: str) -> Device:
    return Device(broker, name, token=TOKENS.get(name))


def _ask(device: Device, seq: int, **kwargs: Any) -> None:
    device.ask("sensor_mlp", BODY, seq, topic="third/models/sensor_mlp/infer", **kwargs)


def test_a_request_that_does_not_authenticate_is_never_answered_anywhere(
    guarded: Stack, open_broker: Mosquitto
) -> None:
    spy = Spy(open_broker)
    attacker = _publisher(open_broker, "attacker")
    try:
        before = _counter(guarded, "unauthenticated")
        for answer_to in ("devices/cam-a/answers", "site/edge-a/control/reboot"):
            for user in ([], [("authorization", "Bearer not-a-token")], [("authorization", "Basic eA==")]):
                _publish(attacker, "third/models/sensor_mlp/infer", BODY, answer_to, b"forged", user).wait_for_publish(
                    5
                )
        time.sleep(1.5)
        assert spy.answers_on("devices/cam-a/answers") == [] and spy.answers_on("site/edge-a/control/reboot") == []
        assert _counter(guarded, "unauthenticated") == before + 6
    finally:
        attacker.loop_stop()
        attacker.disconnect()
        spy.close()


def test_one_client_cannot_have_anothers_requests_dropped_as_copies(guarded: Stack, open_broker: Mosquitto) -> None:
    """An attacker sends the victim's next correlation ids first, with the victim's answer topic: with no
    token, and with a token of its own; the victim's twenty requests are all run and answered."""
    attacker = _publisher(open_broker, "dup-attacker")
    victim = _device(open_broker, "cam-a")
    try:
        for seq in range(20):
            corr = struct.pack(">q", 1000 + seq)
            for user in ([], [("authorization", f"Bearer {TOKENS['cam-b']}")]):
                _publish(attacker, "third/models/sensor_mlp/infer", BODY, victim.topic, corr, user).wait_for_publish(5)
        time.sleep(0.5)
        for seq in range(20):
            _ask(victim, 1000 + seq)
        got = victim.collect(20, within_s=15)
        assert sorted(s for s, _, _ in got) == list(range(1000, 1020)), got
        assert {p["status"] for _, p, _ in got} == {"200"}
        assert victim.collect(1, within_s=0.5) == []  # and nothing of the attacker's
    finally:
        attacker.loop_stop()
        attacker.disconnect()
        victim.close()


def test_a_token_answers_only_on_its_own_topics(guarded: Stack, open_broker: Mosquitto) -> None:
    """cam-b's valid token with cam-a's answer topic: nothing is published there (counted); cam-a's own
    request with the same correlation data is answered."""
    b = _device(open_broker, "cam-b")
    a = _device(open_broker, "cam-a")
    try:
        before = _counter(guarded, "forbidden_topic")
        b.ask("sensor_mlp", BODY, 77, topic="third/models/sensor_mlp/infer", response_topic=a.topic)
        time.sleep(1.0)
        assert a.collect(1, within_s=0.5) == []
        assert _counter(guarded, "forbidden_topic") == before + 1
        _ask(a, 77)
        assert [(s, p["status"]) for s, p, _ in a.collect(1)] == [(77, "200")]
    finally:
        a.close()
        b.close()


def test_an_unauthenticated_flood_costs_the_router_nothing(guarded: Stack, open_broker: Mosquitto) -> None:
    """20,000 QoS 0 publishes with no token (they added 175 MB and lost 1 of 5 victim answers): the
    router's memory stays put and the victim is answered throughout."""
    assert guarded.router is not None
    pid = guarded.router.popen.pid
    flood = _publisher(open_broker, "flood")
    victim = _device(open_broker, "cam-a")
    try:
        rss0 = _rss_kb(pid)
        for i in range(20_000):
            _publish(flood, "third/models/sensor_mlp/infer", BODY, f"devices/x{i}/answers", str(i).encode(), [], qos=0)
            if i % 4000 == 0:
                _ask(victim, 5000 + i // 4000)
        got = victim.collect(5, within_s=20)
        time.sleep(1.0)
        grown_mb = (_rss_kb(pid) - rss0) / 1024
        assert sorted(s for s, _, _ in got) == list(range(5000, 5005)), got
        assert grown_mb < 20, f"the router grew {grown_mb:.1f} MB"
    finally:
        flood.loop_stop()
        flood.disconnect()
        victim.close()


def test_a_copy_that_comes_after_the_deadline_is_not_run_again(guarded: Stack, open_broker: Mosquitto) -> None:
    """The broker may hand a QoS 1 request over again until it expires: a copy handled after the
    request's (much shorter) deadline is still a copy."""
    a = _device(open_broker, "cam-a")
    try:
        before = _executions(guarded, "g1")
        dups = _counter(guarded, "duplicate")
        _ask(a, 4242, expiry_s=30, user=[("deadline_ms", "40")])
        first = a.collect(1)
        assert [s for s, _, _ in first] == [4242], first
        time.sleep(0.5)  # past the deadline, within the expiry
        _ask(a, 4242, expiry_s=30, user=[("deadline_ms", "40")])
        assert a.collect(1, within_s=1.5) == []
        assert _executions(guarded, "g1") <= before + 1
        assert _counter(guarded, "duplicate") == dups + 1
    finally:
        a.close()


def test_anonymous_requests_are_one_client_whatever_their_topics(
    broker: EmbeddedBroker, open_broker: Mosquitto, tmp_path: Path
) -> None:
    """With auth off a request names no one it could be told by: forty answer topics are one client under
    the rate limit (they were forty clients: 40 of 40 answered under 1/s, burst 2)."""
    stack = make_stack(
        broker,
        tmp_path,
        [{"id": "r1", "partition": "edge-a", "models": ["sensor_mlp"]}],
        router={
            "mqtt": {"url": open_broker.url, "topic_prefix": "rated", "group": "rated"},
            "rate_limit": {"rps": 1, "burst": 2},
        },
    )
    stack.start()
    devices = [Device(open_broker, f"anon-{i}") for i in range(2)]
    try:
        _door_open(stack)
        for i in range(40):
            dev = devices[i % 2]
            dev.ask("sensor_mlp", BODY, i, topic="rated/models/sensor_mlp/infer", response_topic=f"devices/anon-{i}/a")
        time.sleep(2.0)  # (each answer went to a topic of its own: the router's own count tells)
        text = str(call(f"{stack.router_url}/metrics")[1])
        statuses = [
            line
            for line in text.splitlines()
            if line.startswith("edgeroute_requests_total") and 'model="sensor_mlp"' in line
        ]
        ok = sum(float(line.rsplit(" ", 1)[1]) for line in statuses if 'outcome="ok"' in line)
        limited = sum(float(line.rsplit(" ", 1)[1]) for line in statuses if 'outcome="429"' in line)
        assert ok <= 4 and limited >= 36, statuses
    finally:
        for dev in devices:
            dev.close()
        stack.stop()


def test_qos0_is_held_to_the_doors_bounds(broker: EmbeddedBroker, open_broker: Mosquitto, tmp_path: Path) -> None:
    """400 QoS 0 publishes of 256 KiB (they added 139 MB to the router and drove the node to 64
    concurrent requests; QoS 1 was held to 16): the door's in-flight and byte caps hold for every QoS,
    the excess refused and counted."""
    stack = make_stack(
        broker,
        tmp_path,
        [{"id": "q1", "partition": "edge-a", "models": ["sensor_mlp"], "speed": 0.2}],
        router={
            "mqtt": {"url": open_broker.url, "topic_prefix": "qos0", "group": "qos0", "max_in_flight": 16},
        },
    )
    stack.start()
    flood = _publisher(open_broker, "qos0-flood")
    try:
        _door_open(stack)
        assert stack.router is not None
        pid = stack.router.popen.pid
        call(f"{stack.nodes['q1'].url}/admin/stats?reset=1", headers=stack.node_headers)
        doc = json.loads(BODY)
        big = json.dumps(doc).encode() + b" " * (256 << 10)  # valid JSON, 256 KiB of padding
        rss0 = _rss_kb(pid)
        refused = _counter(stack, "door_limit")
        for i in range(400):
            _publish(flood, "qos0/models/sensor_mlp/infer", big, f"devices/q/{i}", str(i).encode(), [], qos=0)
        time.sleep(4.0)
        grown_mb = (_rss_kb(pid) - rss0) / 1024
        peak = call(f"{stack.nodes['q1'].url}/admin/stats", headers=stack.node_headers)[1]["peak_outstanding"]
        assert _counter(stack, "door_limit") > refused, "the door's cap refused none"
        assert peak <= 16, f"the node held {peak} requests at once"
        assert grown_mb < 60, f"the router grew {grown_mb:.1f} MB"
    finally:
        flood.loop_stop()
        flood.disconnect()
        stack.stop()


def test_the_stacks_broker_lets_no_one_in_without_an_account(broker: EmbeddedBroker, tmp_path: Path) -> None:
    """The broker a stack starts (as `edgeroute up` does): anonymous clients are refused; a device's
    account cannot read the request topics (the tokens in them), cannot take a share of the requests by
    joining the routers' group under its old, default name, and cannot push the router off by taking
    the client id it used to have (`edgeroute-<router id>`); the router answers all the while."""
    stack = Stack(
        scenario([{"id": "m1", "partition": "edge-a", "models": ["sensor_mlp"]}]),
        kafka=broker.bootstrap,
        log_dir=tmp_path,
        topic=f"edgeroute.telemetry.closed{os.getpid()}",
        mqtt="embedded",
    )
    stack.start()
    clients: list[Any] = []
    try:
        _door_open(stack)
        mosq = stack.mosquitto
        assert mosq is not None
        host, port = mosq.url.removeprefix("mqtt://").split(":")
        refused = threading.Event()
        anon = mqtt.Client(callback_api_version=CallbackAPIVersion.VERSION2, client_id="anon", protocol=mqtt.MQTTv5)
        anon.on_connect = lambda c, u, f, reason, p: refused.set() if reason.is_failure else None
        anon.connect(host, int(port))
        anon.loop_start()
        clients.append(anon)
        assert refused.wait(5), "an anonymous client was let in"
        # a device's account: eavesdrop, join the routers' group under the old default name, take the old id
        name, secret = next(iter(stack.secrets.devices.items()))
        stolen: list[bytes] = []
        view = call(f"{stack.router_url}/admin/view")[1]
        for client_id, topics in (
            (f"{name}-eaves", ["edgeroute/models/+/infer", "$share/edgeroute/edgeroute/models/+/infer"]),
            (f"edgeroute-{view['router_id']}", ["$share/edgeroute/edgeroute/models/+/infer"]),
        ):
            c = mqtt.Client(callback_api_version=CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
            c.username_pw_set(name, secret)
            c.on_message = lambda cl, u, msg: stolen.append(msg.payload)
            c.connect(host, int(port))
            c.loop_start()
            for topic in topics:
                c.subscribe(topic, qos=1)
            clients.append(c)
        time.sleep(0.5)
        device = Device(mosq, name)
        clients.append(device)
        for seq in range(20):
            device.ask("sensor_mlp", BODY, seq)
        got = device.collect(20, within_s=15)
        assert sorted(s for s, _, _ in got) == list(range(20)) and {p["status"] for _, p, _ in got} == {"200"}, got
        assert stolen == [], f"{len(stolen)} requests read by a device"
        assert "edgeroute_mqtt_connected 1.0" in str(call(f"{stack.router_url}/metrics")[1])
    finally:
        for c in clients:
            if isinstance(c, Device):
                c.close()
            else:
                c.loop_stop()
                c.disconnect()
        stack.stop()
