"""Kafka transport for telemetry: publisher (nodes), consumer thread (routers), topic creation.

kafka-python is blocking, so both sides run it off the event loop: the consumer in a daemon thread of
its own, the publisher through a single-thread executor owned by the node. The consumer assigns itself
every partition of the topic by hand (no consumer group: joining one on some brokers takes ~20 s, and a
router wants all partitions anyway) and starts `lookback_ms` back, so a restarted router rebuilds its
view from the log instead of waiting for every node to speak again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from telemetry.schema import TOPIC, NodeLoad
from telemetry.store import ViewStore

log = logging.getLogger(__name__)

DEFAULT_PARTITIONS = 8


def now_ms() -> float:
    return time.time() * 1000.0


def ensure_topic(
    bootstrap: str, topic: str = TOPIC, partitions: int = DEFAULT_PARTITIONS, timeout_s: float = 10.0
) -> None:
    """Create `topic` if it does not exist; an existing topic is left as it is."""
    from kafka.admin import KafkaAdminClient, NewTopic
    from kafka.errors import KafkaError, TopicAlreadyExistsError

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            admin = KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=5000, client_id="edgeroute-admin")
            break
        except KafkaError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    try:
        if topic in admin.list_topics():
            return
        try:
            admin.create_topics([NewTopic(topic, partitions, 1)])
        except TopicAlreadyExistsError:
            pass
    finally:
        admin.close()


class KafkaSender:
    """A Kafka producer that never raises: sends are counted, failures logged and counted.

    Blocking; call it from a worker thread. A node keeps serving while its telemetry cannot be
    delivered (routers will see it go stale, which is the truth), and a router keeps routing while its
    peers cannot hear from it.
    """

    def __init__(self, bootstrap: str, topic: str, client_id: str, what: str) -> None:
        self.bootstrap = bootstrap
        self.topic = topic
        self.client_id = client_id
        self.what = what  # for the log lines
        self.sent = 0
        self.failed = 0
        self._producer: Any = None

    def _connect(self) -> Any:
        from kafka import KafkaProducer

        return KafkaProducer(
            bootstrap_servers=self.bootstrap,
            linger_ms=0,
            acks=1,
            max_block_ms=2000,
            request_timeout_ms=5000,
            retries=1,
            client_id=self.client_id,
        )

    def send(self, key: bytes | None, value: bytes, timestamp_ms: int) -> bool:
        try:
            if self._producer is None:
                self._producer = self._connect()
            self._producer.send(self.topic, key=key, value=value, timestamp_ms=timestamp_ms)
            self.sent += 1
            return True
        except Exception as exc:  # noqa: BLE001 - any broker fault must not take the process down
            self.failed += 1
            if self.failed == 1 or self.failed % 100 == 0:
                log.warning("%s publish failed (%d so far): %s", self.what, self.failed, exc)
            return False

    def close(self) -> None:
        if self._producer is not None:
            try:
                self._producer.flush(timeout=2)
                self._producer.close(timeout=2)
            except Exception as exc:  # noqa: BLE001
                log.debug("%s producer close: %s", self.what, exc)
            self._producer = None


class TelemetryPublisher(KafkaSender):
    """Sends `NodeLoad` messages keyed by node id (blocking; see KafkaSender)."""

    def __init__(self, bootstrap: str, topic: str = TOPIC) -> None:
        super().__init__(bootstrap, topic, "edgeroute-node", "telemetry")

    def publish(self, msg: NodeLoad) -> bool:
        return self.send(msg.node_id.encode(), msg.to_json(), int(msg.sent_at_ms))


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


class TopicReader:
    """A daemon thread reading every partition of a topic, from `lookback_ms` back, batch by batch.

    Reconnects by itself after a broker outage. Subclasses say what a batch of message values means
    (`_handle`) and may act after every poll, records or not (`_tick`).
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
        self.assigned = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def _handle(self, values: list[bytes], received_ms: float) -> None:
        raise NotImplementedError

    def _tick(self, now_ms: float) -> None:
        return None

    def _run(self) -> None:
        while not self._stop.is_set():
            consumer = None
            try:
                consumer = self._open()
                while not self._stop.is_set():
                    batches = consumer.poll(timeout_ms=100, max_records=1000)
                    received = self.clock()
                    values = [r.value or b"" for records in batches.values() for r in records]
                    if values:
                        self._handle(values, received)
                    self._tick(received)
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
        from kafka import KafkaConsumer, TopicPartition

        ensure_topic(self.bootstrap, self.topic)
        consumer = KafkaConsumer(
            bootstrap_servers=self.bootstrap,
            enable_auto_commit=False,
            group_id=None,
            fetch_max_wait_ms=self.fetch_max_wait_ms,
            client_id="edgeroute-router",
            request_timeout_ms=5000,
            reconnect_backoff_max_ms=1000,
        )
        partitions = None
        deadline = time.monotonic() + 10
        while not partitions:
            partitions = consumer.partitions_for_topic(self.topic)
            if not partitions:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"topic {self.topic} has no partitions")
                time.sleep(0.1)
        tps = [TopicPartition(self.topic, p) for p in sorted(partitions)]
        consumer.assign(tps)
        start_ms = int(self.clock() - self.lookback_ms)
        offsets = consumer.offsets_for_times({tp: start_ms for tp in tps})
        for tp in tps:
            found = offsets.get(tp)
            # "no such message" is None on Apache Kafka and (offset 0, timestamp -1) on some brokers
            if found is None or found.timestamp is None or found.timestamp < start_ms:
                consumer.seek_to_end(tp)
            else:
                consumer.seek(tp, found.offset)
        self.assigned.set()
        return consumer


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

    def _handle(self, values: list[bytes], received_ms: float) -> None:
        store = self._store
        assert store is not None
        parsed = [store.parse(v) for v in values]
        msgs = [m for m in parsed if m is not None]
        if msgs:
            store.apply_many(msgs, received_ms)
