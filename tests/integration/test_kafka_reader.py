"""The lean Kafka reader (telemetry.kafka.lean) against the real broker, next to kafka-python's
consumer on the same records; and against peers that are not honest brokers, which must end in
KafkaWireError, never another exception, a hang or a huge allocation."""

from __future__ import annotations

import shutil
import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest
from kafka import KafkaConsumer, KafkaProducer
from kafka import TopicPartition as KafkaTopicPartition

from scenarios.stack.broker import EmbeddedBroker
from telemetry.cluster.store import ViewStore
from telemetry.kafka import lean as kafkafetch
from telemetry.kafka.bus import TelemetryPublisher, ensure_topic
from telemetry.kafka.lean import LeanConsumer
from telemetry.kafka.reader import KafkaTelemetrySource
from telemetry.kafka.records import KafkaWireError, TopicPartition, Unsupported
from tests.helpers import load


def produce(bootstrap: str, topic: str, values: list[bytes | None], timestamp_ms: int, **options: object) -> None:
    producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=2, **options)
    try:
        for i, value in enumerate(values):
            producer.send(topic, key=b"n%d" % (i % 5), value=value, timestamp_ms=timestamp_ms)
        producer.flush()
    finally:
        producer.close()


def read_lean(consumer: LeanConsumer, want: int) -> dict[int, list[tuple[int, bytes | None]]]:
    got: dict[int, list[tuple[int, bytes | None]]] = {}
    deadline = time.monotonic() + 20
    while sum(map(len, got.values())) < want:
        assert time.monotonic() < deadline, sum(map(len, got.values()))
        for tp, records in consumer.poll().items():
            got.setdefault(tp.partition, []).extend((r.offset, r.value) for r in records)
    return got


def test_the_lean_reader_reads_what_kafka_python_reads(broker: EmbeddedBroker) -> None:
    topic = "edgeroute.test.lean-ab"
    ensure_topic(broker.bootstrap, topic, partitions=4)
    now = int(time.time() * 1000)
    values: list[bytes | None] = [b"v%d" % i * (i % 40) for i in range(600)] + [None]
    produce(broker.bootstrap, topic, values[:300], now)
    produce(broker.bootstrap, topic, values[300:], now, compression_type="gzip")

    lean = LeanConsumer(broker.bootstrap, fetch_max_wait_ms=5, partition_max_bytes=2048)  # many fetches
    try:
        parts = lean.partitions(topic)
        assert parts == [0, 1, 2, 3]
        lean.seek_times({TopicPartition(topic, p): now - 60_000 for p in parts})
        got = read_lean(lean, len(values))
    finally:
        lean.close()

    reference = KafkaConsumer(bootstrap_servers=broker.bootstrap, enable_auto_commit=False, group_id=None)
    try:
        tps = [KafkaTopicPartition(topic, p) for p in parts]
        reference.assign(tps)
        reference.seek_to_beginning()
        want: dict[int, list[tuple[int, bytes | None]]] = {}
        deadline = time.monotonic() + 20
        while sum(map(len, want.values())) < len(values):
            assert time.monotonic() < deadline
            for tp, records in reference.poll(timeout_ms=200).items():
                want.setdefault(tp.partition, []).extend((r.offset, r.value) for r in records)
    finally:
        reference.close()
    assert got == want  # same records, same offsets, each once, in order


def test_lookups_agree_with_kafka_python_and_a_lost_offset_restarts_at_the_end(broker: EmbeddedBroker) -> None:
    """Where reading starts is the broker's answer (some brokers date records by arrival), so the lean
    reader's lookups are held to kafka-python's on the same partition."""
    topic = "edgeroute.test.lean-seek"
    ensure_topic(broker.bootstrap, topic, partitions=1)
    now = int(time.time() * 1000)
    produce(broker.bootstrap, topic, [b"old"] * 5, now - 3_600_000)
    produce(broker.bootstrap, topic, [b"new"] * 3, now)
    tp, ktp = TopicPartition(topic, 0), KafkaTopicPartition(topic, 0)
    lean = LeanConsumer(broker.bootstrap, fetch_max_wait_ms=5)
    reference = KafkaConsumer(bootstrap_servers=broker.bootstrap, enable_auto_commit=False, group_id=None)
    try:
        lean.partitions(topic)
        assert lean.end_offsets([tp])[tp] == reference.end_offsets([ktp])[ktp]
        for at in (now - 7_200_000, now - 60_000, now + 60_000):
            found = reference.offsets_for_times({ktp: at})[ktp]
            lean.seek_times({tp: at})
            if found is None or found.timestamp < at:  # nothing that recent: the end
                assert lean.offsets[tp] == reference.end_offsets([ktp])[ktp]
            else:
                assert lean.offsets[tp] == found.offset
        lean.poll()  # (Tansu's end is the last batch's first offset + 1: it may hand back that batch's rest)
        lean.offsets[tp] = 10**12  # an offset the broker does not hold
        lean.poll()
        assert lean.offsets[tp] == lean.end_offsets([tp])[tp]
        produce(broker.bootstrap, topic, [b"later"], now)
        values: list[bytes | None] = []
        deadline = time.monotonic() + 10
        while b"later" not in values:
            assert time.monotonic() < deadline, values
            values += [r.value for records in lean.poll().values() for r in records]
    finally:
        lean.close()
        reference.close()


