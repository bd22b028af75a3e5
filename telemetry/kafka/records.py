"""Kafka's wire format as read: bounds-checked big-endian fields (`Reader`), v2 record batches with
their CRC-32C and compression (`decode_batches`), and the `edgeroute-sig` record header.

Everything a broker sends is checked as it is read: sizes against the bytes there, counts against
what those bytes can hold, each batch's CRC-32C; a bad answer raises `KafkaWireError`, never an
index error or a huge allocation. Compressed batches inflate within a bound (`MAX_INFLATED`).
"""

from __future__ import annotations

import struct
import zlib
from typing import NamedTuple

MAX_INFLATED = 16 << 20  # compressed batches of one partition's fetch inflate to this much at most

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


class Inflated(KafkaWireError):
    """A compressed record batch that inflates past the bytes allowed for it (a compression bomb)."""


def _decompress(codec: int, data: bytes, limit: int) -> bytes:
    """`data` inflated, never past `limit` bytes: gzip and zstd stop at the limit before allocating more;
    a bigger result is `Inflated` (snappy cannot grow past about 21x its input, itself bounded by the
    fetch; lz4's frame decoder takes the same bound)."""
    if codec == 1:
        inflater = zlib.decompressobj(47)  # gzip or zlib framing
        out = inflater.decompress(data, limit + 1)
    else:
        from kafka import codec as kc

        if codec == 2 and kc.has_snappy():
            out = bytes(kc.snappy_decode(data))
        elif codec == 3 and kc.has_lz4():
            import lz4.frame  # type: ignore[import-not-found]

            out = lz4.frame.LZ4FrameDecompressor().decompress(data, max_length=limit + 1)
        elif codec == 4 and kc.has_zstd():
            import io

            import zstandard  # type: ignore[import-not-found]

            with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data), read_across_frames=True) as reader:
                out = reader.read(limit + 1)
        else:
            raise Unsupported(f"record batch compressed with codec {codec}, whose library is not installed")
    if len(out) > limit:
        raise Inflated(f"a compressed record batch inflates past {limit} bytes")
    return out


def _crc32c(data: memoryview) -> int:
    import crc32c

    return int(crc32c.crc32c(data))


def decode_batches(
    data: memoryview,
    fetch_offset: int,
    out: list[Record],
    max_inflated: int = MAX_INFLATED,
    dropped: list[str] | None = None,
) -> int:
    """Append the records at or past `fetch_offset` of the v2 record batches in `data` to `out`; return the
    offset to fetch next. A batch cut off at the end (the broker's byte limit) is left for the next
    fetch; control batches (transaction markers) are skipped; a batch whose CRC does not match raises.
    Compressed batches inflate to `max_inflated` bytes at most, together: a batch that would go past it
    is skipped (its offsets passed, the reason appended to `dropped`), not retried forever."""
    pos, end, next_offset = 0, len(data), fetch_offset
    budget = max_inflated
    while end - pos > 16:
        if data[pos + 16] != 2:  # the magic byte sits here in every message format
            raise Unsupported(f"record format v{data[pos + 16]}; this reader reads v2 (Kafka 0.11 and later)")
        if end - pos < _BATCH.size:
            break
        (base, length, _epoch, _magic, crc, attrs, last_delta, _t0, _tmax, _pid, _pe, _seq, n) = _BATCH.unpack_from(
            data, pos
        )
        if length < _BATCH.size - 12:
            raise KafkaWireError("record batch shorter than its header")
        stop = pos + 12 + length
        if stop > end:
            break  # cut off by the byte limit: fetched whole next time
        if _crc32c(data[pos + 21 : stop]) != crc:
            raise KafkaWireError(f"record batch at offset {base}: CRC mismatch")
        after = base + last_delta + 1
        if after > next_offset and not attrs & 0x20:
            body = bytes(data[pos + _BATCH.size : stop])
            if attrs & 7:
                try:
                    body = _decompress(attrs & 7, body, budget)
                except Inflated as exc:
                    if dropped is not None:
                        dropped.append(f"offsets {base}-{after - 1}: {exc}")
                    body = b""
                    n = 0
                budget -= len(body)
            _records(body, base, n, next_offset, out)
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
