"""Active-active routers: in-flight load exchanged through the real broker, and two router processes
on one port that see each other's dispatches."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from scenarios.stack.broker import EmbeddedBroker
from scenarios.stack.launcher import Stack
from scenarios.stack.procs import http_json
from telemetry.cluster.store import ViewStore
from telemetry.kafka.bus import TelemetryPublisher, ensure_topic
from telemetry.kafka.peers import PeerLoads, PeerPublisher
from telemetry.kafka.reader import KafkaTelemetrySource
from tests.helpers import load
from tests.integration.conftest import scenario


def _until(cond: object, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():  # type: ignore[operator]
            return True
        time.sleep(0.02)
    return False


def test_in_flight_counts_travel_between_routers_through_the_broker(broker: EmbeddedBroker) -> None:
    topic = f"edgeroute.routers.t{time.time_ns()}"
    ensure_topic(broker.bootstrap, topic)
    a_pub = PeerPublisher(broker.bootstrap, "a", topic)
    b_pub = PeerPublisher(broker.bootstrap, "b", topic)
    b_loads = PeerLoads(broker.bootstrap, "b", topic, stale_after_ms=1500)
    b_loads.start()
    try:
        assert b_loads.assigned.wait(10)
        msg = a_pub.snapshot({"n1": 5, "n2": 1}, {"n1": 2, "n2": 1}, time.time() * 1000)
        assert msg is not None
        a_pub.submit(msg)
        own = b_pub.snapshot({"n1": 7}, {}, time.time() * 1000)
        assert own is not None
        b_pub.submit(own)  # a router's own messages are not counted as remote load
        assert _until(lambda: b_loads.remote("n1") == 3), f"saw {b_loads.remote('n1')}"
        assert b_loads.remote("n2") == 0 and b_loads.peers == 1
        # the running sums move on: 2 more dispatched to n1, 3 settled
        later = a_pub.snapshot({"n1": 7, "n2": 1}, {"n1": 5, "n2": 1}, time.time() * 1000)
        assert later is not None and later.seq == 1
        a_pub.submit(later)
        assert _until(lambda: b_loads.remote("n1") == 2)
        # a router that goes silent drops out of the sum after stale_after_ms
        assert _until(lambda: b_loads.remote("n1") == 0, timeout_s=5)
        assert b_loads.peers == 0
        # garbage on the topic is counted and skipped
        a_pub.sender.send(None, b'{"schema": 1, "router_id": ""}', int(time.time() * 1000))
        a_pub.sender.send(None, b"not json", int(time.time() * 1000))
        assert _until(lambda: b_loads.malformed == 2)
    finally:
        b_loads.stop()
        a_pub.close()
        b_pub.close()


def test_one_consumer_carries_telemetry_and_the_peers_topic(broker: EmbeddedBroker) -> None:
    telemetry_topic = f"edgeroute.telemetry.c{time.time_ns()}"
    peers_topic = f"{telemetry_topic}.routers"
    ensure_topic(broker.bootstrap, telemetry_topic)
    ensure_topic(broker.bootstrap, peers_topic)
    source = KafkaTelemetrySource(broker.bootstrap, telemetry_topic, lookback_ms=5000, fetch_max_wait_ms=10)
    loads = PeerLoads(broker.bootstrap, "b", peers_topic, stale_after_ms=5000, fetch_max_wait_ms=5)
    with pytest.raises(ValueError):
        source.carry(PeerLoads("127.0.0.1:1", "b", peers_topic))  # another broker: needs its own consumer
    source.carry(loads)
    store = ViewStore(stale_after_ms=5000)
    pub = TelemetryPublisher(broker.bootstrap, telemetry_topic)
    a_pub = PeerPublisher(broker.bootstrap, "a", peers_topic)
    loads.start()  # carried: starts nothing of its own
    source.start(store)
    try:
        assert loads.assigned.wait(10) and source.assigned.wait(1)
        assert pub.publish(load("n1", sent_at_ms=time.time() * 1000))
        msg = a_pub.snapshot({"n1": 4}, {"n1": 1}, time.time() * 1000)
        assert msg is not None
        a_pub.submit(msg)
        assert _until(lambda: "n1" in store.view.nodes and loads.remote("n1") == 3)
        threads = [t.name for t in threading.enumerate()]
        assert threads.count("telemetry-consumer") == 1 and "peers-consumer" not in threads
        with pytest.raises(ValueError):
            source.carry(PeerLoads(broker.bootstrap, "c", f"{peers_topic}.2"))  # already running
    finally:
        source.stop()
        loads.stop()
        pub.close()
        a_pub.close()
    assert "telemetry-consumer" not in [t.name for t in threading.enumerate()]


def test_two_router_processes_share_one_port_and_each_others_load(broker: EmbeddedBroker, tmp_path: Path) -> None:
    sc = scenario([{"id": "n1", "partition": "edge-a", "models": ["sensor_mlp"], "speed": 0.01}])
    stack = Stack(sc, kafka=broker.bootstrap, log_dir=tmp_path, topic=f"edgeroute.telemetry.aa{time.time_ns()}")
    stack.routers = 2
    procs = []
    try:
        stack.start()
        procs = list(stack.peers)
        assert len(procs) == 2 and len({p.port for p in procs}) == 1
        ids: set[str] = set()
        peers_seen: dict[str, int] = {}

        def both_know_each_other() -> bool:
            status, view = http_json(f"{stack.router_url}/admin/view")
            if status == 200:
                ids.add(view["router_id"])
                peers_seen[view["router_id"]] = view["peers"]["routers"]
            return len(ids) == 2 and all(n == 1 for n in peers_seen.values())

        assert _until(both_know_each_other, 20), f"routers {ids}, peers seen {peers_seen}"
    finally:
        stack.stop()
    assert procs and all(p.popen.poll() is not None for p in procs), "both router processes stopped"


def test_a_nodes_key_cannot_sign_another_routers_load(broker: EmbeddedBroker) -> None:
    """With keys bound to nodes (telemetry_key_nodes), a peer message `{"router_id": "router-b",
    "dispatched": {"n2": 1000000}}` signed with node n1's key made n2 look swamped to every router (60 of
    60 requests then went to n1). A key bound to nodes now speaks for those nodes only; a router's
    message needs a key that is not, or one bound to `router:<id>`."""
    from telemetry.kafka.signing import Signer, Verifier

    topic = f"edgeroute.routers.bound{time.time_ns()}"
    ensure_topic(broker.bootstrap, topic)
    node_key = "n1key:" + "a" * 32
    router_key = "routers:" + "b" * 32
    verifier = Verifier.parse([node_key, router_key])
    verifier.bindings = {"n1key": ("n1",)}
    forger = PeerPublisher(broker.bootstrap, "router-b", topic, signer=Signer.parse(node_key))
    honest = PeerPublisher(broker.bootstrap, "router-c", topic, signer=Signer.parse(router_key))
    loads = PeerLoads(broker.bootstrap, "router-a", topic, stale_after_ms=5000)
    loads.verifier = verifier
    loads.start()
    try:
        assert loads.assigned.wait(10)
        forged = forger.snapshot({"n2": 1_000_000}, {}, time.time() * 1000)
        real = honest.snapshot({"n2": 3}, {}, time.time() * 1000)
        assert forged is not None and real is not None
        forger.submit(forged)
        honest.submit(real)
        assert _until(lambda: loads.remote("n2") == 3), f"saw {loads.remote('n2')}"
        time.sleep(0.5)
        assert loads.remote("n2") == 3 and loads.peers == 1, "the forged load is not counted"
        assert verifier.unbound >= 1
    finally:
        loads.stop()
        forger.close()
        honest.close()
