"""Telemetry is hostile input: bounds on every field, a clock window, eviction, and a generated attack
on the parser, the store and the policies (no sockets)."""

from __future__ import annotations

import copy
import json
import math
import random
from typing import Any

import pytest

from policies import Context, RouteRequest, build_policy
from policies.presets import PRESETS
from telemetry.cluster.schema import MalformedTelemetry, NodeLoad
from telemetry.cluster.store import MAX_CLOCK_AHEAD_MS, ViewStore
from telemetry.oip.wire import MAX_PRIORITY
from tests.helpers import load, mutated

NOW = 1_700_000_000_000.0


def valid() -> dict[str, Any]:
    msg = json.loads(load("n1", queued=2, wait={"0": 5.0, "10": 1.0}, sent_at_ms=NOW).to_json())
    msg["models"]["m"]["ewma_ms_by_batch"] = {"1": 4.0, "4": 9.0}
    return msg


def with_(path: str, value: Any) -> bytes:
    msg = valid()
    *head, last = path.split(".")
    target = msg
    for key in head:
        target = target[key]
    target[last] = value
    return json.dumps(msg).encode()


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("queued_by_priority", {"0": -5}),
        ("queued_by_priority", {"abc": 1}),
        ("queued_by_priority", {"01": 1}),
        ("queued_by_priority", {str(10**12): 1}),
        ("queued_by_priority", {str(p): 1 for p in range(100)}),
        ("expected_wait_ms", {"abc": 1.0}),
        ("expected_wait_ms", {"0": -1.0}),
        ("expected_wait_ms", {"0": 1e300}),
        ("models.m.ewma_ms_by_batch", {"0": 1.0}),
        ("models.m.ewma_ms_by_batch", {"1": -2.0}),
        ("models.m.load_ms", 1e308),
        ("models.m.queued", -1),
        ("sent_at_ms", 1e300),
        ("started_at_ms", 1e300),
        ("in_flight", -3),
        ("in_flight", 10**9),
        ("capacity", 0),
        ("capacity", 10**6),
        ("utilisation", 1.5),
        ("memory_used_bytes", 1 << 60),
        ("node_id", "a b"),
        ("node_id", "x" * 200),
        ("node_id", "n\\u0000"),
        ("node_id", "n1\n"),
        ("partition", "edge-a\n"),
        ("partition", ""),
        ("partition", "edge/../a"),
        ("endpoint", "ftp://10.0.0.1"),
        ("endpoint", "http://user:pw@10.0.0.1:8000"),
        ("endpoint", "http://10.0.0.1:8000/?redirect=x"),
        ("endpoint", "http://10.0.0.1:99999"),
        ("endpoint", "http:///nohost"),
        ("models", {f"m{i}": {} for i in range(2000)}),
        ("models", {"bad name": {}}),
        ("models", {"m\n": {}}),
        ("queued_by_priority", {"1\n": 1}),
        ("models.m.ewma_ms_by_batch", {"4\n": 1.0}),
        ("device", {"kind": "cpu", "name": "x" * 500}),
    ],
)
def test_out_of_bounds_telemetry_is_malformed(path: str, value: Any) -> None:
    with pytest.raises(MalformedTelemetry):
        NodeLoad.parse(with_(path, value))


def test_non_finite_numbers_are_malformed() -> None:
    for field in ("sent_at_ms", "utilisation"):
        raw = with_(field, 0.0).replace(b'"' + field.encode() + b'": 0.0', b'"' + field.encode() + b'": NaN')
        with pytest.raises(MalformedTelemetry):
            NodeLoad.parse(raw)


@pytest.mark.parametrize("where", ["node_id", "models", "expected_wait_ms", "device.name"])
def test_bytes_that_are_not_utf8_inside_a_string_are_malformed(where: str) -> None:
    """Invalid UTF-8 in a value or a key is a malformed message like any other, not another error that
    would escape the parser (the reader would then reconnect and read the same message again, forever)."""
    marker = "\u2603"  # replaced by a lone continuation byte below
    msg = valid()
    if where == "node_id":
        msg["node_id"] = marker
    elif where == "models":
        msg["models"] = {marker: msg["models"]["m"]}
    elif where == "expected_wait_ms":
        msg["expected_wait_ms"] = {marker: 1.0}
    else:
        msg["device"]["name"] = marker
    raw = json.dumps(msg, ensure_ascii=False).encode().replace(marker.encode(), b"\x9c")
    with pytest.raises(MalformedTelemetry):
        NodeLoad.parse(raw)


