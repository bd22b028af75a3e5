"""Kafka transport for telemetry, the reading side: a router's readers of node reports (and of peer
counts, telemetry.kafka.peers), one daemon thread per cluster; the sending side is telemetry.kafka.bus.

The consumer assigns itself every partition of its topics by hand (no consumer group: joining one on
some brokers takes ~20 s, and a router wants all partitions anyway) and starts `lookback_ms` back, so
a restarted router rebuilds its view from the log instead of waiting for every node to speak again.
Reports can come from several clusters (`TelemetrySources`: a site's own cluster each, mirrored topics
beside the originals).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from telemetry.cluster.schema import TOPIC, NodeLoad
from telemetry.cluster.store import ViewStore
from telemetry.kafka import rdkafka
from telemetry.kafka.bus import ensure_topic, now_ms
from telemetry.kafka.lean import LeanConsumer
from telemetry.kafka.records import TopicPartition, Unsupported
from telemetry.kafka.signing import Verifier, header_signature, unsealed
from telemetry.process.background import Worker
from telemetry.process.tls import kafka_options, kafka_security

log = logging.getLogger(__name__)


def reader_kind(security_protocol: str) -> str:
    """Which reader a process with these Kafka settings uses: the lean one (telemetry.kafka.lean) on a
    plaintext or TLS broker, librdkafka where SASL is needed (kafka-python without confluent-kafka);
    `EDGEROUTE_KAFKA_READER` (lean, librdkafka, kafka-python) chooses, the lean one only where it can."""
    wanted = os.environ.get("EDGEROUTE_KAFKA_READER", "lean")
    if wanted not in ("lean", "librdkafka", "kafka-python"):
        raise ValueError(f"EDGEROUTE_KAFKA_READER: lean, librdkafka or kafka-python, not {wanted!r}")
    if wanted == "lean" and security_protocol in ("PLAINTEXT", "SSL"):
        return "lean"
    if wanted == "kafka-python" or not rdkafka.available():
        return "kafka-python"
    return "librdkafka"


class TelemetrySource(Protocol):
    """Feeds a ViewStore. The Kafka consumer in production; a static feed in unit tests."""

    def start(self, store: ViewStore) -> None: ...

    def stop(self) -> None: ...


class StaticTelemetrySource:
    """Applies a fixed list of messages once at start (unit tests, offline tools)."""

    def __init__(self, messages: list[NodeLoad], clock: Callable[[], float] = now_ms) -> None:
        self.messages = messages
        self.clock = clock

    def start(self, store: ViewStore) -> None:
        for msg in self.messages:
            store.apply(msg, self.clock())

    def stop(self) -> None:
        return None


class TopicReader(Worker):
    """A daemon thread reading every partition of a topic, from `lookback_ms` back, batch by batch.

    Reconnects by itself after a broker outage. Subclasses say what a batch of message values means
    (`_handle`) and may act after every poll, records or not (`_tick`). A reader can `carry` other
    readers on the same broker: one consumer and one thread fetch all their topics, one fetch request
    per poll, each batch handed to the reader of its topic (a Kafka fetch round trip costs a few
    hundred microseconds of CPU in the client and the broker, paid hundreds of times a second).
    """

    thread_name = "topic-reader"

    def __init__(
        self,
        bootstrap: str,
        topic: str,
        lookback_ms: float = 5000.0,
        fetch_max_wait_ms: int = 10,
        clock: Callable[[], float] = now_ms,
    ) -> None:
        self.bootstrap = bootstrap
        self.topic = topic
        self.lookback_ms = lookback_ms
        self.fetch_max_wait_ms = max(1, fetch_max_wait_ms)  # 0 stops consumption on some brokers
        self.clock = clock
        self.errors = 0
        self.skipped_batches = 0  # batches whose handling raised (a bug, not bad input: that is counted as such)
        self.verifier: Verifier | None = None  # checks signed messages (telemetry.kafka.signing) when set
        self.assigned = threading.Event()
        super().__init__()
        self._riders: list[TopicReader] = []
        self._carried = False
        # "lean" (telemetry.kafka.lean) or "kafka-python", chosen at the first connection by the
        # process's Kafka settings (plaintext brokers get the lean reader)
        self.reader: str | None = None

    def carry(self, reader: TopicReader) -> None:
        """Read `reader`'s topic on this reader's consumer too (before `start`); `reader`'s own start and
        stop then do nothing, this reader's do it for both. The fetch wait is the shorter of the two."""
        if reader.bootstrap != self.bootstrap or reader.topic == self.topic or self._thread is not None:
            raise ValueError("a carried reader needs the same broker, another topic, and a reader not started")
        reader._carried = True
        self._riders.append(reader)

    def _start(self) -> None:
        if self._carried:
            return
        self._start_thread()

    def _handle(
        self, values: list[bytes], received_ms: float, history: bool | None = None, kids: list[str | None] | None = None
    ) -> None:
        """Fold a batch in; `history` is True while the reader catches up on what was published
        before it started (the lookback), False once it reads the live stream; `kids` are the key
        ids that signed each value (when verified)."""
        raise NotImplementedError

    def _tick(self, now_ms: float) -> None:
        return None

    def _fold(self, batch: list[Any], received: float, history: bool) -> None:
        """Verify a batch of records and hand their values to `_handle`. A batch that raises there is
        skipped, counted and logged (at the 1st, 2nd, 4th... such batch): the consumer has read past it,
        and reconnecting would read the same records again from the lookback and fail the same way,
        stalling the topic for good."""
        try:
            verifier = self.verifier
            kids: list[str | None] | None = None
            values = [r.value or b"" for r in batch]
            if verifier is not None:
                values, kids = verifier.open_many(self.topic, values, received, [_sig(r) for r in batch])
            else:  # no keys here: signed and unsigned alike, unverified (telemetry.kafka.signing)
                values = [unsealed(v) for v in values]
            if values:
                self._handle(values, received, history, kids)
        except Exception as exc:  # noqa: BLE001 - one bad batch must not stop the stream
            self.skipped_batches += 1
            self._skipped(len(batch))
            n = self.skipped_batches
            if n & (n - 1) == 0:  # the 1st, 2nd, 4th, 8th...: a bug every batch meets cannot flood the log
                log.error("%s: a batch of %d records skipped (%d so far): %s: %s", self.topic, len(batch), n,
                          type(exc).__name__, exc)  # fmt: skip

    def _skipped(self, records: int) -> None:
        """Count `records` of a skipped batch where the reader's owner shows its counts."""
        return None

    def _dropped(self, batches: int) -> None:
        """Count record batches the consumer dropped unread (the lean reader's `dropped_batches`)."""
        return None

    def _run(self) -> None:
        readers = {r.topic: r for r in (self, *self._riders)}
        while not self._stop.is_set():
            consumer = None
            try:
                consumer = self._open()
                # what was published before this start: read as history (dated by its send time)
                # until the consumer reaches these offsets, then as the live stream (dated by receipt,
                # so a node whose clock runs behind the router's is still fresh)
                ends = {tp: end for tp, end in consumer.end_offsets(list(consumer.assignment())).items() if end}
                dropped = 0
                while not self._stop.is_set():
                    batches = consumer.poll(timeout_ms=100)
                    received = self.clock()
                    if getattr(consumer, "dropped_batches", 0) != dropped:
                        self._dropped(consumer.dropped_batches - dropped)
                        dropped = consumer.dropped_batches
                    by_topic: dict[tuple[str, bool], list[Any]] = {}
                    for tp, records in batches.items():
                        end = ends.get(tp, 0)
                        split = 0  # records before it were published before the reader started
                        if end:
                            split = next((i for i, r in enumerate(records) if r.offset >= end), len(records))
                            if records and records[-1].offset >= end - 1:
                                del ends[tp]  # caught up on this partition
                        if split:
                            by_topic.setdefault((tp.topic, True), []).extend(records[:split])
                        if split < len(records):
                            by_topic.setdefault((tp.topic, False), []).extend(records[split:])
                    for (topic, history), batch in by_topic.items():
                        readers[topic]._fold(batch, received, history)
                    for reader in readers.values():
                        reader._tick(received)
            except Unsupported as exc:  # the broker's API versions (never the log's content: it is dropped)
                self.reader = "librdkafka" if rdkafka.available() else "kafka-python"
                log.warning("%s: %s; reading with %s from now on", self.thread_name, exc, self.reader)
            except Exception as exc:  # noqa: BLE001 - broker outages are survived, not raised
                self.errors += 1
                log.warning("%s error, reconnecting: %s", self.thread_name, exc)
                self._stop.wait(0.5)
            finally:
                if consumer is not None:
                    try:
                        consumer.close()
                    except Exception:  # noqa: BLE001
                        pass

    def _open(self) -> Any:
        """A consumer of every partition of the readers' topics, each from `lookback_ms` back (or its end
        when nothing is that recent): the lean reader (telemetry.kafka.lean) where it can, else kafka-python."""
        readers = [self, *self._riders]
        for reader in readers:
            ensure_topic(self.bootstrap, reader.topic)
        wait_ms = min(r.fetch_max_wait_ms for r in readers)
        if self.reader is None:
            self.reader = reader_kind(kafka_options(self.bootstrap).get("security_protocol", "PLAINTEXT"))
        if self.reader == "lean":
            security = kafka_security(self.bootstrap)
            tls = None if security is None else security.ssl_context()
            consumer: Any = LeanConsumer(self.bootstrap, wait_ms, request_timeout_ms=5000, tls=tls)
        elif self.reader == "librdkafka":
            consumer = rdkafka.RdConsumer(self.bootstrap, wait_ms)
        else:
            consumer = _KafkaPythonConsumer(self.bootstrap, wait_ms)
        try:
            starts: dict[Any, int] = {}
            deadline = time.monotonic() + 10
            for reader in readers:
                partitions = None
                while not partitions:
                    partitions = consumer.partitions(reader.topic)
                    if not partitions:
                        if time.monotonic() > deadline:
                            raise RuntimeError(f"topic {reader.topic} has no partitions")
                        time.sleep(0.1)
                start_ms = int(self.clock() - reader.lookback_ms)
                starts.update({TopicPartition(reader.topic, p): start_ms for p in partitions})
            consumer.seek_times(starts)
        except BaseException:
            consumer.close()
            raise
        for reader in readers:
            reader.assigned.set()
        return consumer


