"""A lean Kafka reader: the few requests a telemetry reader needs, on one blocking socket per broker.

A router reads its topics by fetching hundreds of times a second, and kafka-python spends about
1.4 ms of CPU on each fetch round trip (its client thread, futures, selectors and record objects):
15-18% of a core on an idle router. This reader speaks the wire protocol itself, at the versions every
broker from Kafka 0.11 to 4.x serves (ApiVersions v0, Metadata v1, ListOffsets v1, Fetch v4, record
batches v2): one thread, one request encoded with `struct`, one answer decoded without an object
per record, no client thread. It only reads: topics are made and written with kafka-python.

It speaks PLAINTEXT and TLS (`tls`: Python's own ssl module on the same blocking sockets); a process
whose Kafka settings ask for SASL reads with librdkafka (telemetry.kafka.rdkafka; kafka-python without it),
as does one with `EDGEROUTE_KAFKA_READER` set so (telemetry.kafka.reader.reader_kind). A broker that
lacks these API versions raises `Unsupported`, and the caller falls back; nothing in the log does: a
batch this reader cannot read is dropped and counted (telemetry.kafka.records.decode_batches), so no
record can choose the reader, and with it whether inflation is bounded.

What a broker sends is read by telemetry.kafka.records (bounds-checked fields, record batches,
bounded inflation); a bad answer raises `KafkaWireError`.
"""

from __future__ import annotations

import logging
import socket
import ssl
import struct
import time
from collections.abc import Iterable

from telemetry.kafka.codecs import Inflation
from telemetry.kafka.records import (
    I16,
    I32,
    KafkaWireError,
    Reader,
    Record,
    TopicPartition,
    Unsupported,
    decode_batches,
)

__all__ = ["LeanConsumer"]

FETCH, LIST_OFFSETS, METADATA, API_VERSIONS = 1, 2, 3, 18
NEEDED = {FETCH: 4, LIST_OFFSETS: 1, METADATA: 1}  # the versions spoken here
LATEST = -1
log = logging.getLogger("edgeroute.telemetry")

MAX_ANSWER = 64 << 20  # an answer larger than this is refused
FETCH_MAX_BYTES = 32 << 20  # what a fetch asks for at most: a soft limit, well under MAX_ANSWER
RETRIABLE = {3, 5, 6, 7, 13, 14, 15, 56, 74, 75}  # topic/leader moved, broker busy: look again, go on
OFFSET_OUT_OF_RANGE = 1
# A fetch answered with no records for a partition whose high watermark is past the offset asked for
# (records there, none handed over) waits this much longer next time, doubling up to BEHIND_WAIT_MS:
# a broker that gathers records only within the fetch's wait (Tansu's memory storage reads a partition
# in time that grows with its length) would otherwise answer empty at every short wait, for good
BEHIND_WAIT_MS = 1000

_HEADER = struct.Struct(">hhi")  # api key, version, correlation id (the client id follows)
_FETCH_HEAD = struct.Struct(">iiiib")  # replica id, max wait, min bytes, max bytes, isolation level
_FETCH_PART = struct.Struct(">iqi")  # partition, fetch offset, partition max bytes
_PART_HEAD = struct.Struct(">ihqq")  # partition, error, high watermark, last stable offset


def _string(value: str) -> bytes:
    raw = value.encode()
    return I16.pack(len(raw)) + raw


