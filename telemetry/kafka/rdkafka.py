"""Kafka through librdkafka (`confluent-kafka`), where it is installed: producers, topic creation and
a reader, plaintext, TLS and SASL alike, behind the interfaces telemetry.kafka.bus uses for kafka-python.

- Producers (`RdProducer`) queue in librdkafka's own thread: a send costs microseconds, against
  kafka-python's tens, and never blocks (a full local queue counts as a failed send).
- The reader (`RdConsumer`) has the lean reader's interface (telemetry.kafka.lean): every partition
  assigned by hand, started from a time offset, CRC checks on; what a broker may send is bounded by
  configuration (`fetch.max.bytes`, `receive.message.max.bytes`, `queued.max.messages.kbytes`
  prefetch, `socket.timeout.ms` per answer). librdkafka inflates gzip and lz4 batches without a bound
  of its own (its gzip path sizes the output in a first pass and allocates it whole), so plaintext and
  TLS readers keep the lean reader, which bounds inflation; readers that need SASL, which the lean
  reader does not speak, read here (before: kafka-python, as unbounded there and three times the CPU),
  and the broker's SASL is then what keeps hostile writers off the topic.
- kafka-python stays the fallback where confluent-kafka is missing, or with
  `EDGEROUTE_KAFKA_CLIENT=kafka-python`.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import time
import uuid
from collections.abc import Callable
from typing import Any

from telemetry.kafka.records import Record, TopicPartition
from telemetry.kafka.signing import header_signature
from telemetry.process.tls import kafka_options

log = logging.getLogger("edgeroute.telemetry")

FETCH_MAX_BYTES = 16 << 20  # one fetch's answer at most (a soft limit: one batch past it still comes)
RECEIVE_MAX_BYTES = FETCH_MAX_BYTES + (1 << 20)  # a broker answer larger than this ends the connection
PREFETCH_KB = 16 << 10  # records queued locally, ahead of the reader (KiB)
QUEUE_MESSAGES = 100_000  # a producer's local queue; past it a send fails at once


def available() -> bool:
    """confluent-kafka is installed and not turned off (`EDGEROUTE_KAFKA_CLIENT=kafka-python`)."""
    wanted = os.environ.get("EDGEROUTE_KAFKA_CLIENT", "auto")
    if wanted not in ("auto", "librdkafka", "kafka-python"):
        raise ValueError(f"EDGEROUTE_KAFKA_CLIENT: auto, librdkafka or kafka-python, not {wanted!r}")
    return wanted != "kafka-python" and importlib.util.find_spec("confluent_kafka") is not None


def settings(bootstrap: str, client_id: str) -> dict[str, Any]:
    """librdkafka's settings for this process's Kafka security (telemetry.process.tls.kafka_options)."""
    opts = kafka_options(bootstrap)
    out: dict[str, Any] = {
        "bootstrap.servers": bootstrap,
        "client.id": client_id,
        "security.protocol": opts.get("security_protocol", "PLAINTEXT"),
        "socket.timeout.ms": 5000,  # an answer that does not come whole within this fails the request
        # small messages go out at once (librdkafka leaves Nagle on by default: a report could wait
        # for the previous one's ACK, tens of ms, as kafka-python's TCP_NODELAY never lets it)
        "socket.nagle.disable": True,
        "reconnect.backoff.max.ms": 1000,
        "log.connection.close": False,
    }
    if "ssl_cafile" in opts:
        out["ssl.ca.location"] = opts["ssl_cafile"]
    if "ssl_certfile" in opts:
        out["ssl.certificate.location"] = opts["ssl_certfile"]
    if "ssl_keyfile" in opts:
        out["ssl.key.location"] = opts["ssl_keyfile"]
    if "ssl_check_hostname" in opts:
        out["ssl.endpoint.identification.algorithm"] = "https" if opts["ssl_check_hostname"] else "none"
    if "sasl_mechanism" in opts:
        out["sasl.mechanisms"] = opts["sasl_mechanism"]
        out["sasl.username"] = opts["sasl_plain_username"]
        out["sasl.password"] = opts["sasl_plain_password"]
    return out


def ensure_topic(bootstrap: str, topic: str, partitions: int, timeout_s: float) -> None:
    """Create `topic` if it does not exist (an existing one is left as it is)."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

    admin = AdminClient({**settings(bootstrap, "edgeroute-admin"), "logger": log})  # type: ignore[dict-item]
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if topic in admin.list_topics(timeout=max(0.5, deadline - time.monotonic())).topics:
                return
            future = admin.create_topics([NewTopic(topic, partitions, 1)])[topic]
            future.result(timeout=max(0.5, deadline - time.monotonic()))
            return
        except KafkaException as exc:
            if exc.args and getattr(exc.args[0], "name", lambda: "")() == "TOPIC_ALREADY_EXISTS":
                return
            if time.monotonic() > deadline:
                reason = exc.args[0].str() if exc.args and hasattr(exc.args[0], "str") else str(exc)
                raise RuntimeError(f"Kafka at {bootstrap}: cannot make topic {topic}: {reason}") from None
            time.sleep(0.2)