def _sig(record: Any) -> bytes | None:
    """A record's signature header: the lean reader's and librdkafka's records carry it found,
    kafka-python's all their headers."""
    sig = getattr(record, "sig", None)
    if sig is not None:
        return sig  # type: ignore[no-any-return]
    return header_signature(getattr(record, "headers", None))


class _KafkaPythonConsumer:
    """kafka-python's consumer behind the lean reader's interface (TLS, SASL, or by choice)."""

    def __init__(self, bootstrap: str, fetch_max_wait_ms: int) -> None:
        from kafka import KafkaConsumer

        self._consumer = KafkaConsumer(
            bootstrap_servers=bootstrap,
            enable_auto_commit=False,
            group_id=None,
            fetch_max_wait_ms=fetch_max_wait_ms,
            client_id="edgeroute-router",
            request_timeout_ms=5000,
            reconnect_backoff_max_ms=1000,
            metrics_enabled=False,
            **kafka_options(bootstrap),
        )

    def partitions(self, topic: str) -> list[int]:
        return sorted(self._consumer.partitions_for_topic(topic) or ())

    def seek_times(self, starts: dict[TopicPartition, int]) -> None:
        from kafka import TopicPartition as KafkaTopicPartition

        own = {KafkaTopicPartition(*tp): at for tp, at in starts.items()}
        self._consumer.assign(list(own))
        offsets = self._consumer.offsets_for_times(own)
        for tp, start_ms in own.items():
            found = offsets.get(tp)
            # "no such message" is None on Apache Kafka and (offset 0, timestamp -1) on some brokers
            if found is None or found.timestamp is None or found.timestamp < start_ms:
                self._consumer.seek_to_end(tp)
                # resolved now: kafka-python would look the end up at the first fetch, and skip what
                # was published between `assigned` and then
                self._consumer.position(tp)
            else:
                self._consumer.seek(tp, found.offset)

    def assignment(self) -> list[Any]:
        return list(self._consumer.assignment())

    def end_offsets(self, partitions: list[Any]) -> dict[Any, int]:
        return dict(self._consumer.end_offsets(partitions))

    def poll(self, timeout_ms: int = 100) -> dict[Any, list[Any]]:
        return dict(self._consumer.poll(timeout_ms=timeout_ms, max_records=1000))

    def close(self) -> None:
        self._consumer.close()


