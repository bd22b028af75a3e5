"""Telemetry really flows through the broker: staleness, restart recovery, malformed messages."""

from __future__ import annotations

import json
import signal
import time
from collections import Counter
from typing import Any

from kafka import KafkaProducer

from scenarios.stack.broker import EmbeddedBroker
from scenarios.stack.launcher import Stack
from telemetry.cluster.store import ViewStore
from telemetry.kafka.bus import TelemetryPublisher, ensure_topic
from telemetry.kafka.reader import KafkaTelemetrySource
from telemetry.kafka.signing import Signer, Verifier
from tests.helpers import load
from tests.integration.http import call, infer_body

STALE_MS = 600.0


def view_of(stack: Stack) -> dict[str, Any]:
    return {n["node_id"]: n for n in call(f"{stack.router_url}/admin/view")[1]["nodes"]}


def send_many(stack: Stack, n: int) -> Counter[str]:
    nodes: Counter[str] = Counter()
    for _ in range(n):
        status, _, headers = call(f"{stack.router_url}/v2/models/sensor_mlp/infer", infer_body())
        assert status == 200
        nodes[headers["x-edgeroute-node"]] += 1
    return nodes


def test_stopped_node_goes_stale_and_stops_receiving_traffic(own_stack) -> None:  # type: ignore[no-untyped-def]
    stack: Stack = own_stack(
        [
            {"id": "a", "partition": "edge-a", "models": ["sensor_mlp"]},
            {"id": "b", "partition": "edge-a", "models": ["sensor_mlp"]},
        ],
        router={"stale_after_ms": STALE_MS, "policy": {"preset": "round_robin"}},
    )
    assert set(send_many(stack, 10)) == {"a", "b"}
    proc = stack.nodes["b"].popen
    proc.send_signal(signal.SIGKILL)  # a crash: no draining message, telemetry just stops
    proc.wait(timeout=10)
    killed_at = time.monotonic()
    while view_of(stack)["b"]["fresh"]:
        assert time.monotonic() - killed_at < STALE_MS / 1000 + 1.0, "node b never went stale"
        time.sleep(0.05)
    went_stale_s = time.monotonic() - killed_at
    assert went_stale_s <= STALE_MS / 1000 + 0.5
    assert send_many(stack, 10) == Counter({"a": 10})
    stack.nodes.pop("b")


def test_draining_node_is_excluded_at_once(own_stack) -> None:  # type: ignore[no-untyped-def]
    stack: Stack = own_stack(
        [
            {"id": "a", "partition": "edge-a", "models": ["sensor_mlp"]},
            {"id": "b", "partition": "edge-a", "models": ["sensor_mlp"]},
        ],
        router={"stale_after_ms": 5000, "policy": {"preset": "round_robin"}},
    )
    stack.stop_node("b")  # SIGTERM: the node publishes `draining` on its way out
    deadline = time.monotonic() + 2.0
    while view_of(stack)["b"]["status"] != "draining":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert send_many(stack, 6) == Counter({"a": 6})


def test_restarted_router_rebuilds_its_view_from_kafka(own_stack) -> None:  # type: ignore[no-untyped-def]
    stack: Stack = own_stack(
        [
            {"id": "a", "partition": "edge-a", "models": ["sensor_mlp"]},
            {"id": "b", "partition": "cloud", "models": ["sensor_mlp", "echo"]},
        ],
        router={"lookback_ms": 3000},
    )
    time.sleep(1.0)  # let history accumulate
    stack.stop_router()
    stack.start_router()
    stack.wait_ready(20)
    view = call(f"{stack.router_url}/admin/view")[1]
    assert {n["node_id"] for n in view["nodes"]} == {"a", "b"}
    # the view came from history: reports published before the router started (over the second the
    # nodes ran before it, both nodes' at 10 a second at least), told apart from the live ones
    assert view["telemetry"]["from_history"] >= 10, view["telemetry"]
    assert view["telemetry"]["messages"] >= view["telemetry"]["from_history"]
    assert send_many(stack, 4)