def test_generated_hostile_bytes_never_raise_anything_but_malformed() -> None:
    """Byte-level mutations of a valid report (flipped, cut and inserted bytes): each parses or is
    MalformedTelemetry, and the store counts the rest as malformed without raising."""
    rng = random.Random(7)
    base = json.dumps(valid()).encode()
    cases = [b"[" * 100_000, b'{"schema":' * 50_000, b"\xff\xfe", b"", b"null", base + b"x", base[:-1]]
    for _ in range(5000):
        b = bytearray(base)
        for _ in range(rng.randrange(1, 6)):
            op, at = rng.randrange(3), rng.randrange(len(b))
            if op == 0:
                b[at] = rng.randrange(256)
            elif op == 1:
                del b[at : at + rng.randrange(1, 20)]
            else:
                b[at:at] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 5)))
        cases.append(bytes(b))
    parsed = malformed = 0
    for raw in cases:
        try:
            NodeLoad.parse(raw)
            parsed += 1
        except MalformedTelemetry:
            malformed += 1
    assert parsed > 100 and malformed > 3000
    store = ViewStore()
    for raw in cases[:500]:
        store.apply_raw(raw, NOW)  # never raises
    assert store.malformed > 300


def test_a_valid_message_still_parses() -> None:
    msg = NodeLoad.parse(json.dumps(valid()).encode())
    assert msg.queued == 2 and msg.models["m"].ewma_ms(4) == 9.0


def test_a_forged_future_timestamp_cannot_push_a_real_node_out() -> None:
    store = ViewStore()
    forged = NodeLoad.parse(with_("sent_at_ms", NOW + 10 * MAX_CLOCK_AHEAD_MS))
    assert store.apply(forged, NOW) is False and store.from_future == 1
    genuine = NodeLoad.parse(with_("sent_at_ms", NOW - 5))
    assert store.apply(genuine, NOW) is True, "the genuine report is not 'out of order'"
    slightly_ahead = NodeLoad.parse(with_("sent_at_ms", NOW + 500))  # a node clock a little fast: fine
    assert store.apply(slightly_ahead, NOW + 10)


def test_silent_nodes_leave_the_view() -> None:
    store = ViewStore(evict_after_ms=60_000)
    store.apply(load("quiet", sent_at_ms=NOW), NOW)
    store.apply(load("busy", sent_at_ms=NOW), NOW)
    for k in range(1, 62):
        store.apply(load("busy", seq=k + 1, sent_at_ms=NOW + k * 1000), NOW + k * 1000)
    assert store.view.get("quiet") is None and store.view.get("busy") is not None
    assert store.evicted == 1
    assert [n.node_id for n in store.view.serving("m")] == ["busy"], "the model index follows"


def test_invented_node_ids_cannot_grow_the_view_past_its_bound() -> None:
    """Reports of new node ids past `max_nodes` are dropped and counted, in one batch or many, while the
    nodes already in the view keep reporting; room made by an eviction is taken again."""
    store = ViewStore(max_nodes=5, evict_after_ms=60_000)
    assert store.apply_many([load(f"n{i}", sent_at_ms=NOW) for i in range(8)], NOW) == 5
    assert len(store.view) == 5 and store.over_capacity == 3
    assert store.apply(load("intruder", sent_at_ms=NOW + 1), NOW + 1) is False and store.over_capacity == 4
    assert store.apply(load("n0", seq=2, sent_at_ms=NOW + 2), NOW + 2), "a known node still reports"
    assert store.summary()["over_capacity"] == 4
    for k in range(1, 62):  # n1..n4 fall silent and are evicted; n0 keeps reporting
        store.apply(load("n0", seq=k + 2, sent_at_ms=NOW + k * 1000), NOW + k * 1000)
    assert len(store.view) == 1
    assert store.apply(load("late", sent_at_ms=NOW + 62_000), NOW + 62_000), "room again after evictions"


def test_peer_messages_are_bounded_in_routers_and_in_nodes_per_message() -> None:
    """Every peer message is summed into the totals on each batch: a publisher inventing router ids,
    padding a message with node ids or sending negative counts is dropped and counted, and a router
    that falls silent frees its place for a new one."""
    from telemetry.kafka.peers import MAX_PEER_NODES, MAX_PEERS, PeerLoads

    def msg(router: str, seq: int = 1, **counts: object) -> bytes:
        body = {"schema": 1, "router_id": router, "seq": seq, "sent_at_ms": NOW, "dispatched": {"n1": 2}}
        return json.dumps({**body, **counts}).encode()

    loads = PeerLoads("127.0.0.1:1", "me", stale_after_ms=1000)  # (not started: nothing connects)

    def poll(values: list[bytes], at: float) -> None:  # what the reader thread does with one poll's records
        loads._handle(values, at)
        loads._tick(at)

    poll([msg(f"r{i}") for i in range(MAX_PEERS + 5)], NOW)
    assert loads.peers == MAX_PEERS and loads.over_capacity == 5 and loads.remote("n1") == 2 * MAX_PEERS
    padded = {f"n{i}": 1 for i in range(MAX_PEER_NODES + 1)}
    poll([msg("r0", 2, dispatched=padded), msg("r1", 2, settled={"n1": -5})], NOW + 1)
    assert loads.malformed == 2 and loads.remote("n1") == 2 * MAX_PEERS, "neither counted"
    poll([msg("newcomer")], NOW + 2_000)  # every earlier router is silent past stale_after_ms
    assert loads.peers == 1 and loads.remote("n1") == 2 and loads.over_capacity == 5


