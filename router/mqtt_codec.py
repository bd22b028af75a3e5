"""The MQTT door's codec where paho's costs a request's CPU: a request's PUBLISH read, an answer's
properties written, and the socket read a buffer at a time.

paho-mqtt stays the door's MQTT client (connect, sessions, QoS, keepalive, what it sends). Measured on
the development machine (`edgeroute bench devices`, docs/measurements.md): its generic `Properties`
took ~49 us to read a request's properties and ~42 us to set and pack an answer's, and it reads a
packet with a system call per field (a byte, the length's bytes, the rest: ~8 `recvfrom` a request
with its answer's PUBACK), where a whole request costs the router ~400-500 us of CPU over HTTP. Here:
a PUBLISH at QoS 0 or 1 is read by `read_publish` (~5 us), an answer's properties are packed by
`AnswerProperties` (~3 us), and `DoorClient` reads the socket 64 KiB at a time. Anything
`read_publish` does not expect (a property a request does not carry twice, a string MQTT forbids, a
length past the packet, QoS 2) goes to paho's own decoder, which raises as it always has.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, cast

import paho.mqtt.client as mqtt
from paho.mqtt.enums import MQTTErrorCode
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

READ_CHUNK = 65_536  # bytes asked of the socket at once
# the reason codes MQTT v5 gives a PUBACK (section 3.4.2.1)
PUBACK_REASONS = frozenset({0x00, 0x10, 0x80, 0x83, 0x87, 0x90, 0x91, 0x97, 0x99})

MAX_PROPERTY_STRING = 65_535  # an MQTT UTF-8 string or binary field: a 16-bit length


def _field(data: bytes) -> bytes:
    if len(data) > MAX_PROPERTY_STRING:
        raise ValueError(f"an MQTT property field of {len(data)} bytes (at most {MAX_PROPERTY_STRING})")
    return len(data).to_bytes(2, "big") + data


def varint(n: int) -> bytes:
    """`n` as MQTT's variable byte integer (a remaining length, a property block's length)."""
    out = bytearray()
    while True:
        n, digit = n >> 7, n & 0x7F
        out.append(digit | (0x80 if n else 0))
        if not n:
            return bytes(out)


class AnswerProperties(Properties):
    """An answer's MQTT v5 PUBLISH properties, encoded here once for paho to send as they are.

    paho's generic `Properties` checks and looks up every property by name as it is set and packs them
    one by one: ~40 us an answer on the development machine, where a whole request costs the router
    ~400 us of CPU over HTTP (measured with `edgeroute bench devices`; docs/measurements.md). This
    encodes what an answer carries (content type, correlation data, user properties, message expiry)
    in ~3 us: the same bytes paho's `unpack` reads back (tests/unit/test_mqtt_answer_properties.py)."""

    _packed: bytes
    _shown: tuple[str, bytes, list[tuple[str, str]], int | None]

    def __init__(
        self,
        content_type: str,
        correlation: bytes,
        user: list[tuple[str, str]],
        expiry_s: int | None = None,
    ) -> None:
        # (not Properties.__init__: paho reads `pack`, `packetType`, and `str` where it logs)
        self.packetType = PacketTypes.PUBLISH
        shown = (content_type, correlation, user, expiry_s)
        body = bytearray()
        if expiry_s is not None:
            body += b"\x02" + expiry_s.to_bytes(4, "big")
        body += b"\x03" + _field(content_type.encode())
        if correlation:
            body += b"\x09" + _field(correlation)
        for name, value in user:
            body += b"\x26" + _field(name.encode()) + _field(value.encode())
        # (paho's __setattr__ takes only property names: these go past it)
        object.__setattr__(self, "_shown", shown)
        object.__setattr__(self, "_packed", varint(len(body)) + bytes(body))

    def pack(self) -> bytes:
        return self._packed

    def __str__(self) -> str:
        content_type, correlation, user, expiry = self._shown
        return f"[ContentType : {content_type}, CorrelationData : {correlation!r}, UserProperty : {user}, " \
            f"MessageExpiryInterval : {expiry}]"  # fmt: skip

    __repr__ = __str__


class RequestProperties:
    """A request's MQTT v5 PUBLISH properties under paho's names (`ResponseTopic`, `UserProperty`, ...):
    only those the packet carries are set, so `getattr(props, name, default)` reads as with paho's."""

    def __str__(self) -> str:
        return "[" + ", ".join(f"{k} : {v}" for k, v in vars(self).items()) + "]"

    __repr__ = __str__


