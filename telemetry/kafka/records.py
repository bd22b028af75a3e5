"""Kafka's wire format as read: bounds-checked big-endian fields (`Reader`), v2 record batches with
their CRC-32C and compression (`decode_batches`), and the `edgeroute-sig` record header.

Everything a broker sends is checked as it is read: sizes against the bytes there, counts against
what those bytes can hold, each batch's CRC-32C; a bad answer raises `KafkaWireError`, never an
index error or a huge allocation, and a bad batch in the log is dropped and counted, never retried
(`decode_batches`). Compressed batches inflate within a bound (telemetry.kafka.codecs).
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from telemetry.kafka.codecs import Inflated, Inflation, Undecodable, inflate

I16 = struct.Struct(">h")
I32 = struct.Struct(">i")
I64 = struct.Struct(">q")
_BATCH = struct.Struct(">qiibIhiqqqhii")  # record batch v2 header, 61 bytes


class KafkaWireError(Exception):
    """The broker could not be reached, answered with an error, or sent what is not Kafka."""


class Unsupported(KafkaWireError):
    """The broker or the data needs what this reader does not speak; read with kafka-python instead."""


class TopicPartition(NamedTuple):
    topic: str
    partition: int


class Record(NamedTuple):
    offset: int
    value: bytes | None
    sig: bytes | None = None  # its `edgeroute-sig` header (telemetry.kafka.signing), where it has one


_SIG = b"edgeroute-sig"


class Reader:
    """Reads big-endian fields from a broker's answer; every read is bounds-checked."""

    __slots__ = ("buf", "pos")

    def __init__(self, buf: bytes | bytearray | memoryview, pos: int = 0) -> None:
        self.buf = buf
        self.pos = pos

    def _take(self, n: int) -> int:
        pos = self.pos
        if n < 0 or pos + n > len(self.buf):
            raise KafkaWireError("answer shorter than its fields")
        self.pos = pos + n
        return pos

    def i8(self) -> int:
        return self.buf[self._take(1)]  # booleans and the record batch magic

    def i16(self) -> int:
        return int(I16.unpack_from(self.buf, self._take(2))[0])

    def i32(self) -> int:
        return int(I32.unpack_from(self.buf, self._take(4))[0])

    def i64(self) -> int:
        return int(I64.unpack_from(self.buf, self._take(8))[0])

    def fields(self, layout: struct.Struct) -> tuple[int, ...]:
        return layout.unpack_from(self.buf, self._take(layout.size))

    def count(self, least_size: int) -> int:
        """An array's length (-1, null, is 0), no more than the bytes left can hold."""
        n = self.i32()
        if n < 0:
            return 0
        if n * least_size > len(self.buf) - self.pos:
            raise KafkaWireError("array longer than the answer")
        return n

    def string(self) -> str:
        n = self.i16()
        if n < 0:
            return ""
        start = self._take(n)
        try:
            return bytes(self.buf[start : start + n]).decode()
        except UnicodeDecodeError:
            raise KafkaWireError("string not UTF-8") from None

    def blob(self) -> memoryview:
        n = self.i32()
        if n < 0:
            return memoryview(b"")
        start = self._take(n)
        return memoryview(self.buf)[start : start + n]


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    """A zig-zag varint at `pos`: (value, next position)."""
    shift = result = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise KafkaWireError("record cut short")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return (result >> 1) ^ -(result & 1), pos
        shift += 7


def _crc32c(data: memoryview) -> int:
    import crc32c

    return int(crc32c.crc32c(data))


MAX_DELTA = 1 << 30  # a batch's last offset delta past this is not a real batch's