HOSTILE = [
    -1, -(2**63), 2**64, 1e300, -1e300, float("inf"), float("nan"), "", "x" * 300, "../..", None, True,
    [], {}, {"abc": 1}, {"-1": -1}, "http://a@b", 0, 1,
]  # fmt: skip
NEW_KEYS = ["abc", "-5", "0", "99999999999", "1e3"]


def _mutate(msg: Any, rng: random.Random) -> Any:
    return mutated(msg, rng, HOSTILE, NEW_KEYS)


def test_generated_hostile_telemetry_never_crashes_and_never_passes_out_of_bounds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rng = random.Random(2026)
    store = ViewStore()
    base = valid()
    accepted = 0
    for i in range(3000):
        msg = copy.deepcopy(base)
        msg["node_id"] = f"n{i % 50}"
        msg["seq"] = i
        msg["sent_at_ms"] = NOW + i
        for _ in range(rng.randrange(1, 4)):
            msg = _mutate(msg, rng)
        raw = json.dumps(msg, allow_nan=True).encode()
        if store.apply_raw(raw, NOW + i):  # counted and skipped when malformed; never raises
            accepted += 1
    assert store.malformed > 1000 and accepted > 100
    for n in store.view:
        load_ = n.load
        assert load_.queued >= 0 and math.isfinite(load_.sent_at_ms) and 0 <= load_.utilisation <= 1
        for p, w in load_.expected_wait_ms.items():
            assert int(p) == int(p) and math.isfinite(w) and w >= 0
        for m in load_.models.values():
            assert all(int(b) >= 1 and math.isfinite(v) and v >= 0 for b, v in m.ewma_ms_by_batch.items())
    # every policy decides on whatever was accepted without raising
    for preset in sorted(PRESETS):
        policy = build_policy(preset)
        for k in range(50):
            req = RouteRequest("m", rng.choice((0, 10, -1)), rng.choice((None, 50.0, 500.0)), "edge-a", 1, f"q{k}")
            policy.choose(req, store.view, Context(NOW + 3000, random.Random(k)))
    # ... and on the columnar path (forced for these few nodes), choosing as the per-node path does
    from policies import pipeline

    monkeypatch.setattr(pipeline, "COLUMNS_MIN", 1)
    for preset in sorted(PRESETS):
        columnar, per_node = build_policy(preset), build_policy(preset)
        per_node.columnar = False
        for k in range(50):
            req = RouteRequest("m", rng.choice((0, 10, -1)), rng.choice((None, 50.0, 500.0)), "edge-a", 1, f"q{k}")
            a = columnar.choose(req, store.view, Context(NOW + 3000, random.Random(k)))
            b = per_node.choose(req, store.view, Context(NOW + 3000, random.Random(k)))
            assert a == b, (preset, req)


def test_the_views_partitions_follow_its_nodes() -> None:
    store = ViewStore()
    store.apply(load("a", partition="edge-a", sent_at_ms=NOW), NOW)
    assert store.view.has_partition("edge-a") and not store.view.has_partition("cloud")
    store.apply(load("a", partition="cloud", seq=2, sent_at_ms=NOW + 1), NOW + 1)  # moved
    assert store.view.has_partition("cloud") and not store.view.has_partition("edge-a")
    store.apply(load("b", partition="edge-b", sent_at_ms=NOW + 2), NOW + 2)  # joined
    assert store.view.has_partition("edge-b") and store.view.has_partition("cloud")


@pytest.mark.parametrize("where", ["priority", "batch"])
def test_integer_keys_are_exactly_the_canonical_integers_in_range(where: str) -> None:
    """The key patterns against int(): generated keys in and around the range, written every way."""
    lo, hi = (-MAX_PRIORITY, MAX_PRIORITY) if where == "priority" else (1, 1 << 16)
    rng = random.Random(5)
    numbers = [lo - 1, lo, hi, hi + 1, 0, 1, -1, 9, 10, 99, 100, 65535, 65536, 65537, 999_999, 1_000_001]
    numbers += [rng.randint(lo - 10 * hi, hi * 10) for _ in range(3000)] + [rng.randint(lo, hi) for _ in range(3000)]
    keys = {str(n) for n in numbers} | {f"+{n}" for n in numbers[:40]} | {f"0{n}" for n in numbers[:40]}
    keys |= {" 1", "1 ", "1.0", "1e3", "-0", "", "٣", "0x10", "1_000", "--1"}
    for key in keys:
        msg = valid()
        if where == "priority":
            msg["queued_by_priority"] = {key: 1}
        else:
            msg["models"]["m"]["ewma_ms_by_batch"] = {key: 1.0}
        try:
            canonical = str(int(key)) == key and lo <= int(key) <= hi
        except ValueError:
            canonical = False
        try:
            NodeLoad.parse(json.dumps(msg))
            accepted = True
        except MalformedTelemetry:
            accepted = False
        assert accepted == canonical, key


