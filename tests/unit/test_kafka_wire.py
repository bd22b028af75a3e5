"""The lean Kafka reader's decoding: batches made by another implementation (kafka-python's builder),
cut-off and compressed batches, and generated mutations, which must end in KafkaWireError, never
another exception. Peers and the real broker: tests/integration/test_kafka_reader.py."""

from __future__ import annotations

import random
import struct

import pytest
from kafka.record.default_records import DefaultRecordBatchBuilder

from telemetry.kafka.codecs import Inflation
from telemetry.kafka.lean import LeanConsumer
from telemetry.kafka.reader import reader_kind
from telemetry.kafka.records import KafkaWireError, Reader, Record, TopicPartition, decode_batches


def batch(base: int, values: list[bytes | None], codec: int = 0, control: bool = False) -> bytes:
    builder = DefaultRecordBatchBuilder(2, codec, False, -1, -1, -1, 1 << 20)
    for i, value in enumerate(values):
        builder.append(i, timestamp=1_700_000_000_000 + i, key=b"k%d" % i, value=value, headers=[("h", b"x")])
    raw = bytearray(builder.build())
    raw[0:8] = struct.pack(">q", base)
    if control:  # a transaction marker: attributes bit 5; the CRC covers the attributes, so redo it
        import crc32c

        attrs = struct.unpack_from(">h", raw, 21)[0] | 0x20
        struct.pack_into(">h", raw, 21, attrs)
        struct.pack_into(">I", raw, 17, crc32c.crc32c(bytes(raw[21:])))
    return bytes(raw)


def compressed(raw: bytes, codec: int, body: bytes | None = None) -> bytes:
    """An uncompressed batch `raw` (or its header with records `body`) with its records compressed by
    `codec` as a Kafka client writes them (1 gzip, 2 snappy in the snappy-java framing, 3 lz4 frame,
    4 zstd), the attributes and CRC set."""
    import gzip

    import cramjam
    import crc32c

    records = raw[61:] if body is None else body
    if codec == 1:
        packed = gzip.compress(records)
    elif codec == 2:
        block = bytes(cramjam.snappy.compress_raw(records))
        packed = b"\x82SNAPPY\x00" + struct.pack(">ii", 1, 1) + struct.pack(">i", len(block)) + block
    elif codec == 3:
        packed = bytes(cramjam.lz4.compress(records))
    else:
        packed = bytes(cramjam.zstd.compress(records))
    out = bytearray(raw[:61]) + packed
    struct.pack_into(">i", out, 8, len(out) - 12)
    attrs = struct.unpack_from(">h", out, 21)[0]
    struct.pack_into(">h", out, 21, (attrs & ~7) | codec)
    struct.pack_into(">I", out, 17, crc32c.crc32c(bytes(out[21:])))
    return bytes(out)


def mutate(good: bytes, rng: random.Random, most_flips: int) -> bytearray:
    """`good` with up to `most_flips - 1` bytes changed, cut short three times in ten."""
    data = bytearray(good)
    for _ in range(rng.randrange(1, most_flips)):
        data[rng.randrange(len(data))] = rng.randrange(256)
    if rng.random() < 0.3:
        data = data[: rng.randrange(len(data))]
    return data


def decode(data: bytes, offset: int = 0) -> tuple[list[Record], int]:
    out: list[Record] = []
    after = decode_batches(memoryview(data), offset, out)
    return out, after


def test_batches_from_another_implementation_decode_to_their_offsets_and_values() -> None:
    data = batch(0, [b"a", None, b"c" * 300]) + batch(3, [b"d"])
    records, after = decode(data)
    assert records == [Record(0, b"a"), Record(1, None), Record(2, b"c" * 300), Record(3, b"d")]
    assert after == 4


def test_records_before_the_fetch_offset_are_skipped_and_a_cut_off_batch_waits() -> None:
    data = batch(10, [b"x", b"y", b"z"]) + batch(13, [b"w"])
    records, after = decode(data, 12)
    assert records == [Record(12, b"z"), Record(13, b"w")] and after == 14
    cut = data[: len(data) - 3]  # the last batch cut off by the broker's byte limit
    records, after = decode(cut, 10)
    assert [r.offset for r in records] == [10, 11, 12] and after == 13
    assert decode(cut[:40], 10) == ([], 10)  # less than one batch header: nothing yet


