"""The HTTP door's early refusal (router.early) on a real router's own serving (`start_site` with
`EarlyDoor`, as `python -m router` serves), its saturation rule held armed: every sheddable request that
says so in its headers is answered 503 before aiohttp builds a request for it, with the full path's
answer, counters and keep-alive; everything the rule would not refuse, or that something else would
answer first, goes the full path; answers stay in order on a connection however its requests arrive."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httptools
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.app import create_app
from router.config import parse_config
from router.early import EarlyDoor
from router.mqtt_api import MQTT_DOOR
from router.state import ROUTER, Router
from telemetry.kafka.reader import StaticTelemetrySource
from telemetry.oip import wire
from telemetry.process.serving import start_site
from tests.integration.http import infer_body
from tests.integration.instant import Device, instant_node

TOKEN = "early-door-token"
BODY = infer_body()


@contextlib.asynccontextmanager
async def _router(
    auth: bool = False, idle_timeout_s: float = 30.0, mqtt: dict[str, Any] | None = None
) -> AsyncIterator[tuple[int, Router, web.Application]]:
    """A router served as `python -m router` serves it (with an MQTT door on `mqtt`'s broker), before a
    node that answers at once, its rule held where all sheddable work is refused (the loop's own ticks
    stopped); (port, router, app)."""

    cfg: dict[str, Any] = {"kafka": None, "stale_after_ms": 600_000}
    if auth:
        cfg["auth"] = {"tokens": {"cams": TOKEN}}
    if mqtt is not None:
        cfg["mqtt"] = mqtt
    async with instant_node() as msg:
        app = create_app(parse_config(cfg), source=StaticTelemetrySource([msg]))
        router = app[ROUTER]
        runner, _, _ = await start_site(
            app, "127.0.0.1", 0, idle_timeout_s=idle_timeout_s, protocol=lambda server: EarlyDoor(server, router)
        )
        try:
            sat = router.saturation
            sat.tick = lambda *_a, **_k: None  # type: ignore[method-assign]  # (the rule's state held as set)
            sat.shed_share, sat.busy = 1.0, 1.0
            yield runner.addresses[0][1], router, app
        finally:
            await runner.cleanup()


def _request(priority: int | None = -1, model: str = "sensor_mlp", body: bytes = BODY, **headers: str) -> bytes:
    hints = {} if priority is None else {wire.PRIORITY: str(priority), wire.DEADLINE_MS: "5000"}
    lines = [f"POST /v2/models/{model}/infer HTTP/1.1", "Host: router", "Content-Type: application/json"]
    lines += [f"{k}: {v}" for k, v in {**hints, **headers}.items()]
    lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class _Answers:
    """The answers read off one connection, in order: (status, headers, body)."""

    def __init__(self) -> None:
        self.done: list[tuple[int, dict[str, str], bytes]] = []
        self._headers: dict[str, str] = {}
        self._body = b""
        self.parser = httptools.HttpResponseParser(self)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.decode().lower()] = value.decode()

    def on_body(self, body: bytes) -> None:
        self._body += body

    def on_message_complete(self) -> None:
        self.done.append((self.parser.get_status_code(), self._headers, self._body))
        self._headers, self._body = {}, b""


async def _exchange(port: int, chunks: list[bytes], expect: int, timeout_s: float = 10.0) -> _Answers:
    """Send `chunks` on one connection (each written apart, a moment between), read `expect` answers."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    answers = _Answers()
    try:
        for chunk in chunks:
            writer.write(chunk)
            await writer.drain()
            await asyncio.sleep(0.002)
        async with asyncio.timeout(timeout_s):
            while len(answers.done) < expect:
                data = await reader.read(65536)
                if not data:
                    break
                answers.parser.feed_data(data)
    finally:
        writer.close()
    return answers


def _count(router: Router, status: str) -> float:
    series = router.metrics.requests._series  # (model, priority, node, outcome)
    return sum(s.value for key, s in series.items() if key[3] == status)


async def test_sheddable_work_is_refused_before_a_request_is_built_with_the_full_paths_answer() -> None:
    async with _router() as (port, router, _):
        sat = router.saturation
        early = await _exchange(port, [_request(-1)], 1)
        assert sat.refused_early == 1 and sat.refused == 1
        # the same request with its priority in the body: the full path refuses it (the rule's next turn)
        doc = json.loads(BODY)
        doc["parameters"] = {"priority": -1, "deadline_ms": 5000}
        full = await _exchange(port, [_request(None, body=json.dumps(doc).encode())], 1)
        assert sat.refused_early == 1 and sat.refused == 2
        (s1, h1, b1), (s2, h2, b2) = early.done[0], full.done[0]
        assert s1 == s2 == 503 and b1 == b2 and json.loads(b1)["error"].startswith("the router is saturated")
        assert h1["retry-after"] == h2["retry-after"] == "1"
        assert h1["content-type"].split(";")[0] == h2["content-type"].split(";")[0] == "application/json"
        assert h1["content-length"] == h2["content-length"] and h1["server"] == h2["server"]
        assert _count(router, "503") == 2  # both counted in edgeroute_requests_total, as the full path counts
        # refused on its head, a request's body is not read: a malformed one is a 503 here, not a 400
        garbage = await _exchange(port, [_request(-1, body=b"{not json")], 1)
        assert garbage.done[0][0] == 503 and sat.refused_early == 2


async def test_answers_keep_their_order_on_a_connection_and_the_connection_stays_open() -> None:
    async with _router() as (port, router, _):
        # critical (served by the node), sheddable, bulk, sheddable: all on one connection, written apart
        sent = [_request(5), _request(-1), _request(0), _request(-1), _request(-1)]
        one = await _exchange(port, sent, len(sent))
        assert [s for s, _, _ in one.done] == [200, 503, 200, 503, 503]
        # the same, pipelined in one write: the sheddable ones wait their turn behind the critical one
        both = await _exchange(port, [b"".join(sent)], len(sent))
        assert [s for s, _, _ in both.done] == [200, 503, 200, 503, 503]
        assert b"model_name" in both.done[0][2] and b"saturated" in both.done[1][2]
        # (which of them were answered early depends on when each arrived: after the answer before it
        # was written, or while it was still under way; the order holds either way)
        assert router.saturation.refused == 6  # (three sheddable requests on each connection)
        assert router.saturation.in_flight == 0  # (the rule's count of requests in flight, all answered)


async def test_what_else_answers_first_goes_the_full_path() -> None:
    """A bad token (401), a model no node serves (404), a site named (the full path's check: one this
    client may not claim, 403), a bad hint (400), a body not yet whole, a connection closing: none is
    answered early, each gets the full path's answer."""
    async with _router(auth=True) as (port, router, _):
        sat = router.saturation
        bearer = {"Authorization": f"Bearer {TOKEN}"}
        cases = [
            (_request(-1), 401),
            (_request(-1, model="no_such_model", **bearer), 404),
            (_request(-1, **{wire.SITE: "nowhere"}, **bearer), 403),
            (_request(None, **{wire.PRIORITY: "high"}, **bearer), 400),
        ]
        for raw, status in cases:
            got = await _exchange(port, [raw], 1)
            assert got.done[0][0] == status, (raw[:120], got.done)
        assert sat.refused_early == 0
        whole = _request(-1, **bearer)
        split = await _exchange(port, [whole[:-10], whole[-10:]], 1)  # the body in two writes
        closing = await _exchange(port, [_request(-1, Connection="close", **bearer)], 1)
        assert split.done[0][0] == closing.done[0][0] == 503 and sat.refused_early == 0 and sat.refused == 2
        ok = await _exchange(port, [_request(-1, **bearer)], 1)
        assert ok.done[0][0] == 503 and sat.refused_early == 1


async def test_a_connection_answered_early_only_lives_by_its_traffic_not_its_first_request() -> None:
    """The idle timer restarts with each early answer, as with aiohttp's: a connection busy with
    refused requests for longer than the idle timeout stays open; left idle, it is closed."""
    async with _router(idle_timeout_s=0.6) as (port, router, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        answers = _Answers()
        try:
            for _ in range(8):  # 1.6 s of traffic on a 0.6 s idle timeout
                writer.write(_request(-1))
                await writer.drain()
                n = len(answers.done)
                while len(answers.done) == n:
                    data = await asyncio.wait_for(reader.read(65536), 5)
                    assert data, "closed while in use"
                    answers.parser.feed_data(data)
                await asyncio.sleep(0.2)
            assert [s for s, _, _ in answers.done] == [503] * 8 and router.saturation.refused_early == 8
            assert await asyncio.wait_for(reader.read(65536), 5) == b""  # idle: closed
        finally:
            writer.close()


# (not a malformed body with a sheddable head: refused early on its head it is a 503, on the full path a
# 400, and which depends on how its bytes arrive; the first test holds the early one)
_KINDS = st.sampled_from(["shed", "bulk", "critical", "bad_hint", "no_hint", "unknown"])


def _make(kind: str) -> tuple[bytes, int]:
    if kind == "shed":
        return _request(-1), 503
    if kind == "bulk":
        return _request(0), 200
    if kind == "critical":
        return _request(7), 200
    if kind == "bad_hint":
        return _request(None, **{wire.PRIORITY: "1e999"}), 400
    if kind == "no_hint":
        return _request(None), 200
    assert kind == "unknown"
    return _request(-1, model="nope"), 404


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kinds=st.lists(_KINDS, min_size=1, max_size=12), cuts=st.lists(st.integers(1, 400), max_size=8))
def test_generated_streams_get_one_answer_each_in_order(kinds: list[str], cuts: list[int]) -> None:
    """Generated mixes of requests on one connection, cut into writes at generated places (heads and
    bodies split, requests pipelined): every request gets exactly one answer, in order, the status its
    kind calls for, and the router goes on serving."""
    made = [_make(k) for k in kinds]
    stream = b"".join(raw for raw, _ in made)
    chunks, at = [], 0
    for cut in cuts:
        if at + cut >= len(stream):
            break
        chunks.append(stream[at : at + cut])
        at += cut
    chunks.append(stream[at:])

    async def run() -> None:
        async with _router() as (port, _, _):
            got = await _exchange(port, chunks, len(made))
            assert [s for s, _, _ in got.done] == [status for _, status in made], (kinds, cuts)
            again = await _exchange(port, [_request(7)], 1)
            assert again.done[0][0] == 200

    asyncio.run(run())


async def test_the_mqtt_door_refuses_on_a_requests_properties_with_no_task_made() -> None:
    """Over MQTT (a real Mosquitto, a stock paho device): a sheddable request is answered 503 with
    `retry_after` from the door's intake, counted early; a critical one is served; one naming a site
    goes the full path (refused there)."""
    import pytest

    from scenarios.stack.mosquitto import Mosquitto, mosquitto_binary

    if mosquitto_binary() is None:
        pytest.skip("Mosquitto is not installed")
    broker = Mosquitto(anonymous=True).start()
    try:
        device = Device(broker.url)
        try:
            async with _router(mqtt={"url": broker.url}) as (_, router, app):
                sat = router.saturation

                def ask(corr: bytes, user: list[tuple[str, str]]) -> dict[str, str]:
                    device.send(BODY, [corr], user)
                    return device.wait(corr)

                await asyncio.wait_for(app[MQTT_DOOR].connected.wait(), 15)  # (the door subscribed)
                shed = await asyncio.to_thread(ask, b"one", [("priority", "-1"), ("deadline_ms", "5000")])
                assert shed["status"] == "503" and shed["retry_after"] == "1" and sat.refused_early == 1
                critical = await asyncio.to_thread(ask, b"two", [("priority", "9"), ("deadline_ms", "5000")])
                assert critical["status"] == "200" and sat.refused_early == 1
                sited = await asyncio.to_thread(ask, b"three", [("priority", "-1"), ("site", "edge-a")])
                assert sited["status"] in ("400", "503") and sat.refused_early == 1  # (the full path's answer)
        finally:
            device.close()
    finally:
        broker.stop()