class KafkaTelemetrySource(TopicReader):
    """A daemon thread consuming all partitions of the telemetry topic into a ViewStore."""

    thread_name = "telemetry-consumer"

    def __init__(
        self,
        bootstrap: str,
        topic: str = TOPIC,
        lookback_ms: float = 5000.0,
        fetch_max_wait_ms: int = 10,
        clock: Callable[[], float] = now_ms,
    ) -> None:
        super().__init__(bootstrap, topic, lookback_ms, fetch_max_wait_ms, clock)
        self._store: ViewStore | None = None

    def start(self, store: ViewStore) -> None:
        self._store = store
        self._start()

    def _skipped(self, records: int) -> None:
        if self._store is not None:
            self._store.skipped += records

    def _dropped(self, batches: int) -> None:
        if self._store is not None:
            self._store.batches_dropped += batches

    def _handle(
        self, values: list[bytes], received_ms: float, history: bool | None = None, kids: list[str | None] | None = None
    ) -> None:
        store = self._store
        assert store is not None
        parsed = [store.parse(v) for v in values]
        verifier = self.verifier
        if kids is not None and verifier is not None and verifier.bindings:
            parsed = [
                m if m is None or verifier.may_sign_for(k, m.node_id) else None
                for m, k in zip(parsed, kids, strict=True)
            ]
        msgs = [m for m in parsed if m is not None]
        if msgs:
            store.apply_many(msgs, received_ms, history)


