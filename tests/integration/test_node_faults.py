"""Nodes that answer badly, on loopback: a redirect (never followed), garbage instead of HTTP, an answer
over the size limit. Each is a failure of that node, retried on another, counted against it."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from policies import RouteRequest, build_policy
from router.dispatch import Dispatcher, PolicyHolder
from router.lifecycle import LifecycleSettings
from router.node_client import HttpNodeClient, NodeUnavailable
from telemetry.cluster.store import ViewStore
from tests.helpers import load


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


@pytest.fixture
async def nodes() -> AsyncIterator[dict[str, object]]:
    hits = {"secret": 0}

    async def good(request: web.Request) -> web.Response:
        return web.json_response({"ok": True}, headers={"x-edgeroute-node": "good"})

    async def redirect(request: web.Request) -> web.Response:
        raise web.HTTPFound("/secret")

    async def secret(request: web.Request) -> web.Response:
        hits["secret"] += 1
        return web.json_response({"leaked": True})

    async def huge(request: web.Request) -> web.Response:
        return web.Response(body=b"x" * 200_000)

    async def huge_chunked(request: web.Request) -> web.StreamResponse:  # no Content-Length to check up front
        resp = web.StreamResponse()
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        for _ in range(20):
            await resp.write(b"x" * 10_000)
        await resp.write_eof()
        return resp

    apps = {}
    for name, handler in (("good", good), ("redirect", redirect), ("huge", huge), ("huge_chunked", huge_chunked)):
        app = web.Application()
        app.router.add_post("/v2/models/m/infer", handler)
        app.router.add_route("*", "/secret", secret)
        apps[name] = app

    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(100)
        writer.write(b"this is not HTTP\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(garbage, "127.0.0.1", 0)
    runners = {}
    urls = {}
    for name, app in apps.items():
        runners[name], urls[name] = await _serve(app)
    urls["garbage"] = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        yield {"urls": urls, "hits": hits}
    finally:
        server.close()
        await server.wait_closed()
        for runner in runners.values():
            await runner.cleanup()


@pytest.mark.parametrize("bad", ["redirect", "garbage"])
async def test_a_bad_answer_is_retried_on_another_node_and_counted(nodes: dict[str, object], bad: str) -> None:
    urls: dict[str, str] = nodes["urls"]  # type: ignore[assignment]
    store = ViewStore()
    import time

    now = time.time() * 1000
    store.apply(load(bad, sent_at_ms=now).replace(endpoint=urls[bad]), now)
    store.apply(load("good", queued=5, sent_at_ms=now).replace(endpoint=urls["good"]), now)
    client = HttpNodeClient(max_answer_bytes=100_000)
    policy = PolicyHolder(build_policy("least_outstanding"), "least_outstanding")
    d = Dispatcher(LifecycleSettings(), store, policy, client)
    try:
        out = await d.dispatch(
            RouteRequest("m", request_id="r", site="edge-a"), "/v2/models/m/infer", b"{}", {}, now + 2000
        )
    finally:
        await client.close()
    assert out.status == 200 and out.node == "good" and out.attempts == 2, (out.status, out.reason)
    assert json.loads(out.body) == {"ok": True}
    assert nodes["hits"] == {"secret": 0}, "a redirect is never followed"
    assert d.lifecycle.retries == 1


@pytest.mark.parametrize("huge", ["huge", "huge_chunked"])
async def test_an_answer_over_the_limit_is_the_requests_fault(nodes: dict[str, object], huge: str) -> None:
    """An answer over `max_answer_bytes` (announced, or chunked past it) was a bad answer, retried on
    another node and counted against the first: any node would answer the request alike, so it is the
    request's 413, after one attempt, with no mark on the node's health."""
    urls: dict[str, str] = nodes["urls"]  # type: ignore[assignment]
    store = ViewStore()
    import time

    now = time.time() * 1000
    store.apply(load(huge, sent_at_ms=now).replace(endpoint=urls[huge]), now)
    store.apply(load("good", queued=5, sent_at_ms=now).replace(endpoint=urls["good"]), now)
    client = HttpNodeClient(max_answer_bytes=100_000)
    policy = PolicyHolder(build_policy("least_outstanding"), "least_outstanding")
    d = Dispatcher(LifecycleSettings(), store, policy, client)
    try:
        out = await d.dispatch(
            RouteRequest("m", request_id="r", site="edge-a"), "/v2/models/m/infer", b"{}", {}, now + 2000
        )
    finally:
        await client.close()
    assert out.status == 413 and out.node == huge and out.attempts == 1, (out.status, out.reason)
    assert "100000" in out.reason and d.lifecycle.retries == 0
    assert d.lifecycle.health.state(now)["ejected_total"] == 0


async def test_a_connect_timeout_is_unavailable_not_a_final_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """A connect that never completes (the event loop's connect held, as a black-holed address would)
    gives up within the connect budget as NodeUnavailable, leaving the rest of the call's time."""
    client = HttpNodeClient(connect_timeout_s=0.2)
    loop = asyncio.get_running_loop()

    async def hangs(*args: object, **kwargs: object) -> object:
        await asyncio.sleep(30)
        raise AssertionError("not reached")

    monkeypatch.setattr(loop, "create_connection", hangs)
    try:
        started = time.perf_counter()
        with pytest.raises(NodeUnavailable, match="connect timed out"):
            await client.post("http://127.0.0.1:1/v2/models/m/infer", b"{}", {}, 2.0)
        assert time.perf_counter() - started < 1.0
    finally:
        await client.close()


async def test_a_hung_node_costs_one_try_with_a_per_try_timeout() -> None:
    async def hung(request: web.Request) -> web.Response:
        await asyncio.sleep(5)
        return web.json_response({"late": True})

    async def good(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    runners, urls = [], {}
    for name, handler in (("hung", hung), ("good", good)):
        app = web.Application()
        app.router.add_post("/v2/models/m/infer", handler)
        runner, urls[name] = await _serve(app)
        runners.append(runner)
    import time

    now = time.time() * 1000
    store = ViewStore()
    store.apply(load("hung", sent_at_ms=now).replace(endpoint=urls["hung"]), now)
    store.apply(load("good", queued=5, sent_at_ms=now).replace(endpoint=urls["good"]), now)
    client = HttpNodeClient()
    d = Dispatcher(
        LifecycleSettings(try_timeout_ms=200.0),
        store,
        PolicyHolder(build_policy("least_outstanding"), "least_outstanding"),
        client,
    )
    try:
        t0 = time.perf_counter()
        out = await d.dispatch(RouteRequest("m", request_id="r"), "/v2/models/m/infer", b"{}", {}, now + 3000)
        elapsed = time.perf_counter() - t0
    finally:
        await client.close()
        for runner in runners:
            await runner.cleanup()
    assert out.status == 200 and out.node == "good" and out.attempts == 2, (out.status, out.reason)
    assert 0.2 <= elapsed < 1.0, elapsed