class RdProducer:
    """A librdkafka producer with kafka-python's `send`/`flush`/`close` shape (telemetry.kafka.bus.KafkaSender)."""

    def __init__(self, bootstrap: str, client_id: str, on_failure: Callable[[bytes], None] | None = None) -> None:
        from confluent_kafka import Producer

        self._producer = Producer(
            {
                **settings(bootstrap, client_id),
                "linger.ms": 1,
                "acks": 1,
                "message.timeout.ms": 5000,
                "queue.buffering.max.messages": QUEUE_MESSAGES,
                "logger": log,
            }
        )
        self.failed_deliveries = 0
        self.on_failure = on_failure  # told each message that could not be delivered (its value)

    def _delivered(self, err: Any, msg: Any) -> None:
        if err is not None:
            self.failed_deliveries += 1
            if self.on_failure is not None:
                self.on_failure(msg.value() or b"")

    def send(
        self,
        topic: str,
        key: bytes | None = None,
        value: bytes | None = None,
        timestamp_ms: int | None = None,
        headers: list[tuple[str, bytes]] | None = None,
    ) -> None:
        """Queue one message, as kafka-python's `send` is called (BufferError when the local queue is full)."""
        self._producer.produce(
            topic,
            value=value,
            key=key,
            timestamp=timestamp_ms or 0,
            headers=headers,  # type: ignore[arg-type]
            on_delivery=self._delivered,
        )
        self._producer.poll(0)  # delivery reports, without waiting

    def poll(self) -> None:
        """Delivery reports of what was queued, without waiting (failures reach `on_failure`)."""
        self._producer.poll(0)

    def flush(self, timeout: float = 10.0) -> None:
        self._producer.flush(timeout)

    def close(self, timeout: float = 10.0) -> None:
        self._producer.flush(timeout)


class RdConsumer:
    """librdkafka's consumer behind the lean reader's interface: partitions, seek_times, assignment,
    end_offsets, poll (records by partition), close."""

    def __init__(self, bootstrap: str, fetch_max_wait_ms: int) -> None:
        from confluent_kafka import Consumer

        self._consumer = Consumer(
            {
                **settings(bootstrap, "edgeroute-router"),
                # never joins the group: partitions are assigned by hand, nothing is committed
                "group.id": f"edgeroute-reader-{uuid.uuid4().hex[:12]}",
                "enable.auto.commit": False,
                "enable.auto.offset.store": False,
                "check.crcs": True,
                "fetch.wait.max.ms": fetch_max_wait_ms,
                "fetch.max.bytes": FETCH_MAX_BYTES,
                "receive.message.max.bytes": RECEIVE_MAX_BYTES,
                "queued.max.messages.kbytes": PREFETCH_KB,
                "fetch.queue.backoff.ms": 5,
                "logger": log,
            }
        )
        self._assigned: list[TopicPartition] = []

    def partitions(self, topic: str) -> list[int]:
        meta = self._consumer.list_topics(topic, timeout=5)
        found = meta.topics.get(topic)
        if found is None or found.error is not None:
            return []
        return sorted(found.partitions)

    def seek_times(self, starts: dict[TopicPartition, int]) -> None:
        """Assign every partition from the first offset at or after its time; where there is none, from
        its end as it is now (looked up now, so nothing published after this call is skipped)."""
        from confluent_kafka import TopicPartition as RdPartition

        asked = [RdPartition(tp.topic, tp.partition, at) for tp, at in starts.items()]
        found = {(p.topic, p.partition): p.offset for p in self._consumer.offsets_for_times(asked, timeout=5)}
        assign = []
        for tp in starts:
            offset = found.get((tp.topic, tp.partition), -1)
            if offset is None or offset < 0:
                offset = self._consumer.get_watermark_offsets(RdPartition(tp.topic, tp.partition), timeout=5)[1]
            assign.append(RdPartition(tp.topic, tp.partition, offset))
        self._consumer.assign(assign)
        self._assigned = list(starts)

    def assignment(self) -> list[TopicPartition]:
        return list(self._assigned)

    def end_offsets(self, partitions: list[TopicPartition]) -> dict[TopicPartition, int]:
        from confluent_kafka import TopicPartition as RdPartition

        return {
            tp: self._consumer.get_watermark_offsets(RdPartition(tp.topic, tp.partition), timeout=5, cached=False)[1]
            for tp in partitions
        }

    def poll(self, timeout_ms: int = 100) -> dict[TopicPartition, list[Record]]:
        out: dict[TopicPartition, list[Record]] = {}
        for msg in self._consumer.consume(num_messages=1000, timeout=timeout_ms / 1000.0):
            if msg.error() is not None:  # a partition's end, a transient broker fault: librdkafka retries
                log.debug("telemetry reader: %s", msg.error())
                continue
            key = TopicPartition(msg.topic() or "", msg.partition() or 0)
            records = out.get(key)
            if records is None:
                records = out[key] = []
            records.append(Record(msg.offset() or 0, msg.value(), header_signature(msg.headers())))
        return out

    def close(self) -> None:
        self._consumer.close()