def test_remembered_valid_values_stay_bounded_and_never_admit_invalid_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    import telemetry.cluster.schema as schema

    monkeypatch.setattr(schema, "_VALID_CACHE_MAX", 50)
    for i in range(500):  # a flood of distinct, valid endpoints and key sets
        msg = valid()
        msg["endpoint"] = f"http://10.1.{i // 250}.{i % 250}:8000"
        msg["queued_by_priority"] = {str(i): 1}
        NodeLoad.parse(json.dumps(msg))
        assert len(schema._valid_endpoints) <= 50
    # a key set valid as priorities is not thereby valid as batch sizes (0 is no batch size)
    msg = valid()
    msg["queued_by_priority"] = {"0": 1}
    NodeLoad.parse(json.dumps(msg))
    msg["models"]["m"]["ewma_ms_by_batch"] = {"0": 1.0}
    with pytest.raises(MalformedTelemetry):
        NodeLoad.parse(json.dumps(msg))
    for i in range(500):  # ... and of distinct, valid names
        msg = valid()
        msg["node_id"] = f"n-{i}"
        msg["models"] = {f"m{i}": {}}
        NodeLoad.parse(json.dumps(msg))
        assert len(schema._valid_names) <= 50
    for name in ("n-1 ", "bad name", "n\n"):  # refused after the flood as before it
        with pytest.raises(MalformedTelemetry):
            NodeLoad.parse(with_("node_id", name))
        with pytest.raises(MalformedTelemetry):
            NodeLoad.parse(with_("models", {name: {}}))
    # an endpoint refused once is refused every time
    for _ in range(2):
        with pytest.raises(MalformedTelemetry):
            NodeLoad.parse(with_("endpoint", "http://user:pw@10.0.0.1:8000"))
    assert not any("@" in e for e in schema._valid_endpoints)


@pytest.mark.parametrize("endpoint", ["http://127.0.0.1:9/admin/", "http://127.0.0.1:9/x", "http://127.0.0.1:9/"])
def test_an_endpoint_with_a_path_is_malformed(endpoint: str) -> None:
    """An endpoint is an origin: the router builds every path itself (a node announcing `/admin/` once
    had ordinary calls sent with the node admin token)."""
    import json

    from telemetry.cluster.schema import MalformedTelemetry, NodeLoad
    from tests.helpers import load

    msg = json.loads(load("evil").to_json())
    msg["endpoint"] = endpoint
    with pytest.raises(MalformedTelemetry, match="origin"):
        NodeLoad.parse(json.dumps(msg))
    msg["endpoint"] = "http://127.0.0.1:9"
    assert NodeLoad.parse(json.dumps(msg)).endpoint == "http://127.0.0.1:9"


def test_a_node_config_endpoint_is_an_origin_a_trailing_slash_dropped() -> None:
    from pydantic import ValidationError

    from nodes.config import NodeConfig

    ok = NodeConfig(node_id="n", endpoint="http://h:1/", models=[{"name": "echo"}])
    assert ok.endpoint == "http://h:1"
    with pytest.raises(ValidationError, match="origin"):
        NodeConfig(node_id="n", endpoint="http://h:1/admin/", models=[{"name": "echo"}])


def test_batches_a_reader_cannot_handle_are_counted_and_their_log_lines_bounded(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A bug that every batch meets skips every batch (counted, and in the store's summary) but logs
    at the 1st, 2nd, 4th, 8th... only: it cannot flood the log at the reader's poll rate."""
    import logging
    from types import SimpleNamespace

    from telemetry.kafka.reader import KafkaTelemetrySource

    class Broken(ViewStore):
        def parse(self, raw: bytes) -> NodeLoad | None:
            raise RuntimeError("a bug every batch meets")

    store = Broken()
    source = KafkaTelemetrySource("127.0.0.1:1", "t")
    source._store = store  # (not started: no broker is reached)
    with caplog.at_level(logging.ERROR, logger="telemetry.kafka.reader"):
        for _ in range(100):
            source._fold([SimpleNamespace(value=b"{}", headers=None)] * 3, NOW, False)
    assert source.skipped_batches == 100 and store.summary()["skipped"] == 300
    assert len([r for r in caplog.records if "skipped" in r.getMessage()]) == 7  # 1, 2, 4, ..., 64
