"""The MQTT door's own reading of a request (router.mqtt_codec): every PUBLISH it reads, paho's decoder
reads the same (generated packets, and mutated and random bytes: where it is unsure it hands the packet
to paho), and the door's client hands paho every packet of a buffer read at once, split anywhere."""

from __future__ import annotations

import socket
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from paho.mqtt.client import mqtt_ms_wait_for_pubcomp
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from router.mqtt_codec import DoorClient, read_publish

NAMES = ("PayloadFormatIndicator", "MessageExpiryInterval", "ContentType", "ResponseTopic", "CorrelationData",
         "TopicAlias", "SubscriptionIdentifier", "UserProperty")  # fmt: skip
text = st.text(st.characters(codec="utf-8", exclude_characters="\x00\ufeff"), max_size=40)


def _paho(packet: bytes, qos: int) -> tuple[int, bytes, dict[str, Any], bytes]:
    """What paho's own decoder makes of the same bytes (raises where it cannot)."""
    n = int.from_bytes(packet[:2], "big")
    topic, at = packet[2 : 2 + n], 2 + n
    mid = 0
    if qos:
        mid, at = int.from_bytes(packet[at : at + 2], "big"), at + 2
    props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
    _, length = props.unpack(packet[at:])  # type: ignore[no-untyped-call]
    values = {name: getattr(props, name) for name in NAMES if hasattr(props, name)}
    return mid, topic, values, packet[at + length :]


def _packet(topic: bytes, mid: int, props: Properties, payload: bytes, qos: int) -> bytes:
    head = len(topic).to_bytes(2, "big") + topic + (mid.to_bytes(2, "big") if qos else b"")
    return head + bytes(props.pack()) + payload  # type: ignore[no-untyped-call]


@st.composite
def publishes(draw: Any) -> tuple[bytes, int]:
    props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
    if draw(st.booleans()):
        props.ResponseTopic = draw(text)
    if draw(st.booleans()):
        props.CorrelationData = draw(st.binary(max_size=64))
    if draw(st.booleans()):
        props.MessageExpiryInterval = draw(st.integers(0, 2**32 - 1))
    if draw(st.booleans()):
        props.ContentType = draw(text)
    if draw(st.booleans()):
        props.PayloadFormatIndicator = draw(st.integers(0, 1))
    if draw(st.booleans()):
        props.TopicAlias = draw(st.integers(1, 2**16 - 1))
    pairs = draw(st.lists(st.tuples(text, text), max_size=4))
    if pairs:
        props.UserProperty = pairs
    qos = draw(st.integers(0, 1))
    topic = draw(text).encode()
    packet = _packet(topic, draw(st.integers(1, 2**16 - 1)), props, draw(st.binary(max_size=200)), qos)
    return packet, qos


@settings(max_examples=400, deadline=None)
@given(publishes())
def test_a_request_reads_as_paho_reads_it(case: tuple[bytes, int]) -> None:
    packet, qos = case
    read = read_publish(packet, qos)
    assert read is not None
    mid, topic, props, payload = read
    assert (mid, topic, vars(props), payload) == _paho(packet, qos)


@settings(max_examples=1500, deadline=None)
@given(publishes(), st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=4), st.integers(0, 400))
def test_broken_bytes_are_read_as_paho_reads_them_or_left_to_it(
    case: tuple[bytes, int], flips: list[tuple[int, int]], cut: int
) -> None:
    packet, qos = case
    data = bytearray(packet[: max(0, len(packet) - cut)] if cut % 3 == 0 else packet)
    for at, value in flips:
        if data:
            data[at % len(data)] = value
    read = read_publish(bytes(data), qos)
    if read is not None:  # what it reads, paho reads the same; else paho's decoder gets the packet
        mid, topic, props, payload = read
        assert (mid, topic, vars(props), payload) == _paho(bytes(data), qos)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=120), st.integers(0, 1))
def test_random_bytes_never_raise(data: bytes, qos: int) -> None:
    read = read_publish(data, qos)
    if read is not None:
        mid, topic, props, payload = read
        assert (mid, topic, vars(props), payload) == _paho(data, qos)


def _fixed_header(command: int, body: bytes) -> bytes:
    out, n = bytearray([command]), len(body)
    while True:
        n, digit = n >> 7, n & 0x7F
        out.append(digit | (0x80 if n else 0))
        if not n:
            return bytes(out) + body


@settings(max_examples=30, deadline=None)
@given(st.lists(publishes(), min_size=1, max_size=12), st.integers(1, 200))
def test_the_client_hands_on_every_packet_of_a_buffer(cases: list[tuple[bytes, int]], split: int) -> None:
    """Packets written in two pieces cut anywhere, each piece read at once: every message reaches the
    door's callback, in order, with what paho would have read."""
    client = DoorClient(callback_api_version=CallbackAPIVersion.VERSION2, client_id="t", protocol=5)
    client.manual_ack_set(True)
    got: list[bytes | bytearray] = []
    client.on_message = lambda c, u, msg: got.append(msg.payload)
    ours, theirs = socket.socketpair()
    try:
        ours.setblocking(False)
        client._sock = ours  # (connected, as far as reading goes)
        stream = b"".join(_fixed_header(0x30 | (qos << 1), packet) for packet, qos in cases)
        for piece in (stream[:split], stream[split:]):
            if piece:
                theirs.sendall(piece)
                client.read_all()
        assert got == [_paho(packet, qos)[3] for packet, qos in cases]
        assert not client.buffered()
    finally:
        client._sock = None
        ours.close()
        theirs.close()