def test_history_revives_no_dead_node_and_malformed_messages_are_counted(broker: EmbeddedBroker) -> None:
    topic = "edgeroute.telemetry.history"
    ensure_topic(broker.bootstrap, topic)
    now = time.time() * 1000
    pub = TelemetryPublisher(broker.bootstrap, topic)
    try:
        assert pub.publish(load("ghost", sent_at_ms=now - 2500))  # died 2.5 s ago
        assert pub.publish(load("alive", sent_at_ms=now - 50))
    finally:
        pub.close()
    raw = KafkaProducer(bootstrap_servers=broker.bootstrap)
    try:
        # (the last: a lone continuation byte in a string, once an error the reader retried forever)
        bad_utf8 = b'{"schema": 1, "node_id": "\x9c"}'
        for bad in [b"garbage", b"{}", json.dumps({"schema": 42}).encode(), b"", bad_utf8]:
            raw.send(topic, key=b"x", value=bad)
        raw.flush()
    finally:
        raw.close()
    store = ViewStore(stale_after_ms=1000)
    source = KafkaTelemetrySource(broker.bootstrap, topic, lookback_ms=5000)
    source.start(store)
    try:
        deadline = time.monotonic() + 10
        while store.messages + store.malformed < 7:
            assert time.monotonic() < deadline, (store.messages, store.malformed, source.errors)
            time.sleep(0.05)
    finally:
        source.stop()
    now = time.time() * 1000
    v = store.view
    assert set(v.nodes) == {"ghost", "alive"}
    assert not v.is_fresh(v.nodes["ghost"], now)
    assert v.is_fresh(v.nodes["alive"], now)
    assert store.malformed == 5 and source.errors == 0


class _BuggyStore(ViewStore):
    """A store whose parser has a bug that one message reaches (not a malformed message: an error)."""

    def parse(self, raw: bytes):  # type: ignore[no-untyped-def]
        if raw == b"poison":
            raise RuntimeError("a bug reached by this message")
        return super().parse(raw)


def test_a_batch_the_reader_cannot_handle_is_skipped_once_not_read_again_forever(broker: EmbeddedBroker) -> None:
    topic = "edgeroute.telemetry.poison"
    ensure_topic(broker.bootstrap, topic)
    store = _BuggyStore()
    source = KafkaTelemetrySource(broker.bootstrap, topic, lookback_ms=5000)
    source.start(store)
    raw = KafkaProducer(bootstrap_servers=broker.bootstrap)
    pub = TelemetryPublisher(broker.bootstrap, topic)
    try:
        assert source.assigned.wait(20)
        raw.send(topic, key=b"x", value=b"poison")
        raw.flush()
        deadline = time.monotonic() + 10
        while source.skipped_batches < 1:
            assert time.monotonic() < deadline, (source.errors, source.skipped_batches)
            time.sleep(0.02)
        assert pub.publish(load("after", sent_at_ms=time.time() * 1000))
        while "after" not in store.view.nodes:
            assert time.monotonic() < deadline, (source.errors, source.skipped_batches)
            time.sleep(0.02)
        time.sleep(0.3)  # (a reader that reconnected would have read the poison again by now)
        assert source.skipped_batches == 1 and source.errors == 0
        assert store.summary()["skipped"] == 1, "the store shows it, so /admin/view and /metrics do"
    finally:
        pub.close()
        raw.close()
        source.stop()


def test_malformed_telemetry_on_the_live_topic_is_counted_not_fatal(shared_stack: Stack) -> None:
    before = call(f"{shared_stack.router_url}/admin/view")[1]["telemetry"]["malformed"]
    raw = KafkaProducer(bootstrap_servers=shared_stack.bootstrap)
    signer = Signer.parse(shared_stack.telemetry_key)  # signed by the stack's key, yet malformed
    try:
        raw.send(
            shared_stack.topic,
            key=b"n1",
            value=signer.seal(shared_stack.topic, b'{"schema": 1, "node_id": 5}', time.time() * 1000),
        )
        raw.flush()
    finally:
        raw.close()
    deadline = time.monotonic() + 5
    while call(f"{shared_stack.router_url}/admin/view")[1]["telemetry"]["malformed"] <= before:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    status, _, _ = call(f"{shared_stack.router_url}/v2/models/sensor_mlp/infer", infer_body())
    assert status == 200
    metrics = call(f"{shared_stack.router_url}/metrics")[1]
    assert "edgeroute_telemetry_malformed_total" in metrics


