"""Dispatcher and outstanding overlay, against in-memory nodes (no sockets)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping

import pytest

from policies import RouteRequest, build_policy
from policies.pipeline import Pipeline
from router.dispatch import Dispatcher, PolicyHolder
from router.lifecycle import LifecycleSettings
from router.lifecycle.holds import HoldQueue
from router.lifecycle.links import LinkState
from router.lifecycle.overlay import OutstandingTracker
from router.node_client import InMemoryNodeClient, NodeReply, NodeTimeout, NodeUnavailable
from telemetry.cluster.store import ViewStore
from tests.helpers import load, view

NOW = 1_000.0


def ok(node: str):  # type: ignore[no-untyped-def]
    async def handler(method: str, path: str, body: bytes, headers: Mapping[str, str]) -> NodeReply:
        return NodeReply(
            200,
            json.dumps({"node": node, "deadline": headers.get("x-edgeroute-deadline-ms")}).encode(),
            {"x-edgeroute-node": node},
        )

    return handler


def status(code: int):  # type: ignore[no-untyped-def]
    async def handler(method: str, path: str, body: bytes, headers: Mapping[str, str]) -> NodeReply:
        return NodeReply(code, json.dumps({"error": f"status {code}"}).encode())

    return handler


def raises(exc: Exception):  # type: ignore[no-untyped-def]
    async def handler(method: str, path: str, body: bytes, headers: Mapping[str, str]) -> NodeReply:
        raise exc

    return handler


def make(
    handlers: dict[str, object],
    *,
    loads: list | None = None,
    preset: str = "least_outstanding",  # type: ignore[type-arg]
    attempts: int = 3,
    clock: list[float] | None = None,
    hedge: tuple[int, float] | None = None,
) -> tuple[Dispatcher, InMemoryNodeClient]:
    store = ViewStore()
    for msg in loads or [load(n.removeprefix("http://")) for n in handlers]:
        store.apply(msg, NOW)
    client = InMemoryNodeClient(handlers)  # type: ignore[arg-type]
    t = clock or [NOW]
    settings = LifecycleSettings(
        max_attempts=attempts,
        hedge_min_priority=None if hedge is None else hedge[0],
        hedge_after_ms=None if hedge is None else hedge[1],
    )
    d = Dispatcher(settings, store, PolicyHolder(build_policy(preset), preset), client, lambda: t[0])
    return d, client


async def run(d: Dispatcher, deadline_ms: float = 500.0) -> object:
    return await d.dispatch(RouteRequest("m", request_id="r1"), "/v2/models/m/infer", b"{}", {}, NOW + deadline_ms)


async def test_forwards_remaining_budget() -> None:
    clock = [NOW + 100.0]
    d, _ = make({"http://a": ok("a")}, clock=clock)
    margin = d.lifecycle.margin.margin_ms
    out = await run(d, 500.0)
    assert out.status == 200 and out.node == "a"  # type: ignore[attr-defined]
    # what is left, less the answer margin kept for the way back (router.lifecycle.budgets)
    assert json.loads(out.body)["deadline"] == f"{400.0 - margin:.3f}"  # type: ignore[attr-defined]


@pytest.mark.parametrize("failure", [status(503), status(500), status(502), raises(NodeUnavailable("x"))])
async def test_retries_elsewhere_on_connect_errors_and_5xx(failure: object) -> None:
    d, client = make({"http://a": failure, "http://b": ok("b")}, loads=[load("a"), load("b", queued=5)])
    out = await run(d)
    assert out.status == 200 and out.node == "b" and out.attempts == 2  # type: ignore[attr-defined]
    assert [c[0] for c in client.calls] == ["http://a", "http://b"]


@pytest.mark.parametrize("code", [400, 404, 413])
async def test_client_errors_are_not_retried(code: int) -> None:
    d, client = make({"http://a": status(code), "http://b": ok("b")}, loads=[load("a"), load("b", queued=5)])
    out = await run(d)
    assert out.status == code and len(client.calls) == 1  # type: ignore[attr-defined]


async def test_all_nodes_failing_returns_the_last_error() -> None:
    d, client = make({"http://a": status(503), "http://b": status(500)})
    out = await run(d)
    assert out.status in (500, 503) and len(client.calls) == 2  # type: ignore[attr-defined]
    assert "status" in json.loads(out.body)["error"]  # type: ignore[attr-defined]


async def test_attempts_are_bounded() -> None:
    handlers = {f"http://n{i}": status(503) for i in range(5)}
    d, client = make(handlers, attempts=2)
    out = await run(d)
    assert out.status == 503 and len(client.calls) == 2  # type: ignore[attr-defined]


async def test_deadline_already_passed_is_504_without_dispatch() -> None:
    d, client = make({"http://a": ok("a")}, clock=[NOW + 600.0])
    out = await run(d, 500.0)
    assert out.status == 504 and client.calls == []  # type: ignore[attr-defined]


async def test_node_timeout_is_504() -> None:
    d, _ = make({"http://a": raises(NodeTimeout("slow"))})
    out = await run(d)
    assert out.status == 504 and "deadline" in out.reason  # type: ignore[attr-defined]


async def test_slow_node_is_cut_at_the_deadline() -> None:
    async def slow(method: str, path: str, body: bytes, headers: Mapping[str, str]) -> NodeReply:
        await asyncio.sleep(5)
        return NodeReply(200, b"{}")

    d, _ = make({"http://a": slow})
    out = await run(d, 50.0)
    assert out.status == 504  # type: ignore[attr-defined]


async def test_no_capable_node_is_503() -> None:
    d, client = make({"http://a": ok("a")}, loads=[load("a", status="draining")])
    out = await run(d)
    assert out.status == 503 and client.calls == []  # type: ignore[attr-defined]


async def test_in_flight_request_finishes_on_the_policy_it_started_with() -> None:
    gate = asyncio.Event()
    seen: list[str] = []

    async def first(method: str, path: str, body: bytes, headers: Mapping[str, str]) -> NodeReply:
        seen.append("a")
        await gate.wait()
        return NodeReply(503, b'{"error": "busy"}')

    d, _ = make({"http://a": first, "http://b": ok("b")}, loads=[load("a"), load("b", queued=5)])
    task = asyncio.create_task(run(d))
    await asyncio.sleep(0.01)

    # swap in a policy that fails if it is ever asked: the started request must retry on the old one
    class Refuses:
        name = "refuses"
        reads: frozenset[str] = frozenset()

        def pick(self, *args: object) -> None:
            raise AssertionError("new policy used by an in-flight request")

    old = d.policies.current
    d.policies.swap(Pipeline("new", [], [], Refuses()), "new")  # type: ignore[arg-type]
    gate.set()
    out = await task
    assert out.status == 200 and out.node == "b"  # type: ignore[attr-defined]
    assert d.policies.current is not old


def test_outstanding_estimate_between_reports() -> None:
    t = OutstandingTracker()
    v = view(load("a", queued=2, seq=1))
    assert t.overlay(v).outstanding(v.nodes["a"]) == 2  # no local activity: the report
    for _ in range(3):
        t.dispatch(v.nodes["a"])
    assert t.overlay(v).outstanding(v.nodes["a"]) == 5  # 2 reported + 3 sent since
    t.settle("a")
    assert t.overlay(v).outstanding(v.nodes["a"]) == 4
    # a new report (which already counts what we sent) resets the deltas
    v2 = view(load("a", queued=2, in_flight=1, seq=2, sent_at_ms=1_100.0))
    assert t.overlay(v2).outstanding(v2.nodes["a"]) == 3
    # never below what this router alone has pending
    v3 = view(load("a", seq=3, sent_at_ms=1_200.0))
    assert t.overlay(v3).outstanding(v3.nodes["a"]) == 2


def test_with_peers_their_answers_since_the_report_lower_the_estimate() -> None:
    remote = {"a": 1}
    settled = {"a": 10}
    t = OutstandingTracker(remote=lambda n: remote.get(n, 0), remote_settled=lambda n: settled.get(n, 0))
    v = view(load("a", queued=6, seq=1))  # 6 outstanding at the report, mostly the other router's
    t.applied(list(v.nodes.values()))  # the report is applied: the other routers' answers count from here
    assert t.overlay(v).outstanding(v.nodes["a"]) == 6
    settled["a"] = 13  # the other router got three answers from `a` since that report
    remote["a"] = 1
    assert t.overlay(v).outstanding(v.nodes["a"]) == 3
    t.dispatch(v.nodes["a"])
    assert t.overlay(v).outstanding(v.nodes["a"]) == 4
    settled["a"] = 30  # never below what the routers know to be in flight there (1 own + 1 remote)
    assert t.overlay(v).outstanding(v.nodes["a"]) == 2
    v2 = view(load("a", queued=2, seq=2, sent_at_ms=1_100.0))  # a new report: counted from here
    t.applied(list(v2.nodes.values()))
    assert t.overlay(v2).outstanding(v2.nodes["a"]) == 2


def test_tracker_reports_every_change_for_the_peers_publisher() -> None:
    changes: list[tuple[dict[str, int], dict[str, int]]] = []
    t = OutstandingTracker()
    t.on_change = lambda: changes.append(t.totals())  # the publisher wakes on each (router.app._peers)
    v = view(load("a"), load("b"))
    t.dispatch(v.nodes["a"])
    t.dispatch(v.nodes["b"])
    t.settle("a")
    assert changes == [({"a": 1}, {}), ({"a": 1, "b": 1}, {}), ({"a": 1, "b": 1}, {"a": 1})]


async def test_hedged_request_races_a_duplicate_and_cancels_the_loser_at_its_node() -> None:
    seen_ids: dict[str, str] = {}

    async def slow(method: str, path: str, body: bytes, headers: Mapping[str, str]) -> NodeReply:
        if method == "DELETE":
            seen_ids["cancelled"] = path
            return NodeReply(200, b"{}")
        seen_ids["slow"] = headers["x-edgeroute-request-id"]
        await asyncio.sleep(5)
        return NodeReply(200, b"{}")

    async def fast(method: str, path: str, body: bytes, headers: Mapping[str, str]) -> NodeReply:
        seen_ids["fast"] = headers["x-edgeroute-request-id"]
        return NodeReply(200, b'{"ok": true}', {"x-edgeroute-node": "b"})

    d, client = make({"http://a": slow, "http://b": fast}, loads=[load("a"), load("b", queued=5)], hedge=(10, 20))
    req = RouteRequest("m", priority=10, request_id="r9")
    out = await d.dispatch(req, "/v2/models/m/infer", b"{}", {}, NOW + 1000)
    assert out.status == 200 and out.node == "b"
    await asyncio.sleep(0.01)  # the cancel is sent in the background
    # the router's own id for the request, never the client's ("r9"), which other clients may share
    assert seen_ids["slow"] == "router.1-1" and seen_ids["fast"] == "router.1-h"
    assert seen_ids["cancelled"] == "/admin/requests/router.1-1"
    lc = d.lifecycle
    assert (lc.hedges_sent, lc.hedge_wins, lc.hedge_cancels) == (1, 1, 1)
    assert lc.tracker.pending("a") == 0 and lc.tracker.pending("b") == 0


async def test_low_priority_is_not_hedged_and_fast_answers_are_not_duplicated() -> None:
    d, client = make({"http://a": ok("a"), "http://b": ok("b")}, hedge=(10, 50))
    out = await d.dispatch(RouteRequest("m", priority=10, request_id="q"), "/p", b"{}", {}, NOW + 1000)
    assert out.status == 200 and len(client.calls) == 1 and d.lifecycle.hedges_sent == 0
    out = await d.dispatch(RouteRequest("m", priority=0, request_id="q2"), "/p", b"{}", {}, NOW + 1000)
    assert out.status == 200 and len(client.calls) == 2 and d.lifecycle.hedges_sent == 0


# --- delay scheduling: held requests ---------------------------------------------------------------


def _held_setup(initial_ms: float) -> tuple[Dispatcher, ViewStore]:
    import time

    now = time.time() * 1000.0
    store = ViewStore()
    busy = load("a1", partition="edge-a", sent_at_ms=now, queued=20, wait={"0": 900.0})
    store.apply(busy, now)
    store.apply(load("c1", partition="cloud", sent_at_ms=now), now)
    # the link table (the delay is capped by the RTT to the nearest other partition; a spill pays it)
    settings = LifecycleSettings(links=(LinkState("edge-a", "cloud", rtt_ms=300),))
    spec = {"preset": "edge_first", "params": {"delay_spill": {"initial_ms": initial_ms, "tune": False}}}
    client = InMemoryNodeClient({"http://a1": ok("a1"), "http://c1": ok("c1")})
    d = Dispatcher(settings, store, PolicyHolder(build_policy(spec), spec), client, lambda: time.time() * 1000.0)
    return d, store


async def _held_request(d: Dispatcher) -> object:
    import time

    deadline = time.time() * 1000.0 + 1000.0
    return await d.dispatch(RouteRequest("m", 0, 1000.0, "edge-a", request_id="h1"), "/infer", b"{}", {}, deadline)


async def test_a_held_request_spills_after_the_delay() -> None:
    d, _ = _held_setup(initial_ms=60)
    out = await _held_request(d)
    assert out.status == 200 and out.node == "c1"  # type: ignore[attr-defined]
    held = float(out.headers["x-edgeroute-held-ms"])  # type: ignore[attr-defined]
    assert 55 <= held < 200 and d.lifecycle.holds == 1 and out.attempts == 1  # type: ignore[attr-defined]


async def test_a_held_request_takes_local_room_as_soon_as_the_view_shows_it() -> None:
    import time

    d, store = _held_setup(initial_ms=400)
    task = asyncio.create_task(_held_request(d))
    for _ in range(100):  # until it is held (the first dispatch in a process may take a few ms more)
        if d.waiting or task.done():
            break
        await asyncio.sleep(0.005)
    await asyncio.sleep(0.03)
    assert not task.done() and d.waiting == 1, "held, not dispatched"
    now = time.time() * 1000.0
    store.apply(load("a1", partition="edge-a", sent_at_ms=now, seq=2), now)  # edge-a is free again
    out = await asyncio.wait_for(task, 1.0)
    assert out.status == 200 and out.node == "a1"  # type: ignore[attr-defined]
    assert 25 <= float(out.headers["x-edgeroute-held-ms"]) < 100  # type: ignore[attr-defined]
    assert d.policies.current.state()["delay_spill"]["sites"]["edge-a"]["local_after_wait"] == 1


def test_holds_wake_the_oldest_still_waiting_first() -> None:
    waiting = {"first": True, "gone": True, "second": True}
    q: HoldQueue[str] = HoldQueue(lambda e: waiting[e])
    q.hold("edge-a", "first")
    q.hold("edge-a", "gone")
    q.hold("edge-a", "second")
    assert q.wake("edge-b") is None  # another partition wakes nobody here
    assert q.wake("edge-a") == "first" and len(q) == 2
    waiting["gone"] = False  # its hold timed out: skipped
    assert q.wake("edge-a") == "second"
    assert q.wake("edge-a") is None and len(q) == 0