# property identifier -> (paho's name, kind); the second table's may come more than once
_ONCE = {
    0x01: ("PayloadFormatIndicator", "byte"),
    0x02: ("MessageExpiryInterval", "int32"),
    0x03: ("ContentType", "utf8"),
    0x08: ("ResponseTopic", "utf8"),
    0x09: ("CorrelationData", "binary"),
    0x23: ("TopicAlias", "int16"),
}
_MANY = {0x0B: ("SubscriptionIdentifier", "varint"), 0x26: ("UserProperty", "pair")}
_SIZES = {"byte": 1, "int16": 2, "int32": 4}  # bytes of the fixed-size integer kinds
_RANGES = {0x01: (0, 1), 0x23: (1, 65_535), 0x0B: (1, 268_435_455)}  # values paho accepts
_FORBIDDEN = (b"\x00", b"\xef\xbb\xbf")  # U+0000 and U+FEFF: MQTT-1.5.4-2, -3 (surrogates fail decoding)


def read_varint(data: bytes | bytearray, at: int, end: int) -> tuple[int, int] | None:
    """A variable byte integer at `at` (at most 4 bytes, before `end`): its value and where it ends;
    None where it does not end in time."""
    value = shift = 0
    for i in range(at, min(at + 4, end)):
        byte = data[i]
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, i + 1
        shift += 7
    return None


def _string(data: bytes, at: int, end: int) -> tuple[str, int] | None:
    if at + 2 > end:
        return None
    stop = at + 2 + int.from_bytes(data[at : at + 2], "big")
    if stop > end:
        return None
    raw = data[at + 2 : stop]
    if _FORBIDDEN[0] in raw or _FORBIDDEN[1] in raw:
        return None
    try:
        return raw.decode("utf-8"), stop
    except UnicodeDecodeError:
        return None


def read_publish(packet: bytes | bytearray, qos: int) -> tuple[int, bytes, RequestProperties, bytes] | None:
    """(packet id, topic, properties, payload) of an MQTT v5 PUBLISH's variable header and payload
    (`packet`: what follows its fixed header), or None where it is not as a request is expected to be."""
    data = bytes(packet)
    end = len(data)
    if end < 2:
        return None
    at = 2 + int.from_bytes(data[:2], "big")
    if at > end:
        return None
    topic = data[2:at]
    mid = 0
    if qos:
        if at + 2 > end:
            return None
        mid = int.from_bytes(data[at : at + 2], "big")
        at += 2
    read = read_varint(data, at, end)
    if read is None:
        return None
    length, at = read
    stop = at + length
    if stop > end:
        return None
    props = RequestProperties()
    seen = props.__dict__
    while at < stop:
        ident = data[at]
        at += 1
        once = _ONCE.get(ident)
        name, kind = once if once is not None else _MANY.get(ident, ("", ""))
        if not name or (once is not None and name in seen):
            return None
        value: Any
        if kind == "utf8":
            got = _string(data, at, stop)
            if got is None:
                return None
            value, at = got
        elif kind == "binary":
            if at + 2 > stop:
                return None
            nxt = at + 2 + int.from_bytes(data[at : at + 2], "big")
            if nxt > stop:
                return None
            value, at = data[at + 2 : nxt], nxt
        elif kind == "pair":
            first = _string(data, at, stop)
            second = None if first is None else _string(data, first[1], stop)
            if first is None or second is None:
                return None
            value, at = (first[0], second[0]), second[1]
        elif kind == "varint":
            got_int = read_varint(data, at, stop)
            if got_int is None:
                return None
            value, at = got_int
        else:
            size = _SIZES[kind]
            if at + size > stop:
                return None
            value, at = int.from_bytes(data[at : at + size], "big"), at + size
        low, high = _RANGES.get(ident, (0, 2**32))
        if not isinstance(value, (str, bytes, tuple)) and not low <= value <= high:
            return None  # (a value paho refuses)
        if once is None:
            seen.setdefault(name, []).append(value)
        else:
            seen[name] = value
    return mid, topic, props, data[stop:]