@settings(max_examples=60, deadline=None)
@given(st.binary(min_size=0, max_size=8), st.integers(1, 3))
def test_a_puback_for_an_answer_ends_it_as_pahos_own_decoder_does(packet: bytes, inflight: int) -> None:
    """The door's own reading of the broker's PUBACK (mid, and a reason code where one is sent) leaves
    the client as paho's does: the answer forgotten, its in-flight slot free; bytes it does not expect
    go to paho and raise where paho raises."""
    import paho.mqtt.client as mqtt
    from paho.mqtt.client import MQTTMessage, MQTTMessageInfo

    def client_with_answers(cls: Any = mqtt.Client) -> Any:
        c = cls(callback_api_version=CallbackAPIVersion.VERSION2, client_id="t", protocol=5)
        for mid in range(1, inflight + 1):
            m = MQTTMessage(mid)
            m.qos = 1
            m.info = MQTTMessageInfo(mid)
            c._out_messages[mid] = m
        c._inflight_messages = inflight
        c._in_packet["command"] = 0x40
        c._in_packet["packet"] = packet
        return c

    def outcome(c: Any, handle: Any) -> tuple[Any, ...]:
        try:
            rc = handle("PUBACK")
        except Exception as exc:  # noqa: BLE001 - the same failure either way
            return ("raised", type(exc).__name__)
        return (rc, sorted(c._out_messages), c._inflight_messages)

    theirs = client_with_answers()
    ours = client_with_answers(DoorClient)
    assert outcome(ours, ours._handle_pubackcomp) == outcome(theirs, theirs._handle_pubackcomp)
    for mid in (1, inflight):  # a PUBACK as Mosquitto sends it: the door's fast path
        ours = client_with_answers(DoorClient)
        ours._in_packet["packet"] = mid.to_bytes(2, "big")
        assert ours._handle_pubackcomp("PUBACK") == 0 and mid not in ours._out_messages
        assert ours._inflight_messages == inflight - 1


def _window_client(cls: Any, window: int) -> Any:
    """A client (paho's or the door's) with an in-flight window of `window` whose queued packets are
    recorded rather than written (both get the same recorder: what is compared is which answers they
    send, and when)."""
    c = cls(callback_api_version=CallbackAPIVersion.VERSION2, client_id="t", protocol=5)
    c.max_inflight_messages_set(window)
    c.max_queued_messages_set(64)
    c._sock = object()  # (connected, as far as publishing goes: nothing is written to it)
    c.sent = []
    c._packet_queue = lambda command, packet, mid, qos, info=None: c.sent.append(bytes(packet)) or 0
    return c


@settings(max_examples=150, deadline=None)
@given(
    st.integers(1, 4),
    st.lists(
        st.one_of(
            st.tuples(st.just("publish"), st.integers(1, 2)),
            st.tuples(st.just("puback"), st.integers(0, 7)),
            st.tuples(st.just("reconnect"), st.just(0)),
        ),
        max_size=40,
    ),
)
def test_answers_held_past_the_window_go_out_as_pahos_own_client_sends_them(window: int, steps: list[Any]) -> None:
    """Answers published past the in-flight window, freed by the broker's PUBACKs (the door's own reading
    and paho's) and put back by reconnections: the door's queue of held answers sends the same packets in
    the same order as paho's walk of every message, and leaves the same messages in the same states."""
    from paho.mqtt.client import Client

    ours, theirs = _window_client(DoorClient, window), _window_client(Client, window)
    try:
        for n, (op, arg) in enumerate(steps):
            for c in (ours, theirs):
                if op == "publish":
                    c.publish(f"a/{n}", f"answer {n}".encode(), qos=arg)
                elif op == "puback":
                    waiting = [mid for mid, m in c._out_messages.items() if m.state.name.startswith("MQTT_MS_WAIT")]
                    if not waiting:
                        continue
                    mid = waiting[arg % len(waiting)]
                    qos2 = c._out_messages[mid].qos == 2
                    c._in_packet["command"] = 0x70 if qos2 else 0x40
                    c._in_packet["packet"] = mid.to_bytes(2, "big")
                    if qos2:  # (a QoS 2 answer ends with PUBCOMP: what frees its slot there)
                        c._out_messages[mid].state = mqtt_ms_wait_for_pubcomp
                    c._handle_pubackcomp("PUBCOMP" if qos2 else "PUBACK")
                else:
                    c._messages_reconnect_reset_out()
            assert ours.sent == theirs.sent
            assert [(mid, m.state) for mid, m in ours._out_messages.items()] == [
                (mid, m.state) for mid, m in theirs._out_messages.items()
            ]
            assert ours._inflight_messages == theirs._inflight_messages
    finally:
        ours._sock = theirs._sock = None  # (nothing to close)