@pytest.mark.parametrize("reader", ["lean", "librdkafka", "kafka-python"])
def test_a_telemetry_source_reads_nodes_with_either_reader(
    broker: EmbeddedBroker, reader: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from telemetry.kafka import rdkafka

    if reader == "librdkafka" and not rdkafka.available():
        pytest.skip("confluent-kafka is not installed, or EDGEROUTE_KAFKA_CLIENT=kafka-python")
    monkeypatch.setenv("EDGEROUTE_KAFKA_READER", reader)
    topic = f"edgeroute.test.reader-{reader}"
    ensure_topic(broker.bootstrap, topic)
    publisher = TelemetryPublisher(broker.bootstrap, topic)
    store = ViewStore(stale_after_ms=1000)
    source = KafkaTelemetrySource(broker.bootstrap, topic, lookback_ms=5000)
    try:
        assert publisher.publish(load("before", sent_at_ms=time.time() * 1000 - 100))
        publisher._producer.flush()
        source.start(store)
        assert source.assigned.wait(10)
        assert publisher.publish(load("after", sent_at_ms=time.time() * 1000))
        deadline = time.monotonic() + 10
        while set(store.view.nodes) != {"before", "after"}:
            assert time.monotonic() < deadline, set(store.view.nodes)
            time.sleep(0.02)
        assert source.reader == reader and source.errors == 0
    finally:
        source.stop()
        publisher.close()


# -- peers that are not honest Kafka brokers ---------------------------------------------------------


def _serve(answer: bytes) -> Iterator[str]:
    """A loopback server that reads one request, sends `answer` back (its correlation id put in for
    CORR), then closes."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def run() -> None:
        server.settimeout(10)
        try:
            conn, _ = server.accept()
        except OSError:
            return
        with conn:
            try:
                size = struct.unpack(">i", conn.recv(4))[0]
                request = b""
                while len(request) < size:
                    request += conn.recv(size - len(request))
                conn.sendall(answer.replace(b"CORR", request[4:8]))
                conn.recv(1)  # until the client closes
            except OSError:
                pass

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.close()
        thread.join(5)


def _answer(body: bytes) -> bytes:
    return struct.pack(">i", 4 + len(body)) + b"CORR" + body


LIARS = {
    "huge size": struct.pack(">i", 2_000_000_000) + b"CORR",
    "negative size": struct.pack(">i", -5),
    "closes early": struct.pack(">i", 100) + b"CORR" + b"\0" * 10,
    "array count beyond the answer": _answer(struct.pack(">hi", 0, 1_000_000_000)),
    "wrong correlation id": struct.pack(">i", 10) + b"\0\0\0\x63" + b"\0" * 6,
    "error code": _answer(struct.pack(">hi", 35, 0)),
}


@pytest.mark.parametrize("name", sorted(LIARS))
def test_a_lying_broker_is_a_wire_error(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kafkafetch, "MAX_ANSWER", 1 << 20)
    for bootstrap in _serve(LIARS[name]):
        consumer = LeanConsumer(bootstrap, request_timeout_ms=2000)
        try:
            with pytest.raises(KafkaWireError):
                consumer.partitions("t")
        finally:
            consumer.close()


def test_a_silent_broker_times_out() -> None:
    for bootstrap in _serve(b""):
        consumer = LeanConsumer(bootstrap, request_timeout_ms=300)
        started = time.monotonic()
        try:
            with pytest.raises(KafkaWireError):
                consumer.partitions("t")
        finally:
            consumer.close()
        assert time.monotonic() - started < 3


def test_a_broker_without_the_needed_versions_is_unsupported() -> None:
    versions = struct.pack(">hi", 0, 3) + struct.pack(">hhh", 1, 0, 3) + struct.pack(">hhh", 2, 0, 5)
    versions += struct.pack(">hhh", 3, 0, 9)  # Fetch only up to v3
    for bootstrap in _serve(_answer(versions)):
        consumer = LeanConsumer(bootstrap, request_timeout_ms=2000)
        try:
            with pytest.raises(Unsupported, match="API 1 v4"):
                consumer.partitions("t")
        finally:
            consumer.close()


def test_no_broker_listening_is_a_wire_error() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(KafkaWireError, match="cannot reach"):
        LeanConsumer(f"127.0.0.1:{port},nohostport", request_timeout_ms=500).partitions("t")


def test_an_unreachable_leader_is_an_error_then_looked_up_again(broker: EmbeddedBroker) -> None:
    topic = "edgeroute.test.lean-leader"
    ensure_topic(broker.bootstrap, topic, partitions=2)
    lean = LeanConsumer(broker.bootstrap, fetch_max_wait_ms=5)
    try:
        parts = lean.partitions(topic)
        lean.seek_times({TopicPartition(topic, p): 0 for p in parts})
        (node,) = set(lean._leaders.values())
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            dead = sock.getsockname()[1]
        lean._drop(node)
        lean._brokers[node] = ("127.0.0.1", dead)  # as if the leader had moved away
        with pytest.raises(KafkaWireError, match="no partition leader"):
            lean.poll()
        produce(broker.bootstrap, topic, [b"x"], int(time.time() * 1000))
        deadline = time.monotonic() + 10
        while not lean.poll():  # the next poll looks the leaders up again and reads on
            assert time.monotonic() < deadline
    finally:
        lean.close()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl to make certificates")
def test_the_lean_reader_reads_a_tls_broker(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """With security_protocol SSL the router keeps the lean reader (and its bounds), over TLS."""
    from scenarios.stack.broker import free_port
    from scenarios.stack.tlsfront import TlsFront
    from telemetry.process.tls import KafkaSecurity, kafka_security, set_kafka_security
    from tests.integration.test_tls import make_pki

    monkeypatch.delenv("EDGEROUTE_KAFKA_READER", raising=False)
    pki = make_pki(tmp_path)
    tls_port = free_port()
    before = kafka_security()
    with (
        EmbeddedBroker(advertised_port=tls_port) as plain,
        TlsFront(tls_port, plain.port, pki["server"], pki["server_key"]),
    ):
        bootstrap = f"127.0.0.1:{tls_port}"
        set_kafka_security(KafkaSecurity(security_protocol="SSL", ssl_cafile=pki["ca"]))
        try:
            topic = "edgeroute.test.tls"
            ensure_topic(bootstrap, topic)
            publisher = TelemetryPublisher(bootstrap, topic)
            store = ViewStore(stale_after_ms=1000)
            source = KafkaTelemetrySource(bootstrap, topic, lookback_ms=5000)
            try:
                assert publisher.publish(load("over-tls", sent_at_ms=time.time() * 1000))
                source.start(store)
                deadline = time.monotonic() + 15
                while "over-tls" not in store.view.nodes:
                    assert time.monotonic() < deadline, (source.reader, source.errors)
                    assert publisher.publish(load("over-tls", sent_at_ms=time.time() * 1000))
                    time.sleep(0.1)
                assert source.reader == "lean"
            finally:
                source.stop()
                publisher.close()
            # and a broker answering with a certificate from another CA is refused, never read
            set_kafka_security(KafkaSecurity(security_protocol="SSL", ssl_cafile=pki["other_ca"]))
            consumer = LeanConsumer(
                bootstrap, tls=KafkaSecurity(security_protocol="SSL", ssl_cafile=pki["other_ca"]).ssl_context()
            )
            with pytest.raises(KafkaWireError, match="TLS"):
                consumer.partitions(topic)
            consumer.close()
        finally:
            set_kafka_security(before)


@pytest.mark.parametrize("codec", ["gzip", "snappy", "lz4", "zstd"])
def test_a_record_in_any_codec_is_read_by_the_lean_reader_which_stays_the_reader(
    broker: EmbeddedBroker, codec: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One ordinary record in a codec the lean reader did not decode (lz4) made the router switch to
    librdkafka "from now on", whose inflation has no bound: a 261 KB gzip record then took it from 96 to
    608 MB. Every codec Kafka defines is now read by the lean reader, which stays the reader."""
    from confluent_kafka import Producer

    from telemetry.kafka import rdkafka

    if not rdkafka.available():
        pytest.skip("confluent-kafka produces the codecs here")
    monkeypatch.delenv("EDGEROUTE_KAFKA_READER", raising=False)
    topic = f"edgeroute.test.codec-{codec}"
    ensure_topic(broker.bootstrap, topic)
    store = ViewStore(stale_after_ms=60_000)
    source = KafkaTelemetrySource(broker.bootstrap, topic, lookback_ms=5000)
    producer = Producer({"bootstrap.servers": broker.bootstrap, "compression.type": codec, "linger.ms": 5})
    try:
        source.start(store)
        assert source.assigned.wait(10)
        for i in range(20):
            producer.produce(topic, key=b"n%d" % i, value=load(f"{codec}-{i}", sent_at_ms=time.time() * 1000).to_json())
        producer.flush(10)
        deadline = time.monotonic() + 15
        while len(store.view) < 20:
            assert time.monotonic() < deadline, len(store.view)
            time.sleep(0.05)
        assert source.reader == "lean" and source.errors == 0
    finally:
        source.stop()