class TelemetrySources:
    """Node telemetry read from several places into one store: one reader per Kafka cluster (each with
    its own bootstrap and security settings: telemetry.process.tls), each carrying the cluster's other
    topics (a mirrored topic, such as MirrorMaker 2's `<site>.edgeroute.telemetry`) on its one consumer.
    A cluster that goes away stales only the nodes that report there; a report read twice (from its own
    cluster and from a mirror) is applied once (ViewStore counts the copy as a duplicate)."""

    def __init__(self, readers: list[KafkaTelemetrySource]) -> None:
        if not readers:
            raise ValueError("no telemetry source")
        self.readers = readers
        by_cluster: dict[str, KafkaTelemetrySource] = {}
        for reader in readers:
            first = by_cluster.setdefault(reader.bootstrap, reader)
            if first is not reader:
                first.carry(reader)

    @classmethod
    def of(
        cls,
        sources: list[tuple[str, list[str]]],
        lookback_ms: float = 5000.0,
        fetch_max_wait_ms: int = 10,
        clock: Callable[[], float] = now_ms,
    ) -> TelemetrySources:
        """Readers for (bootstrap, topics) pairs."""
        return cls(
            [
                KafkaTelemetrySource(bootstrap, topic, lookback_ms, fetch_max_wait_ms, clock)
                for bootstrap, topics in sources
                for topic in topics
            ]
        )

    def reader_for(self, bootstrap: str) -> KafkaTelemetrySource | None:
        """The reader whose consumer serves `bootstrap` (it can carry another topic there: the peers')."""
        return next((r for r in self.readers if r.bootstrap == bootstrap and not r._carried), None)

    @property
    def verifier(self) -> Verifier | None:
        return self.readers[0].verifier

    @verifier.setter
    def verifier(self, verifier: Verifier | None) -> None:
        for reader in self.readers:
            reader.verifier = verifier

    def start(self, store: ViewStore) -> None:
        for reader in self.readers:
            reader.start(store)

    def stop(self) -> None:
        for reader in self.readers:
            reader.stop()