def decode_batches(
    data: memoryview,
    fetch_offset: int,
    out: list[Record],
    inflation: Inflation | None = None,
    dropped: list[str] | None = None,
) -> int:
    """Append the records at or past `fetch_offset` of the record batches in `data` to `out`; return the
    offset to fetch next. A batch cut off at the end (the broker's byte limit) is left for the next
    fetch; control batches (transaction markers) are skipped.

    Everything else that is not a readable v2 batch is dropped, its offsets passed and the reason
    appended to `dropped`, and reading goes on: a batch whose CRC does not match, one whose records do
    not hold together, one in an older message format, one whose compression does not decode or
    inflates past what `inflation` allows (every Kafka codec, telemetry.kafka.codecs: at most one
    fetch's budget for all the batches of this fetch together, within the reader's bytes a second).
    A header that does not frame a batch ends this fetch past the offset it names. So no content of
    the log can stall a reader, make it retry the same bytes forever, or change which reader reads."""
    inflation = inflation or Inflation()
    pos, end, next_offset = 0, len(data), fetch_offset
    budget = None  # inflation allowed for this fetch, asked for at the first compressed batch

    def drop(base: int, after: int, why: str) -> None:
        if dropped is not None:
            dropped.append(f"offsets {base}-{after - 1}: {why}")

    while end - pos > 16:
        if end - pos < _BATCH.size:
            break
        (base, length, _epoch, magic, crc, attrs, last_delta, _t0, _tmax, _pid, _pe, _seq, n) = _BATCH.unpack_from(
            data, pos
        )
        stop = pos + 12 + length
        sane = 0 <= last_delta < MAX_DELTA
        after = base + last_delta + 1 if sane else base + 1
        if length < (_BATCH.size - 12 if magic == 2 else 14) or (magic == 2 and not sane):
            # nothing after it can be framed: on past it, never back (a broker sending this is broken;
            # an offset past its log is answered out of range, and reading resumes at the end)
            drop(base, after, "a record batch header that frames nothing")
            return int(max(next_offset + 1, after))
        if stop > end:
            break  # cut off by the byte limit: fetched whole next time
        if magic != 2:  # a v0/v1 message set: (offset, size) frame it, and its last offset is `base`
            if base >= next_offset:
                drop(base, base + 1, f"record format v{magic}; this reader reads v2 (Kafka 0.11 and later)")
            next_offset = max(next_offset, base + 1)
            pos = stop
            continue
        if _crc32c(data[pos + 21 : stop]) != crc:
            if after > next_offset:
                drop(base, after, "CRC mismatch")
        elif after > next_offset and not attrs & 0x20:
            body = bytes(data[pos + _BATCH.size : stop])
            try:
                if attrs & 7:
                    if budget is None:
                        budget = inflation.available()
                    if budget <= 0:
                        raise Inflated("this reader's inflation budget is spent for now")
                    try:
                        body = inflate(attrs & 7, body, budget)
                    except Inflated:
                        inflation.spend(budget)  # (the work was done up to the limit)
                        budget = 0
                        raise
                    inflation.spend(len(body))
                    budget -= len(body)
                found: list[Record] = []
                _records(body, base, n, next_offset, found)
                out.extend(found)
            except (Undecodable, KafkaWireError) as exc:
                drop(base, after, str(exc))
        next_offset = max(next_offset, after)
        pos = stop
    return next_offset


def _records(body: bytes, base: int, n: int, skip_below: int, out: list[Record]) -> None:
    pos, size = 0, len(body)
    if n < 0 or n > size:
        raise KafkaWireError("record count larger than the batch")
    for _ in range(n):
        length, pos = _varint(body, pos)
        stop = pos + length
        if length < 0 or stop > size:
            raise KafkaWireError("record longer than its batch")
        pos += 1  # attributes
        _ts, pos = _varint(body, pos)
        delta, pos = _varint(body, pos)
        key_len, pos = _varint(body, pos)
        pos += max(key_len, 0)
        value_len, pos = _varint(body, pos)
        if value_len < 0:
            value = None
        elif pos + value_len > stop:
            raise KafkaWireError("record value longer than the record")
        else:
            value = body[pos : pos + value_len]
        if base + delta >= skip_below:
            sig = _signature(body, pos + max(value_len, 0), stop) if pos + max(value_len, 0) < stop else None
            out.append(Record(base + delta, value, sig))
        pos = stop


def _signature(body: bytes, pos: int, stop: int) -> bytes | None:
    """The `edgeroute-sig` header among a record's headers (between `pos` and `stop`), else None."""
    count, pos = _varint(body, pos)
    if count < 0 or count > stop - pos:
        raise KafkaWireError("header count larger than the record")
    found = None
    for _ in range(count):
        key_len, pos = _varint(body, pos)
        if key_len < 0 or pos + key_len > stop:
            raise KafkaWireError("header key longer than the record")
        key = body[pos : pos + key_len]
        pos += key_len
        value_len, pos = _varint(body, pos)
        if value_len > 0 and pos + value_len > stop:
            raise KafkaWireError("header value longer than the record")
        if key == _SIG and value_len >= 0:
            found = body[pos : pos + value_len]
        pos += max(value_len, 0)
    return found