@pytest.mark.parametrize("codec", [1, 2, 3, 4])
def test_every_codec_kafka_defines_decodes(codec: int) -> None:
    values = [b"telemetry %d " % i * 20 for i in range(50)]
    records, after = decode(compressed(batch(5, values), codec))
    assert [r.value for r in records] == values and after == 55


def _read_around_the_bomb(bomb: bytes) -> None:
    """The bomb between two plain batches, read within a 1 MiB inflation budget: the batches around it
    are read, the bomb is dropped and named, and it was never inflated."""
    import tracemalloc

    data = batch(0, [b"before"]) + bomb + batch(2, [b"after"])
    out: list[Record] = []
    dropped: list[str] = []
    tracemalloc.start()
    try:
        after = decode_batches(memoryview(data), 0, out, Inflation(per_fetch=1 << 20), dropped)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [r.value for r in out] == [b"before", b"after"] and after == 3
    assert len(dropped) == 1 and "offsets 1-1" in dropped[0] and "inflates past" in dropped[0]
    assert peak < 8 << 20, f"{peak} bytes allocated: the bomb was inflated"


@pytest.mark.parametrize("codec", [1, 2, 3, 4])
def test_a_bomb_in_every_codec_is_dropped_at_the_bound_and_the_rest_is_read(codec: int) -> None:
    bomb_records = batch(1, [b"\0" * (24 << 20)])
    bomb = compressed(bomb_records, codec)
    _read_around_the_bomb(bomb)


def test_dropped_bombs_use_up_the_budget_of_their_fetch_and_of_the_second() -> None:
    """40 batches of 17 MiB of zeros in one partition (697 KB on the wire) were each inflated to the
    bound (640 MiB in one poll, 1.4 s of a router's CPU): the budget is now spent by the work done, so
    the first bomb spends it and the others are dropped without inflating."""
    import time

    bombs = b"".join(compressed(batch(i, [b"\0" * (17 << 20)]), 1) for i in range(40)) + batch(40, [b"ok"])
    inflation = Inflation(per_fetch=8 << 20, per_s=8 << 20)
    out: list[Record] = []
    dropped: list[str] = []
    started = time.process_time()
    assert decode_batches(memoryview(bombs), 0, out, inflation, dropped) == 41
    assert time.process_time() - started < 0.5
    assert [r.value for r in out] == [b"ok"] and len(dropped) == 40
    assert sum("budget is spent" in d for d in dropped) == 39, "one inflated to the bound, the rest not at all"
    assert inflation.available() < 8 << 20, "the second's budget is spent too: the next fetch gets less"


def test_control_batches_are_skipped_but_moved_past() -> None:
    records, after = decode(batch(0, [b"a"]) + batch(1, [b"marker"], control=True) + batch(2, [b"b"]))
    assert records == [Record(0, b"a"), Record(2, b"b")] and after == 3


def test_a_corrupted_batch_and_an_old_format_are_dropped_and_reading_goes_on() -> None:
    """Neither stalls the reader (an error raised here made it reconnect and read the same bytes again)
    nor makes it change readers (an Unsupported made it read with librdkafka from then on, whose
    inflation has no bound): each is dropped, named, its offsets passed."""
    data = bytearray(batch(0, [b"abc"]))
    data[-2] ^= 0xFF
    old = bytearray(batch(1, [b"def"]))
    old[16] = 1  # magic v1 (Kafka before 0.11)
    out: list[Record] = []
    dropped: list[str] = []
    after = decode_batches(memoryview(bytes(data) + bytes(old) + batch(2, [b"ghi"])), 0, out, None, dropped)
    assert [r.value for r in out] == [b"ghi"] and after == 3
    assert "CRC mismatch" in dropped[0] and "record format v1" in dropped[1]


def test_generated_mutations_are_dropped_or_raise_only_wire_errors() -> None:
    """Flipped, cut and spliced bytes, with the CRC recomputed so the record parser is reached too."""
    import crc32c

    rng = random.Random(7)
    good = batch(0, [b"v" * rng.randrange(0, 40) for _ in range(12)])
    for _ in range(3000):
        data = mutate(good, rng, 6)
        if rng.random() < 0.7 and len(data) > 21:
            struct.pack_into(">I", data, 17, crc32c.crc32c(bytes(data[21:])))
        try:
            records, after = decode(bytes(data))
        except KafkaWireError:
            continue
        assert after >= 0 and all(isinstance(r.offset, int) for r in records)