class _Connection:
    """One broker connection; requests are sent and answered in order."""

    def __init__(
        self, host: str, port: int, timeout_s: float, client_id: str, tls: ssl.SSLContext | None = None
    ) -> None:
        try:
            self.sock = socket.create_connection((host, port), timeout=timeout_s)
        except OSError as exc:
            raise KafkaWireError(f"cannot reach broker {host}:{port}: {exc}") from None
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if tls is not None:  # the handshake within the request timeout, the name checked as the context says
            try:
                self.sock = tls.wrap_socket(self.sock, server_hostname=host)
            except (OSError, ValueError) as exc:
                raise KafkaWireError(f"broker {host}:{port}: TLS: {exc}") from None
        self.where = f"{host}:{port}"
        self.timeout_s = timeout_s
        self._client = _string(client_id)
        self._correlation = 0
        self._size = bytearray(4)

    def send(self, api: int, version: int, body: bytes) -> int:
        self._correlation = (self._correlation + 1) & 0x7FFFFFFF
        head = _HEADER.pack(api, version, self._correlation) + self._client
        try:
            self.sock.sendall(I32.pack(len(head) + len(body)) + head + body)
        except OSError as exc:
            raise KafkaWireError(f"broker {self.where}: {exc}") from None
        return self._correlation

    def _exactly(self, view: memoryview, deadline: float) -> None:
        """Fill `view` from the socket by `deadline` (time.monotonic()): the whole answer has that long,
        not each read, so a broker that sends a byte now and then cannot hold the reader forever."""
        got = 0
        while got < len(view):
            left = deadline - time.monotonic()
            if left <= 0:
                raise KafkaWireError(f"broker {self.where}: no whole answer within {self.timeout_s:g} s")
            try:
                self.sock.settimeout(left)
                n = self.sock.recv_into(view[got:])
            except OSError as exc:
                raise KafkaWireError(f"broker {self.where}: {exc}") from None
            if n == 0:
                raise KafkaWireError(f"broker {self.where} closed the connection")
            got += n

    def receive(self, correlation: int, wait_s: float = 0.0) -> Reader:
        deadline = time.monotonic() + self.timeout_s + wait_s
        self._exactly(memoryview(self._size), deadline)
        size = I32.unpack(self._size)[0]
        if size < 4 or size > MAX_ANSWER:
            raise KafkaWireError(f"broker {self.where}: answer of {size} bytes")
        buf = bytearray(size)
        self._exactly(memoryview(buf), deadline)
        answer = Reader(buf)
        if answer.i32() != correlation:
            raise KafkaWireError(f"broker {self.where}: answer to another request")
        return answer

    def ask(self, api: int, version: int, body: bytes) -> Reader:
        return self.receive(self.send(api, version, body))

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def _bootstrap_hosts(bootstrap: str) -> list[tuple[str, int]]:
    hosts = []
    for item in bootstrap.split(","):
        host, _, port = item.strip().rpartition(":")
        if host and port.isdigit():
            hosts.append((host.strip("[]"), int(port)))
    if not hosts:
        raise KafkaWireError(f"bootstrap {bootstrap!r}: no host:port")
    return hosts