def test_forged_and_unsigned_telemetry_changes_nothing_on_the_default_stack(shared_stack: Stack) -> None:
    """The stack signs its telemetry: an outsider announcing a node at an address of their choosing, or
    making a real node look idle or pushing it out with a far-future report, is dropped and counted."""
    url = shared_stack.router_url
    before = call(f"{url}/admin/view")[1]
    real = next(n for n in before["nodes"] if n["node_id"] == "n2")
    now = time.time() * 1000
    evil = load("evil", sent_at_ms=now).replace(endpoint="http://127.0.0.1:9")
    hijack = load("n2", queued=0, seq=10**9, sent_at_ms=now + 10_000_000).replace(endpoint="http://127.0.0.1:9")
    wrong = Signer.parse("stack-intruder:0123456789abcdef0123456789abcdef")
    raw = KafkaProducer(bootstrap_servers=shared_stack.bootstrap)
    try:
        for msg in (evil, hijack):
            raw.send(shared_stack.topic, key=msg.node_id.encode(), value=msg.to_json())  # unsigned
            raw.send(
                shared_stack.topic, key=msg.node_id.encode(), value=wrong.seal(shared_stack.topic, msg.to_json(), now)
            )
        raw.flush()
    finally:
        raw.close()
    deadline = time.monotonic() + 5
    while True:
        sig = call(f"{url}/admin/view")[1]["telemetry"]["signatures"]
        if sig["unsigned"] >= 2 and sig["unknown_key"] >= 2:
            break
        assert time.monotonic() < deadline, sig
        time.sleep(0.05)
    time.sleep(0.3)  # the real nodes keep reporting meanwhile
    after = call(f"{url}/admin/view")[1]
    assert {n["node_id"] for n in after["nodes"]} == {n["node_id"] for n in before["nodes"]}, "no node was added"
    n2 = next(n for n in after["nodes"] if n["node_id"] == "n2")
    assert n2["endpoint"] == real["endpoint"] and n2["fresh"], n2
    for _ in range(5):  # and traffic still goes to the real nodes only
        status, _, headers = call(f"{url}/v2/models/sensor_mlp/infer", infer_body())
        assert status == 200 and headers.get("x-edgeroute-node") in {"n1", "n2"}


def test_a_node_whose_clock_runs_behind_stays_fresh(own_stack: Any) -> None:
    """Freshness is judged by when the router received a report on the live stream, not by the node's
    clock: a node 3 s behind (three times `stale_after_ms`) is fresh; history read at start is still
    dated by its send time (the unit tests cover that half)."""
    stack: Stack = own_stack([{"id": "a", "partition": "edge-a", "models": ["sensor_mlp"]}])
    url = stack.router_url
    endpoint = next(n["endpoint"] for n in call(f"{url}/admin/view")[1]["nodes"] if n["node_id"] == "a")
    signer = Signer.parse(stack.telemetry_key)
    raw = KafkaProducer(bootstrap_servers=stack.bootstrap)
    try:
        for i in range(10):
            now = time.time() * 1000
            msg = load("behind", models={"sensor_mlp": 1.0}, seq=i + 1, sent_at_ms=now - 3000.0)
            msg = msg.replace(endpoint=endpoint)
            raw.send(stack.topic, key=b"behind", value=signer.seal(stack.topic, msg.to_json(), now))
            raw.flush()
            time.sleep(0.1)
    finally:
        raw.close()
    nodes = {n["node_id"]: n for n in call(f"{url}/admin/view")[1]["nodes"]}
    assert nodes["behind"]["fresh"] and nodes["behind"]["age_ms"] < 1000, nodes["behind"]