def test_which_reader_a_process_uses(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    monkeypatch.delenv("EDGEROUTE_KAFKA_READER", raising=False)
    monkeypatch.delenv("EDGEROUTE_KAFKA_CLIENT", raising=False)
    secured = "librdkafka" if importlib.util.find_spec("confluent_kafka") else "kafka-python"
    # the lean reader (which bounds what compressed batches inflate to) speaks plaintext and TLS
    assert reader_kind("PLAINTEXT") == reader_kind("SSL") == "lean"
    assert reader_kind("SASL_SSL") == reader_kind("SASL_PLAINTEXT") == secured
    monkeypatch.setenv("EDGEROUTE_KAFKA_CLIENT", "kafka-python")  # the fallback, as without confluent-kafka
    assert reader_kind("SASL_SSL") == "kafka-python" and reader_kind("PLAINTEXT") == "lean"
    monkeypatch.delenv("EDGEROUTE_KAFKA_CLIENT")
    monkeypatch.setenv("EDGEROUTE_KAFKA_READER", "kafka-python")
    assert reader_kind("PLAINTEXT") == "kafka-python"
    monkeypatch.setenv("EDGEROUTE_KAFKA_READER", "librdkafka")
    assert reader_kind("PLAINTEXT") == secured
    monkeypatch.setenv("EDGEROUTE_KAFKA_READER", "fast")
    with pytest.raises(ValueError, match="lean, librdkafka or kafka-python"):
        reader_kind("PLAINTEXT")
    monkeypatch.delenv("EDGEROUTE_KAFKA_READER")
    monkeypatch.setenv("EDGEROUTE_KAFKA_CLIENT", "fast")
    with pytest.raises(ValueError, match="EDGEROUTE_KAFKA_CLIENT"):
        reader_kind("SASL_SSL")


def fetch_answer(topic: str, parts: dict[int, bytes], high: int = 100) -> bytes:
    """A Fetch v4 answer (after the correlation id) carrying `parts`' record bytes."""
    name = topic.encode()
    out = struct.pack(">ii", 0, 1) + struct.pack(">h", len(name)) + name + struct.pack(">i", len(parts))
    for partition, data in parts.items():
        out += struct.pack(">ihqqi", partition, 0, high, high, 0) + struct.pack(">i", len(data)) + data
    return out


def test_a_fetch_answer_is_read_into_records_and_next_offsets() -> None:
    consumer = LeanConsumer("127.0.0.1:9")  # never connects: answers are handed to it
    t0, t1 = TopicPartition("t", 0), TopicPartition("t", 1)
    consumer.offsets = {t0: 0, t1: 5}
    out: dict[TopicPartition, list[Record]] = {}
    consumer._fetched(Reader(fetch_answer("t", {0: batch(0, [b"a", b"b"]), 1: batch(5, [b"c"]), 7: b""})), out)
    assert out == {t0: [Record(0, b"a"), Record(1, b"b")], t1: [Record(5, b"c")]}
    assert consumer.offsets == {t0: 2, t1: 6}  # partition 7 is not this reader's: ignored


def test_generated_fetch_answers_raise_only_wire_errors() -> None:
    rng = random.Random(11)
    good = fetch_answer("telemetry", {0: batch(0, [b"x" * 30] * 5), 1: batch(3, [b"y"] * 3)})
    for _ in range(3000):
        data = mutate(good, rng, 5)
        consumer = LeanConsumer("127.0.0.1:9")
        consumer.offsets = {TopicPartition("telemetry", 0): 0, TopicPartition("telemetry", 1): 3}
        consumer.end_offsets = lambda parts: dict.fromkeys(parts, 0)  # type: ignore[method-assign]
        out: dict[TopicPartition, list[Record]] = {}
        try:
            consumer._fetched(Reader(bytes(data)), out)
        except KafkaWireError:
            continue
        assert all(offset >= 0 for offset in consumer.offsets.values())


def test_a_compression_bomb_is_skipped_without_inflating_it_and_the_rest_is_read() -> None:
    """A gzip batch of a few hundred KB that inflates to hundreds of MB was inflated whole before its
    signature could be checked (a router went from 74 MB to 580 MB). Now inflation stops at the bound,
    the batch is passed and named, and the batches around it are read."""
    bomb = batch(1, [b"\0" * (48 << 20)], codec=1)  # 48 MB of zeros: about 47 KB compressed
    assert len(bomb) < 100_000
    _read_around_the_bomb(bomb)


def test_a_broker_answer_has_a_deadline_as_a_whole() -> None:
    """A broker that sends a byte every few seconds kept a per-read timeout from ever firing: telemetry
    stalled for good. The whole answer now has `timeout_s` (no socket: a fake one trickles)."""
    import time

    from telemetry.kafka import lean as kafkafetch

    class Trickle:
        def __init__(self) -> None:
            self.timeouts: list[float] = []
            self.sent = iter([0, 0, 1, 0])  # an answer of 256 bytes is announced, then it trickles

        def settimeout(self, t: float) -> None:
            self.timeouts.append(t)

        def recv_into(self, view: memoryview) -> int:
            time.sleep(0.03)  # one byte, well inside any one read's timeout
            view[0] = next(self.sent, 7)
            return 1

    conn = kafkafetch._Connection.__new__(kafkafetch._Connection)
    conn.sock, conn.where, conn.timeout_s = Trickle(), "fake:9092", 0.2  # type: ignore[assignment]
    conn._size = bytearray(4)
    started = time.monotonic()
    with pytest.raises(KafkaWireError, match="no whole answer within"):
        conn.receive(1)
    assert time.monotonic() - started < 1.0
    assert all(t <= 0.2 for t in conn.sock.timeouts)  # type: ignore[attr-defined]


def test_the_signature_header_is_read_and_other_headers_passed_over() -> None:
    builder = DefaultRecordBatchBuilder(2, 0, False, -1, -1, -1, 1 << 20)
    headers = [
        [("h", b"x"), ("edgeroute-sig", b"ER1 fleet 1 abc"), ("z", None)],
        [("edgeroute-sig", None)],
        [],
    ]
    for i, hs in enumerate(headers):
        builder.append(i, timestamp=1_700_000_000_000, key=None, value=b'{"v": %d}' % i, headers=hs)
    records, _ = decode(bytes(builder.build()))
    assert [r.sig for r in records] == [b"ER1 fleet 1 abc", None, None]
    assert [r.value for r in records] == [b'{"v": 0}', b'{"v": 1}', b'{"v": 2}']


def test_records_there_but_not_handed_over_lengthen_the_next_fetchs_wait() -> None:
    """A broker that gathers records only within the fetch's wait (Tansu's memory storage reads a
    partition in time that grows with its length) answered a 5 ms fetch empty for good once the
    router's peers topic grew: active-active routers stopped hearing each other mid-run. An empty answer
    with the high watermark past the offset now doubles the next wait (up to BEHIND_WAIT_MS) until
    records come; caught up at the end, the wait stays as configured."""
    from telemetry.kafka.lean import BEHIND_WAIT_MS

    consumer = LeanConsumer("127.0.0.1:9", fetch_max_wait_ms=5)
    tp = TopicPartition("peers", 0)
    consumer.offsets, consumer._leaders = {tp: 7}, {tp: 1}
    answers = [fetch_answer("peers", {0: b""}, high=50)] * 4 + [fetch_answer("peers", {0: batch(7, [b"x"])}, high=50)]
    answers += [fetch_answer("peers", {0: b""}, high=8)]  # caught up: nothing there to wait for
    waits: list[int] = []

    class Conn:
        def send(self, api: int, version: int, body: bytes) -> int:
            waits.append(struct.unpack_from(">ii", body)[1])
            return 1

        def receive(self, correlation: int, timeout_s: float) -> Reader:
            return Reader(answers.pop(0))

    consumer._leader = lambda node: Conn()  # type: ignore[assignment,method-assign,return-value]
    got = [consumer.poll() for _ in range(6)]
    assert waits == [5, 10, 20, 40, 80, 5] and consumer.behind_fetches == 4
    assert got[4] == {tp: [Record(7, b"x")]} and consumer.offsets[tp] == 8 and consumer.wait_ms == 5
    consumer.wait_ms = BEHIND_WAIT_MS
    answers += [fetch_answer("peers", {0: b""}, high=50)]
    consumer.poll()
    assert consumer.wait_ms == BEHIND_WAIT_MS, "never past the bound"
