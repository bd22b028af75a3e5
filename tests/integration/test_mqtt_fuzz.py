"""Generated hostile publishes against the MQTT door of a real router (hypothesis), through a real
Mosquitto left open so that nothing but the router's own rules stands: request topics odd and valid,
response topics foreign, wildcarded, huge or absent, correlation data of every length, user properties
by the dozen, tokens missing, wrong, malformed and valid (an attacker with a token of its own), hint
values of every kind, payloads of random bytes, broken and valid JSON, QoS 0 and 1, DUP flags, and
copies of earlier publishes. An honest device publishes beside them all along: every one of its
requests is answered 200 within its deadline; afterwards the router is alive, connected, and its
memory has grown by at most 20 MB. (What a broker refuses itself, a wildcard in a response topic or
a control character in a string, never reaches the router: the broker drops the client that sends it. The door's
own checks of those are in test_mqtt.py; control characters and non-characters alike.)

`make test` runs a slice (EDGEROUTE_FUZZ_EXAMPLES, default 300, deterministic); `make fuzz` runs
10,000 with a fresh seed each time. Skipped where Mosquitto is not installed."""

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
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scenarios.stack.broker import EmbeddedBroker
from scenarios.stack.launcher import Stack
from scenarios.stack.mosquitto import Mosquitto, mosquitto_binary
from tests.integration.conftest import make_stack
from tests.integration.http import call, infer_body
from tests.integration.test_mqtt import Device, _door_open

mqtt = pytest.importorskip("paho.mqtt.client")
from paho.mqtt.enums import CallbackAPIVersion  # noqa: E402
from paho.mqtt.packettypes import PacketTypes  # noqa: E402
from paho.mqtt.properties import Properties  # noqa: E402

pytestmark = pytest.mark.skipif(mosquitto_binary() is None, reason="Mosquitto is not installed")

EXAMPLES = int(os.environ.get("EDGEROUTE_FUZZ_EXAMPLES", "300"))
RANDOM = bool(os.environ.get("EDGEROUTE_FUZZ_RANDOM"))
TOKENS = {name: f"{name}-fuzz-token-{os.getpid()}-0123456789" for name in ("honest", "attacker", "ops")}
PREFIX = "fuzz"

# MQTT strings are UTF-8 without control characters or non-characters (Mosquitto drops the client that
# sends one): the router never sees those
texts = st.text(alphabet=st.characters(exclude_categories=("Cs", "Cc", "Cn")), max_size=40)
hints = st.one_of(
    st.sampled_from(["nan", "inf", "-inf", "1e400", "0", "-1", "100", "1000", "", " ", "9" * 600, "true", "[]"]),
    st.integers(min_value=-(10**20), max_value=10**20).map(str),
    texts,
)
topics = st.one_of(
    st.sampled_from(
        [
            f"{PREFIX}/models/sensor_mlp/infer",
            f"{PREFIX}/models/echo/infer",
            f"{PREFIX}/models/sensor_mlp/versions/1/infer",
            f"{PREFIX}/models/nope/infer",
            f"{PREFIX}/models/../infer",
            f"{PREFIX}/models/a%2Fb/infer",
            f"{PREFIX}/models/{'m' * 300}/infer",
            f"{PREFIX}/models/sensor_mlp/versions/x/y/infer",
            f"{PREFIX}/models/sensor_mlp/versions/999999999999/infer",
        ]
    ),
    st.builds(lambda m: f"{PREFIX}/models/{m}/infer", st.text(alphabet="abcdefghij_-.:!@", min_size=1, max_size=30)),
)
answer_topics = st.one_of(
    st.sampled_from(
        [
            "devices/attacker/answers",
            "devices/honest/answers",
            "site/edge-a/control/reboot",
            "$SYS/x",
            "d" * 600,
        ]
    ),
    st.builds(lambda t: f"devices/attacker/{t}", st.text(alphabet="abc/xyz", max_size=20)),
    st.none(),
)
tokens = st.one_of(
    st.none(),
    st.sampled_from(
        [f"Bearer {TOKENS['attacker']}", "Bearer wrong", "Basic abc", "Bearer ", "bearer " + TOKENS["attacker"]]
    ),
    texts,
)
payloads = st.one_of(
    st.just(infer_body()),
    st.just(
        json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}).encode()
    ),
    st.binary(max_size=256),
    st.builds(lambda d: json.dumps(d).encode(), st.dictionaries(st.text(max_size=8), st.integers(), max_size=5)),
    st.just(b"{" * 5000),
    st.just(
        b'{"inputs": [{"name": "readings", "datatype": "FP32", "shape": [1, 16], "data": [' + b"1," * 15 + b'"x"]}]}'
    ),
    st.just(b"\x00" * 70_000),
)


@st.composite
def publishes(draw: st.DrawFn) -> dict[str, Any]:
    user: list[tuple[str, str]] = []
    token = draw(tokens)
    if token is not None:
        user.append(("authorization", token))
    for name in draw(st.lists(st.sampled_from(["deadline_ms", "priority", "site", "traceparent", "x"]), max_size=5)):
        user.append((name, draw(hints)))
    if draw(st.integers(0, 20)) == 0:
        user += [(f"k{i}", "v") for i in range(draw(st.integers(30, 40)))]
    return {
        "topic": draw(topics),
        "answer_to": draw(answer_topics),
        "corr": draw(st.one_of(st.none(), st.binary(max_size=16), st.just(b"c" * 300))),
        "expiry": draw(st.one_of(st.none(), st.integers(0, 3), st.just(60))),
        "user": user,
        "payload": draw(payloads),
        "qos": draw(st.sampled_from([0, 1])),
        "again": draw(st.integers(0, 9)) == 0,  # a copy of an earlier publish
    }