def test_a_key_bound_to_its_nodes_cannot_speak_for_another(broker: EmbeddedBroker) -> None:
    """Per-node keys bound with `telemetry_key_nodes`: a message validly signed with node a's key but
    naming node b is dropped and counted; the key still speaks for its own node."""
    from router.config import parse_config

    topic = "edgeroute.telemetry.bound"
    ensure_topic(broker.bootstrap, topic)
    key_a, key_b = "node-a:" + "a" * 32, "node-b:" + "b" * 32
    cfg = parse_config(
        {"telemetry_keys": [key_a, key_b], "telemetry_key_nodes": {"node-a": ["a", "a-*"], "node-b": ["b"]}}
    )
    verifier = cfg.verifier()
    assert verifier is not None
    store = ViewStore(stale_after_ms=1000)
    source = KafkaTelemetrySource(broker.bootstrap, topic, lookback_ms=0)
    source.verifier = verifier
    source.start(store)
    try:
        assert source.assigned.wait(10)
        now = time.time() * 1000
        pub_a = TelemetryPublisher(broker.bootstrap, topic, signer=Signer.parse(key_a))
        try:
            assert pub_a.publish(load("a", sent_at_ms=now))
            assert pub_a.publish(load("a-2", sent_at_ms=now))
            assert pub_a.publish(load("b", queued=0, sent_at_ms=now))  # node a's key, node b's id
        finally:
            pub_a.close()
        deadline = time.monotonic() + 10
        while verifier.accepted < 3:
            assert time.monotonic() < deadline, verifier.summary()
            time.sleep(0.05)
        time.sleep(0.2)
    finally:
        source.stop()
    assert set(store.view.nodes) == {"a", "a-2"} and verifier.unbound == 1, verifier.summary()


def test_a_reader_without_keys_accepts_signed_and_unsigned_alike(broker: EmbeddedBroker) -> None:
    """As the signing module says (signing rolls out publisher-first): a router with no keys at all
    read every signed message as malformed (0 nodes, every request 503)."""
    topic = "edgeroute.telemetry.nokeys"
    ensure_topic(broker.bootstrap, topic)
    store = ViewStore(stale_after_ms=1000)
    source = KafkaTelemetrySource(broker.bootstrap, topic, lookback_ms=0)
    assert source.verifier is None
    source.start(store)
    try:
        assert source.assigned.wait(10)
        now = time.time() * 1000
        signed = TelemetryPublisher(broker.bootstrap, topic, signer=Signer.parse("fleet:" + "k" * 32))
        plain = TelemetryPublisher(broker.bootstrap, topic)
        try:
            assert signed.publish(load("signed", sent_at_ms=now))
            assert plain.publish(load("plain", sent_at_ms=now))
        finally:
            signed.close()
            plain.close()
        deadline = time.monotonic() + 10
        while len(store.view.nodes) < 2:
            assert time.monotonic() < deadline, (store.summary(), sorted(store.view.nodes))
            time.sleep(0.05)
    finally:
        source.stop()
    assert set(store.view.nodes) == {"signed", "plain"} and store.summary()["malformed"] == 0


def test_telemetry_values_are_plain_json_any_kafka_tool_reads(shared_stack: Stack) -> None:
    """The signature rides in the `edgeroute-sig` record header; the value is the report itself."""
    from kafka import KafkaConsumer
    from kafka import TopicPartition as KafkaTopicPartition

    consumer = KafkaConsumer(bootstrap_servers=shared_stack.bootstrap, enable_auto_commit=False, group_id=None)
    try:
        parts = [KafkaTopicPartition(shared_stack.topic, p) for p in consumer.partitions_for_topic(shared_stack.topic)]
        consumer.assign(parts)
        # what the nodes publish from now on (other tests wrote raw records to this topic before)
        since = int(time.time() * 1000)
        time.sleep(0.3)
        for tp, found in consumer.offsets_for_times({tp: since for tp in parts}).items():
            if found is not None and found.timestamp is not None and found.timestamp >= since:
                consumer.seek(tp, found.offset)
            else:
                consumer.seek_to_end(tp)
        records = []
        deadline = time.monotonic() + 10
        while len(records) < 5:
            assert time.monotonic() < deadline
            for batch in consumer.poll(timeout_ms=200).values():
                records += [r for r in batch if r.timestamp >= since]
    finally:
        consumer.close()
    verifier = Verifier.parse([shared_stack.telemetry_key])
    for record in records[:5]:
        assert record.value.startswith(b"{"), record.value[:120]
        report = json.loads(record.value)  # plain JSON, no envelope
        assert report["schema"] == 1 and report["node_id"] in shared_stack.nodes
        sig = dict(record.headers)["edgeroute-sig"]
        kid = shared_stack.telemetry_key.split(":")[0]
        assert verifier.open_keyed(shared_stack.topic, record.value, time.time() * 1000, sig) == (kid, record.value)
