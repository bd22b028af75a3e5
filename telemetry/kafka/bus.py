"""Kafka transport for telemetry, the sending side: topic creation and producers (a node's reports,
a router's peer counts), which never raise; the reading side is telemetry.kafka.reader.

kafka-python is blocking, so senders run off the event loop, through a single-thread executor owned by
the node or router; librdkafka's producer (where confluent-kafka is installed) queues in its own thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from telemetry.cluster.schema import TOPIC, NodeLoad
from telemetry.kafka import rdkafka
from telemetry.kafka.signing import HEADER, Signer
from telemetry.process.tls import kafka_options

log = logging.getLogger(__name__)

DEFAULT_PARTITIONS = 8


def now_ms() -> float:
    return time.time() * 1000.0


def ensure_topic(
    bootstrap: str, topic: str = TOPIC, partitions: int = DEFAULT_PARTITIONS, timeout_s: float = 10.0
) -> None:
    """Create `topic` if it does not exist; an existing topic is left as it is (librdkafka's admin
    client where it is installed, else kafka-python's)."""
    if rdkafka.available():
        rdkafka.ensure_topic(bootstrap, topic, partitions, timeout_s)
        return
    from kafka.admin import KafkaAdminClient, NewTopic
    from kafka.errors import KafkaError, TopicAlreadyExistsError

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            admin = KafkaAdminClient(
                bootstrap_servers=bootstrap,
                request_timeout_ms=5000,
                client_id="edgeroute-admin",
                **kafka_options(bootstrap),
            )
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

    def __init__(
        self,
        bootstrap: str,
        topic: str,
        client_id: str,
        what: str,
        signer: Signer | None = None,
        on_failure: Callable[[bytes], None] | None = None,
    ) -> None:
        self.bootstrap = bootstrap
        self.on_failure = on_failure  # told each message queued but then not delivered (its value)
        self.topic = topic
        self.signer = signer  # seals every message (telemetry.kafka.signing) when set
        self.client_id = client_id
        self.what = what  # for the log lines
        self.sent = 0
        self.failed = 0
        self._producer: Any = None

    def _connect(self) -> Any:
        if rdkafka.available():  # librdkafka: a send queues in its own thread, in microseconds
            return rdkafka.RdProducer(self.bootstrap, self.client_id, self.on_failure)
        from kafka import KafkaProducer

        return KafkaProducer(
            bootstrap_servers=self.bootstrap,
            linger_ms=0,
            acks=1,
            max_block_ms=2000,
            request_timeout_ms=5000,
            retries=1,
            client_id=self.client_id,
            metrics_enabled=False,
            **kafka_options(self.bootstrap),
        )

    def send(self, key: bytes | None, value: bytes, timestamp_ms: int) -> bool:
        try:
            if self._producer is None:
                self._producer = self._connect()
            headers = None
            if self.signer is not None:  # the value stays plain JSON; the signature rides in a header
                headers = [(HEADER, self.signer.signature(self.topic, value, now_ms()))]
            sent = self._producer.send(self.topic, key=key, value=value, timestamp_ms=timestamp_ms, headers=headers)
            if self.on_failure is not None and sent is not None:  # (kafka-python: a future)
                on_failure = self.on_failure
                sent.add_errback(lambda exc: on_failure(value))
            self.sent += 1
            return True
        except Exception as exc:  # noqa: BLE001 - any broker fault must not take the process down
            self.failed += 1
            if self.failed == 1 or self.failed % 100 == 0:
                log.warning("%s publish failed (%d so far): %s", self.what, self.failed, exc)
            return False

    def poll(self) -> None:
        """Delivery reports of sends queued earlier (librdkafka's come when polled)."""
        poll = getattr(self._producer, "poll", None)
        if poll is not None and isinstance(self._producer, rdkafka.RdProducer):
            poll()

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

    def __init__(self, bootstrap: str, topic: str = TOPIC, signer: Signer | None = None) -> None:
        super().__init__(bootstrap, topic, "edgeroute-node", "telemetry", signer)

    def publish(self, msg: NodeLoad) -> bool:
        return self.send(msg.node_id.encode(), msg.to_json(), int(msg.sent_at_ms))