class DoorClient(mqtt.Client):
    """paho's client with the door's reading: the socket a buffer at a time (`read_all` empties it) and
    a request's PUBLISH read by `read_publish`, handed on as paho hands on a message; and answers held
    past the in-flight window kept in a queue of their own (`_update_inflight`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._buffer = b""
        self._taken = 0  # bytes of `_buffer` handed to paho already
        self._buffered_from: Any = None  # the socket `_buffer` came from
        # answers paho holds back (state queued: the in-flight window was full), in the order it would
        # send them; an entry whose message has since gone or been sent is skipped when reached
        self._held: deque[mqtt.MQTTMessage] = deque()

    def publish(
        self,
        topic: str,
        payload: Any = None,
        qos: int = 0,
        retain: bool = False,
        properties: Properties | None = None,
    ) -> mqtt.MQTTMessageInfo:
        info = super().publish(topic, payload, qos, retain, properties)
        message = self._out_messages.get(info.mid)
        if message is not None and message.state == mqtt.mqtt_ms_queued and message.info is info:
            self._held.append(message)
        return info

    def _messages_reconnect_reset_out(self) -> None:
        super()._messages_reconnect_reset_out()
        with self._out_message_mutex:  # (a new window: paho has put what does not fit in it back in queue)
            self._held = deque(m for m in self._out_messages.values() if m.state == mqtt.mqtt_ms_queued)

    def _update_inflight(self) -> MQTTErrorCode:
        """What paho does when an answer's PUBACK frees a slot of the in-flight window: send the answers
        it held back, oldest first, while the window has room. paho walks every message it holds for
        that, in flight or not, at every PUBACK (~1,000 in flight past capacity: a quarter of the door's
        CPU, measured with `edgeroute bench overload`); this takes them from the queue of held ones. The
        caller holds `_out_message_mutex`, as paho's does."""
        held, out = self._held, self._out_messages
        while held and self._inflight_messages < self._max_inflight_messages:
            m = held.popleft()
            if out.get(m.mid) is not m or m.qos == 0 or m.state != mqtt.mqtt_ms_queued:
                continue  # (answered, dropped at a reconnect, or sent another way since)
            self._inflight_messages += 1
            m.state = mqtt.mqtt_ms_wait_for_puback if m.qos == 1 else mqtt.mqtt_ms_wait_for_pubrec
            rc = self._send_publish(m.mid, m.topic.encode("utf-8"), m.payload, m.qos, m.retain, m.dup,
                                    properties=m.properties)  # fmt: skip
            if rc != MQTTErrorCode.MQTT_ERR_SUCCESS:
                return rc
        return MQTTErrorCode.MQTT_ERR_SUCCESS

    def _sock_recv(self, bufsize: int) -> bytes:
        if self._buffered_from is not self._sock:  # (a new connection: nothing kept from the last)
            self._buffer, self._taken, self._buffered_from = b"", 0, self._sock
        if self._taken >= len(self._buffer):
            data: bytes = super()._sock_recv(max(bufsize, READ_CHUNK))
            if len(data) <= bufsize:
                return data
            self._buffer, self._taken = data, 0
        out = self._buffer[self._taken : self._taken + bufsize]
        self._taken += len(out)
        return out

    def buffered(self) -> bool:
        """Bytes read from the socket that paho has not taken yet."""
        return self._taken < len(self._buffer) and self._buffered_from is self._sock

    def read_all(self) -> None:
        """What the socket has, and what is buffered from it, handed to paho (the socket's reader on the
        loop: buffered bytes would not wake it again)."""
        while self.loop_read() == MQTTErrorCode.MQTT_ERR_SUCCESS and self.buffered():
            pass

    def _handle_pubackcomp(self, cmd: Any) -> MQTTErrorCode:
        """The broker's PUBACK for one of the door's answers: ~2 us here where paho makes a reason code
        and a property set for each (~15 us) that only an `on_publish` callback, which the door has
        not, would read. What this does not expect (a PUBCOMP, properties, a reason code PUBACK does not
        have) goes to paho, which decodes it and raises as it always has."""
        packet = self._in_packet["packet"]
        if (
            cmd != "PUBACK"
            or self.on_publish is not None
            or self._protocol != mqtt.MQTTv5
            or not (len(packet) == 2 or (len(packet) == 3 and packet[2] in PUBACK_REASONS))
        ):
            return super()._handle_pubackcomp(cmd)
        mid = (packet[0] << 8) | packet[1]
        with self._out_message_mutex:
            if mid in self._out_messages:
                return self._do_on_publish(mid, None, None)  # type: ignore[arg-type]  # (read only by on_publish)
        return MQTTErrorCode.MQTT_ERR_SUCCESS

    def _handle_publish(self) -> MQTTErrorCode:
        header = self._in_packet["command"]
        qos = (header & 0x06) >> 1
        read = read_publish(self._in_packet["packet"], qos) if qos < 2 and self._protocol == mqtt.MQTTv5 else None
        if read is None:
            return super()._handle_publish()
        mid, topic, props, payload = read
        message = mqtt.MQTTMessage(mid=mid, topic=topic)
        message.dup = bool(header & 0x08)
        message.qos = qos
        message.retain = bool(header & 0x01)
        message.properties = cast(Properties, props)
        message.payload = payload
        message.timestamp = time.monotonic()
        self._handle_on_message(message)
        if qos == 1 and not self._manual_ack:
            return self._send_puback(mid)
        return MQTTErrorCode.MQTT_ERR_SUCCESS