class LeanConsumer:
    """Reads partitions from the offsets set by `seek_times`; `poll` is one fetch per leader.

    `partitions` looks a topic's partitions and their leaders up; `seek_times` maps each partition to a
    timestamp (ms): reading begins at the first record at or after it, or at the end when there is none.
    """

    def __init__(
        self,
        bootstrap: str,
        fetch_max_wait_ms: int = 10,
        request_timeout_ms: int = 5000,
        partition_max_bytes: int = 1 << 20,
        client_id: str = "edgeroute-router",
        inflation: Inflation | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.bootstrap = bootstrap
        self.tls = tls  # TLS to every broker (security_protocol SSL), else plaintext
        self.inflation = inflation or Inflation()  # what compressed batches may cost (telemetry.kafka.codecs)
        self.dropped_batches = 0  # batches dropped: not readable, or past the inflation budget
        self.fetch_max_wait_ms = max(1, fetch_max_wait_ms)
        self.timeout_s = request_timeout_ms / 1000.0
        self.partition_max_bytes = partition_max_bytes
        self.client_id = client_id
        self.offsets: dict[TopicPartition, int] = {}
        self._brokers: dict[int, tuple[str, int]] = {}
        self._leaders: dict[TopicPartition, int] = {}
        self._conns: dict[int, _Connection] = {}
        self._boot: _Connection | None = None
        self._stale = False  # leaders to look up again before the next fetch
        self.wait_ms = self.fetch_max_wait_ms  # this fetch's wait: longer while records are there unread
        self.behind_fetches = 0  # answers with records there and none handed over (each lengthens the wait)
        self._behind = False  # this fetch: some partition answered empty with records there

    # -- connections --------------------------------------------------------------------------

    def _bootstrap(self) -> _Connection:
        if self._boot is not None:
            return self._boot
        failures = []
        for host, port in _bootstrap_hosts(self.bootstrap):
            try:
                conn = _Connection(host, port, self.timeout_s, self.client_id, self.tls)
            except KafkaWireError as exc:
                failures.append(str(exc))
                continue
            try:
                self._check_versions(conn)
            except Exception:
                conn.close()
                raise
            self._boot = conn
            return conn
        raise KafkaWireError("; ".join(failures))

    def _check_versions(self, conn: _Connection) -> None:
        answer = conn.ask(API_VERSIONS, 0, b"")
        error = answer.i16()
        if error:
            raise KafkaWireError(f"ApiVersions: error {error}")
        served = {}
        for _ in range(answer.count(6)):
            key, low, high = answer.i16(), answer.i16(), answer.i16()
            served[key] = (low, high)
        for key, version in NEEDED.items():
            low, high = served.get(key, (1, 0))
            if not low <= version <= high:
                raise Unsupported(f"broker {conn.where} does not serve API {key} v{version}")

    def _leader(self, node: int) -> _Connection:
        conn = self._conns.get(node)
        if conn is None:
            if node not in self._brokers:
                raise KafkaWireError(f"no address for broker {node}")
            host, port = self._brokers[node]
            conn = _Connection(host, port, self.timeout_s, self.client_id, self.tls)
            self._conns[node] = conn
        return conn

    def _drop(self, node: int) -> None:
        conn = self._conns.pop(node, None)
        if conn is not None:
            conn.close()

    # -- lookups ------------------------------------------------------------------------------

    def partitions(self, topic: str) -> list[int]:
        """The topic's partitions (leaders remembered), [] while it has none or none with a leader."""
        found = self._metadata([topic])
        return sorted(tp.partition for tp in found if tp.topic == topic)

    def _metadata(self, topics: list[str]) -> set[TopicPartition]:
        body = I32.pack(len(topics)) + b"".join(_string(t) for t in topics)
        try:
            answer = self._bootstrap().ask(METADATA, 1, body)
        except Unsupported:
            raise
        except KafkaWireError:  # the bootstrap connection may have been closed as idle: once more, afresh
            if self._boot is not None:
                self._boot.close()
                self._boot = None
            answer = self._bootstrap().ask(METADATA, 1, body)
        for _ in range(answer.count(10)):
            node, host, port = answer.i32(), answer.string(), answer.i32()
            answer.string()  # rack
            if not 0 < port < 65536:
                raise KafkaWireError(f"broker {node} advertised port {port}")
            if self._brokers.get(node, (host, port)) != (host, port):
                self._drop(node)  # moved
            self._brokers[node] = (host, port)
        answer.i32()  # controller
        found = set()
        for _ in range(answer.count(8)):
            error, name = answer.i16(), answer.string()
            answer.i8()  # internal
            for _ in range(answer.count(18)):
                p_error, partition, leader = answer.i16(), answer.i32(), answer.i32()
                for _ in range(answer.count(4)):
                    answer.i32()  # replicas
                for _ in range(answer.count(4)):
                    answer.i32()  # in sync
                if error == 0 and p_error in (0, 9) and leader >= 0:  # 9: a replica is down, the leader serves
                    tp = TopicPartition(name, partition)
                    self._leaders[tp] = leader
                    found.add(tp)
        return found

    def list_offsets(self, times: dict[TopicPartition, int]) -> dict[TopicPartition, tuple[int, int]]:
        """(offset, timestamp) per partition: the first record at or after each time, or LATEST's end
        offset (timestamp -1); (-1, -1) where the partition holds none."""
        unknown = [tp for tp in times if tp not in self._leaders]
        if unknown:
            raise KafkaWireError(f"{unknown[0].topic}[{unknown[0].partition}]: no leader known")
        out: dict[TopicPartition, tuple[int, int]] = {}
        for leader, topics in self._by_leader(times).items():
            body = [I32.pack(-1), I32.pack(len(topics))]
            for topic, parts in topics.items():
                body += [_string(topic), I32.pack(len(parts))]
                body += [struct.pack(">iq", p, times[TopicPartition(topic, p)]) for p in parts]
            try:
                answer = self._leader(leader).ask(LIST_OFFSETS, 1, b"".join(body))
            except KafkaWireError:
                self._drop(leader)
                raise
            for _ in range(answer.count(6)):
                topic = answer.string()
                for _ in range(answer.count(22)):
                    partition, error, stamp, offset = answer.i32(), answer.i16(), answer.i64(), answer.i64()
                    if error:
                        raise KafkaWireError(f"ListOffsets {topic}[{partition}]: error {error}")
                    out[TopicPartition(topic, partition)] = (offset, stamp)
        return out

    def _by_leader(self, partitions: Iterable[TopicPartition]) -> dict[int, dict[str, list[int]]]:
        """Leader -> topic -> partition numbers, for the partitions whose leader is known."""
        out: dict[int, dict[str, list[int]]] = {}
        for tp in partitions:
            leader = self._leaders.get(tp)
            if leader is not None:
                out.setdefault(leader, {}).setdefault(tp.topic, []).append(tp.partition)
        return out

    # -- the interface a TopicReader uses --------------------------------------------------------

    def seek_times(self, starts: dict[TopicPartition, int]) -> None:
        """Start each partition at the first record at or after its time (ms), or at its end."""
        found = self.list_offsets(starts)
        ends = self.end_offsets(list(starts))
        for tp, start_ms in starts.items():
            offset, stamp = found.get(tp, (-1, -1))
            # "no such record" is offset -1 on Apache Kafka and (0, -1) on some brokers
            self.offsets[tp] = offset if offset >= 0 and stamp >= start_ms else ends[tp]

    def assignment(self) -> list[TopicPartition]:
        return list(self.offsets)

    def end_offsets(self, partitions: list[TopicPartition]) -> dict[TopicPartition, int]:
        return {tp: max(found[0], 0) for tp, found in self.list_offsets(dict.fromkeys(partitions, LATEST)).items()}

    def poll(self, timeout_ms: int = 100) -> dict[TopicPartition, list[Record]]:
        """One fetch from every leader (each waits up to `fetch_max_wait_ms` for data); the records read.
        A partition whose leader moved is looked up again before the next poll; one whose offset the
        broker no longer holds restarts at its end. `timeout_ms` is kafka-python's argument, unused: the
        wait is the fetch's."""
        del timeout_ms
        if self._stale:
            self._stale = False
            self._metadata(sorted({tp.topic for tp in self.offsets}))
        by_leader = self._by_leader(self.offsets)
        if not by_leader:
            self._stale = True
            raise KafkaWireError("no partition has a leader")
        sent = []
        head = _FETCH_HEAD.pack(-1, self.wait_ms, 1, FETCH_MAX_BYTES, 0)
        for leader, topics in by_leader.items():
            body = [head, I32.pack(len(topics))]
            for topic, parts in topics.items():
                body += [_string(topic), I32.pack(len(parts))]
                body += [
                    _FETCH_PART.pack(p, self.offsets[TopicPartition(topic, p)], self.partition_max_bytes) for p in parts
                ]
            try:
                conn = self._leader(leader)
                sent.append((leader, conn, conn.send(FETCH, 4, b"".join(body))))
            except KafkaWireError:
                self._drop(leader)
                self._stale = True
        if not sent:
            raise KafkaWireError("no partition leader could be reached")
        out: dict[TopicPartition, list[Record]] = {}
        self._behind = False
        for leader, conn, correlation in sent:
            try:
                answer = conn.receive(correlation, self.wait_ms / 1000.0)
                self._fetched(answer, out)
            except Unsupported:
                raise
            except KafkaWireError:
                self._drop(leader)
                self._stale = True
                raise
        if self._behind:  # a partition's records there, none handed over: wait longer next time
            self.behind_fetches += 1
            self.wait_ms = min(BEHIND_WAIT_MS, self.wait_ms * 2)
            n = self.behind_fetches
            if n >= 64 and n & (n - 1) == 0:  # (the 64th, 128th...: a slow broker, not one late answer)
                log.warning("the broker answered %d fetches empty with records there; waiting up to %d ms",
                            n, BEHIND_WAIT_MS)  # fmt: skip
        else:
            self.wait_ms = self.fetch_max_wait_ms
        return out

    def _fetched(self, answer: Reader, out: dict[TopicPartition, list[Record]]) -> None:
        answer.i32()  # throttle time
        reset = {}
        for _ in range(answer.count(6)):
            topic = answer.string()
            for _ in range(answer.count(30)):
                partition, error, high, _stable = answer.fields(_PART_HEAD)
                for _ in range(answer.count(16)):
                    answer.i64(), answer.i64()  # aborted transactions (read uncommitted: kept)
                data = answer.blob()
                tp = TopicPartition(topic, partition)
                if tp not in self.offsets:
                    continue
                if error == OFFSET_OUT_OF_RANGE or (not error and self.offsets[tp] > high >= 0):
                    reset[tp] = LATEST  # (past the high watermark: some brokers answer that without an error)
                elif error in RETRIABLE:
                    self._stale = True
                elif error:
                    raise KafkaWireError(f"Fetch {topic}[{partition}]: error {error}")
                elif data:
                    records: list[Record] = []
                    dropped: list[str] = []
                    self.offsets[tp] = decode_batches(data, self.offsets[tp], records, self.inflation, dropped)
                    for reason in dropped:
                        self.dropped_batches += 1
                        n = self.dropped_batches
                        if n & (n - 1) == 0:  # the 1st, 2nd, 4th...: a log full of bad batches cannot flood it
                            log.warning("%s: record batch dropped (%d so far): %s", tp, n, reason[:300])
                    if records:
                        out[tp] = records
                elif high > self.offsets[tp]:
                    self._behind = True  # (an empty answer though records are there: `poll` waits longer)
        if reset:
            self.offsets.update(self.end_offsets(list(reset)))

    def close(self) -> None:
        for node in list(self._conns):
            self._drop(node)
        if self._boot is not None:
            self._boot.close()
            self._boot = None