class Honest:
    """A device publishing valid requests (1 s deadline) ten times a second on its own topic."""

    DEADLINE_MS = 1000.0

    def __init__(self, broker: Mosquitto) -> None:
        self.device = Device(broker, "honest", token=TOKENS["honest"])
        self.sent: dict[int, float] = {}
        self.results: list[tuple[int, str, float]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.device.client.on_message = self._answer

    def _answer(self, client: Any, userdata: Any, msg: Any) -> None:
        corr = getattr(msg.properties, "CorrelationData", b"") or b""
        seq = struct.unpack(">q", corr[:8])[0] if len(corr) >= 8 else -1
        status = dict(getattr(msg.properties, "UserProperty", []) or []).get("status", "?")
        self.results.append((seq, status, (time.monotonic() - self.sent.get(seq, 0.0)) * 1000))

    def _run(self) -> None:
        seq = 0
        while not self.stop.is_set():
            seq += 1
            self.sent[seq] = time.monotonic()
            self.device.ask(
                "sensor_mlp",
                infer_body(),
                seq,
                expiry_s=5,
                topic=f"{PREFIX}/models/sensor_mlp/infer",
                user=[("deadline_ms", f"{self.DEADLINE_MS:g}")],
            )
            self.stop.wait(0.1)

    def __enter__(self) -> Honest:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(10)
        deadline = time.monotonic() + 10
        while len(self.results) < len(self.sent) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.device.close()


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.fixture
def fuzz_broker(tmp_path: Path) -> Iterator[Mosquitto]:
    broker = Mosquitto(log_path=str(tmp_path / "mosquitto.log"), anonymous=True).start()
    try:
        yield broker
    finally:
        broker.stop()


def test_hostile_publishes_hurt_no_one(broker: EmbeddedBroker, fuzz_broker: Mosquitto, tmp_path: Path) -> None:
    stack: Stack = make_stack(
        broker,
        tmp_path,
        [{"id": "f1", "partition": "edge-a", "models": ["sensor_mlp", "echo"]}],
        router={
            "mqtt": {"url": fuzz_broker.url, "topic_prefix": PREFIX, "group": "fuzz"},
            "auth": {"tokens": TOKENS, "admin_clients": ["ops"]},
            "max_body_bytes": 1 << 20,
        },
    )
    stack.start()
    host, port = fuzz_broker.url.removeprefix("mqtt://").split(":")
    attacker = mqtt.Client(
        callback_api_version=CallbackAPIVersion.VERSION2, client_id=f"fuzzer-{os.getpid()}", protocol=mqtt.MQTTv5
    )
    attacker.max_queued_messages_set(0)
    attacker.max_inflight_messages_set(65535)
    dropped: list[Any] = []  # the broker's disconnects of the fuzzer: what followed would never reach the router
    attacker.on_disconnect = lambda c, u, f, reason, p: dropped.append(reason)
    earlier: list[dict[str, Any]] = []
    sent = [0]
    try:
        _door_open(stack)
        assert stack.router is not None
        pid = stack.router.popen.pid
        attacker.connect(host, int(port))
        attacker.loop_start()
        rss_before = _rss_mb(pid)

        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            derandomize=not RANDOM,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(publishes())
        def attack(msg: dict[str, Any]) -> None:
            if msg["again"] and earlier:
                msg = earlier[len(earlier) // 2]
            props = Properties(PacketTypes.PUBLISH)
            if msg["answer_to"] is not None:
                props.ResponseTopic = msg["answer_to"]
            if msg["corr"] is not None:
                props.CorrelationData = msg["corr"]
            if msg["expiry"] is not None:
                props.MessageExpiryInterval = msg["expiry"]
            if msg["user"]:
                props.UserProperty = msg["user"]
            attacker.publish(msg["topic"], msg["payload"], qos=msg["qos"], properties=props)
            sent[0] += 1
            if len(earlier) < 64:
                earlier.append(msg)
            if sent[0] % 200 == 0:
                time.sleep(0.05)  # (the fuzzer's own client: let its socket drain)

        with Honest(fuzz_broker) as honest:
            attack()
            time.sleep(1.0)
        time.sleep(1.0)
        grown = _rss_mb(pid) - rss_before
        text = str(call(f"{stack.router_url}/metrics")[1])
        counts = {
            line.split('"')[1]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("edgeroute_mqtt_messages_total{")
        }
        print(f"mqtt fuzz: {sent[0]} publishes, door results {counts}; {len(honest.results)} honest; +{grown:.1f} MB")
        assert sent[0] >= EXAMPLES and not dropped, dropped
        assert sum(counts.values()) >= 0.95 * sent[0], "publishes that never reached the door"
        late = [(s, st_, round(ms)) for s, st_, ms in honest.results if st_ != "200" or ms > Honest.DEADLINE_MS + 500]
        assert len(honest.results) == len(honest.sent) and not late, (len(honest.results), len(honest.sent), late[:5])
        assert grown <= 20, f"the router grew {grown:.1f} MB"
        assert stack.router.popen.poll() is None
        assert "edgeroute_mqtt_connected 1.0" in text
        assert call(f"{stack.router_url}/v2/models/sensor_mlp/infer", infer_body(), headers={
            "Authorization": f"Bearer {TOKENS['honest']}"})[0] == 200  # fmt: skip
    finally:
        attacker.loop_stop()
        attacker.disconnect()
        stack.stop()
