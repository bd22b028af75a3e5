import json

import pytest

from telemetry.cluster.schema import SCHEMA_VERSION, MalformedTelemetry, NodeLoad
from telemetry.cluster.store import CATCH_UP_LAG_MS, ViewStore
from tests.helpers import load


def test_roundtrip_keeps_every_field() -> None:
    msg = load("n1", queued=3, in_flight=1, capacity=2)
    back = NodeLoad.parse(msg.to_json())
    assert back == msg
    assert json.loads(msg.to_json())["schema"] == SCHEMA_VERSION
    assert back.queued == 3


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (b"not json", "message"),
        (b"[]", "message"),
        (b"", "message"),
        (json.dumps({"schema": 1}).encode(), "node_id"),
        (load("n").to_json().replace(b'"tier":"edge"', b'"tier":"moon"'), "tier"),
        (load("n").to_json().replace(b'"schema":1', b'"schema":99'), "newer"),
        (load("n").to_json().replace(b'"in_flight":0', b'"in_flight":-2'), "in_flight"),
        (load("n", queued=1).to_json().replace(b'{"0":1}', b'{"high":1}'), "queued_by_priority"),
    ],
)
def test_malformed_messages_are_rejected_with_a_reason(raw: bytes, needle: str) -> None:
    with pytest.raises(MalformedTelemetry, match=needle):
        NodeLoad.parse(raw)


def test_unknown_fields_of_the_same_version_are_ignored() -> None:
    raw = json.loads(load("n1").to_json())
    raw["gpu_temperature_c"] = 71
    assert NodeLoad.parse(json.dumps(raw)).node_id == "n1"


def test_store_counts_and_skips_malformed_and_keeps_the_view() -> None:
    store = ViewStore()
    assert store.apply_raw(load("n1").to_json(), 1_005.0)
    before = store.view
    assert not store.apply_raw(b"{broken", 1_006.0)
    assert not store.apply_raw(load("n1").to_json().replace(b'"schema":1', b'"schema":2'), 1_007.0)
    assert store.malformed == 2
    assert store.view is before


def test_store_swaps_whole_views_and_ignores_older_messages() -> None:
    store = ViewStore()
    store.apply(load("n1", seq=2, sent_at_ms=2_000.0), 2_001.0)
    first = store.view
    assert not store.apply(load("n1", seq=1, sent_at_ms=1_000.0), 2_002.0)
    assert store.view is first and store.out_of_order == 1
    store.apply(load("n2", sent_at_ms=2_000.0), 2_003.0)
    assert set(store.view.nodes) == {"n1", "n2"}
    assert set(first.nodes) == {"n1"}, "old snapshots are never mutated"


def test_staleness_is_data() -> None:
    store = ViewStore(stale_after_ms=500.0)
    store.apply(load("n1", sent_at_ms=1_000.0), 1_010.0)
    view = store.view
    node = view.nodes["n1"]
    assert view.is_fresh(node, 1_500.0)
    assert not view.is_fresh(node, 1_511.0)
    assert view.age_ms("n1", 1_210.0) == pytest.approx(200.0)


def test_history_read_after_a_restart_is_dated_by_its_send_time() -> None:
    store = ViewStore(stale_after_ms=1000.0)
    sent = 10_000.0
    store.apply(load("dead", sent_at_ms=sent), sent + CATCH_UP_LAG_MS + 3_000.0)
    node = store.view.nodes["dead"]
    assert node.heard_at_ms == sent
    assert not store.view.is_fresh(node, sent + CATCH_UP_LAG_MS + 3_000.0)


def test_the_live_stream_is_dated_by_receipt_whatever_the_node_clock() -> None:
    store = ViewStore(stale_after_ms=1000.0)
    now = 100_000.0
    store.apply_many([load("behind", sent_at_ms=now - 5_000.0)], now, history=False)
    store.apply_many([load("old", sent_at_ms=now - 5_000.0)], now, history=True)
    assert store.view.is_fresh(store.view.nodes["behind"], now + 500.0)
    assert store.view.nodes["old"].heard_at_ms == now - 5_000.0
    assert not store.view.is_fresh(store.view.nodes["old"], now)


def test_ewma_lookup_scales_from_nearest_smaller_batch() -> None:
    from telemetry.cluster.schema import ModelLoad

    m = ModelLoad(ewma_ms_by_batch={"1": 2.0, "4": 6.0})
    assert m.ewma_ms(1) == 2.0
    assert m.ewma_ms(4) == 6.0
    assert m.ewma_ms(8) == pytest.approx(12.0)
    assert m.ewma_ms(2) == pytest.approx(4.0)
    assert ModelLoad().ewma_ms(1) is None


def test_the_peer_publisher_keeps_at_most_one_message_waiting() -> None:
    """A slow or absent broker must not grow a queue: while a send blocks, newer messages replace the
    one waiting (each carries running sums), and the latest is sent once the worker is free."""
    import threading

    from telemetry.kafka.peers import PeerPublisher

    release = threading.Event()
    sent: list[int] = []

    class SlowSender:
        def send(self, key: bytes, value: bytes, timestamp_ms: int) -> bool:
            release.wait(5)
            sent.append(timestamp_ms)
            return True

        def close(self) -> None:
            return None

    pub = PeerPublisher("127.0.0.1:9", "r1")
    pub.sender = SlowSender()  # type: ignore[assignment]
    try:
        for t in range(1, 1001):
            msg = pub.snapshot({"n": t}, {}, float(t))
            assert msg is not None
            pub.submit(msg)
        assert pub.superseded == 998  # the first is being sent, the last waits, the rest were replaced
        release.set()
    finally:
        pub.close()
    assert sent == [1, 1000]
