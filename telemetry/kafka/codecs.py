"""Every compression codec Kafka defines (gzip, snappy, lz4, zstd), inflated within a bound.

A compressed record batch is hostile input: a few hundred kilobytes of gzip can inflate to gigabytes.
Each batch here inflates into at most `limit` bytes: gzip through zlib's own `max_length`, the others
through cramjam's `decompress_into`, which writes into a buffer of that size and fails, having
allocated nothing more, where the output would not fit; snappy's sizes are read from its framing first.
A batch that would inflate past its limit is `Inflated`; one that does not decode is `Corrupt`.

`Inflation` is what one reader may spend: `per_fetch` bytes for one partition's fetch and `per_s`
bytes a second over all of them (a token bucket), so records compressed to be inflated cannot buy
more than that much memory at once or that much CPU a second, whatever arrives. Telemetry as edgeroute
publishes it is not compressed at all, and never waits on this budget.
"""

from __future__ import annotations

import threading
import time
import zlib

import cramjam

GZIP, SNAPPY, LZ4, ZSTD = 1, 2, 3, 4
CODECS = {GZIP: "gzip", SNAPPY: "snappy", LZ4: "lz4", ZSTD: "zstd"}
_XERIAL = b"\x82SNAPPY\x00"  # the snappy-java framing Kafka's clients write (8 bytes, then 2 x int32)


class Undecodable(Exception):
    """A compressed record batch that is not inflated (the reader drops it and counts it)."""


class Inflated(Undecodable):
    """A compressed record batch that inflates past the bytes allowed for it (a compression bomb)."""


class Corrupt(Undecodable):
    """A compressed record batch that does not decode."""


class Inflation:
    """The inflation one reader may spend (see the module docstring). Thread-safe."""

    def __init__(self, per_fetch: int = 8 << 20, per_s: int = 32 << 20) -> None:
        self.per_fetch = per_fetch
        self.per_s = per_s
        self._tokens = float(per_s)
        self._at = time.monotonic()
        self._lock = threading.Lock()

    def available(self) -> int:
        """Bytes that may be inflated now (at most one fetch's)."""
        with self._lock:
            now = time.monotonic()
            self._tokens = min(float(self.per_s), self._tokens + (now - self._at) * self.per_s)
            self._at = now
            return int(min(self._tokens, self.per_fetch))

    def spend(self, n: int) -> None:
        with self._lock:
            self._tokens -= n


_scratch = threading.local()


def _buffer(size: int) -> memoryview:
    """A scratch buffer of at least `size` bytes for this thread (kept for the next batch)."""
    buf: bytearray | None = getattr(_scratch, "buf", None)
    if buf is None or len(buf) < size:
        buf = _scratch.buf = bytearray(size)
    return memoryview(buf)[:size]


def inflate(codec: int, data: bytes, limit: int) -> bytes:
    """`data` inflated, never past `limit` bytes (Inflated past it, Corrupt when it does not decode)."""
    if codec == GZIP:
        inflater = zlib.decompressobj(47)  # gzip or zlib framing
        try:
            out = inflater.decompress(data, limit + 1)
        except zlib.error as exc:
            raise Corrupt(f"gzip: {exc}") from None
        if len(out) > limit:
            raise Inflated(f"a compressed record batch inflates past {limit} bytes")
        return out
    if codec == SNAPPY:
        return _snappy(data, limit)
    if codec not in (LZ4, ZSTD):
        raise Corrupt(f"compression codec {codec} is not one Kafka defines")
    module = cramjam.lz4 if codec == LZ4 else cramjam.zstd
    out_view = _buffer(limit + 1)  # (one byte more: a result that fills it did not fit)
    try:
        n = int(module.decompress_into(data, out_view))
    except cramjam.DecompressionError as exc:
        if "whole buffer" in str(exc):
            raise Inflated(f"a compressed record batch inflates past {limit} bytes") from None
        raise Corrupt(f"{CODECS[codec]}: {exc}") from None
    if n > limit:
        raise Inflated(f"a compressed record batch inflates past {limit} bytes")
    return bytes(out_view[:n])


def _varint_u32(data: bytes | memoryview, pos: int) -> tuple[int, int]:
    """An unsigned varint (snappy's uncompressed length): (value, next position)."""
    value = shift = 0
    while pos < len(data) and shift <= 28:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
    raise Corrupt("snappy: bad length")


def _raw_snappy(block: bytes | memoryview, limit: int) -> bytes:
    size, _ = _varint_u32(block, 0)
    if size > limit:
        raise Inflated(f"a compressed record batch inflates past {limit} bytes")
    out_view = _buffer(size)
    try:
        n = int(cramjam.snappy.decompress_raw_into(bytes(block), out_view))
    except cramjam.DecompressionError as exc:
        raise Corrupt(f"snappy: {exc}") from None
    return bytes(out_view[:n])


def _snappy(data: bytes, limit: int) -> bytes:
    """Kafka's snappy: the snappy-java framing (chunks of raw snappy, each with its length) or a raw
    block; every block's inflated length is read before it is inflated."""
    if not data.startswith(_XERIAL):
        return _raw_snappy(data, limit)
    pos, parts, total = 16, [], 0
    view = memoryview(data)
    while pos < len(data):
        if pos + 4 > len(data):
            raise Corrupt("snappy: chunk cut short")
        n = int.from_bytes(data[pos : pos + 4], "big")
        pos += 4
        if n < 0 or pos + n > len(data):
            raise Corrupt("snappy: chunk longer than the batch")
        part = _raw_snappy(view[pos : pos + n], limit - total)
        total += len(part)
        parts.append(part)
        pos += n
    return b"".join(parts)
