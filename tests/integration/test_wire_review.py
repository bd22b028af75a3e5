"""Findings of the review of the router's wire paths, each reproduced against real processes on
loopback: a fake node (aiohttp) where the router's client is under test, the real stack elsewhere."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import web

from router.node_client import HttpNodeClient
from scenarios.stack.launcher import Stack
from tests.integration.http import call

TOKEN = "t" * 24


async def fake_node(handler: Callable[[web.Request], Any]) -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def test_the_admin_token_goes_only_with_the_calls_the_router_makes_for_admin_routes() -> None:
    """Finding 1 (high): a node announcing `http://host:port/admin/` made every ordinary inference sent
    to it carry the fleet's node admin token (the client looked at the URL's path)."""
    seen: list[tuple[str, str | None]] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append((request.path, request.headers.get("Authorization")))
        return web.json_response({})

    gen = fake_node(handler)
    base = await gen.__anext__()
    client = HttpNodeClient(admin_token=TOKEN)
    try:
        await client.post(f"{base}/admin//v2/models/m/infer", b"{}", {}, 2.0)  # what that endpoint produced
        await client.post(f"{base}/v2/repository/models/m/load", b"{}", {}, 2.0)
        await client.delete(f"{base}/admin/requests/x", 2.0)
        await client.delete(f"{base}/admin/requests/y", 2.0, admin=True)
        await client.post(f"{base}/v2/repository/models/m/unload", b"{}", {}, 2.0, admin=True)
    finally:
        await client.close()
        await gen.aclose()
    assert seen == [
        ("/admin//v2/models/m/infer", None),
        ("/v2/repository/models/m/load", None),
        ("/admin/requests/x", None),
        ("/admin/requests/y", f"Bearer {TOKEN}"),
        ("/v2/repository/models/m/unload", f"Bearer {TOKEN}"),
    ]


def test_repository_calls_through_the_router_try_every_node_and_answer_a_gateway_status(own_stack: Any) -> None:
    """Finding 10: with one node of two down, the router's repository load and unload answered 500 with
    a traceback and stopped at the first failing node."""
    stack: Stack = own_stack(
        [
            {"id": "n1", "partition": "edge-a", "models": ["sensor_mlp"]},
            {"id": "n2", "partition": "edge-a", "models": ["sensor_mlp"]},
        ],
        router={"stale_after_ms": 60_000},  # the dead node stays in the view: the router must cope
    )
    headers = stack.admin_headers
    status, doc, _ = call(f"{stack.router_url}/v2/repository/models/sensor_mlp/unload", b"{}", headers=headers)
    assert status == 200, doc  # both let it go, so a load has somewhere to go
    time.sleep(1.0)  # their reports say so before one of them dies
    stack.kill_node("n2")
    status, doc, _ = call(f"{stack.router_url}/v2/repository/models/sensor_mlp/unload", b"{}", headers=headers)
    assert status == 503, doc
    assert doc["nodes"]["n2"]["status"] == 503 and "n1" not in doc["nodes"], "n1 unloaded, n2 unreachable"
    for wanted in ("n2", None):
        body = json.dumps({"parameters": {"node": wanted}}).encode() if wanted else b""
        status, doc, _ = call(f"{stack.router_url}/v2/repository/models/sensor_mlp/load", body, headers=headers)
        if wanted == "n2":
            assert status == 503 and "n2" in doc["error"], doc
        else:  # whichever node comes first, the load ends on the live one
            assert status == 200 and doc["nodes"] == ["n1"], doc


def test_the_router_holds_no_node_answer_past_max_answer_bytes(own_stack: Any) -> None:
    """Finding 9: node answers were buffered up to a fixed 64 MiB per request (16 slow clients held 2 GB);
    `max_answer_bytes` is a router setting, and an answer past it is refused (413: the request's
    doing, since the third review; the node is told the limit and refuses first)."""
    from tests.integration.http import infer_body

    node = {"id": "n1", "partition": "edge-a", "models": ["echo"]}
    stack: Stack = own_stack([node], router={"max_answer_bytes": 4096})
    small = infer_body("x", [1, 4], data=[0.5] * 4)
    large = infer_body("x", [256, 4], data=[0.5] * 1024)  # a JSON answer of about 6 KB
    assert call(f"{stack.router_url}/v2/models/echo/infer", small, headers=stack.client_headers)[0] == 200
    status, doc, _ = call(f"{stack.router_url}/v2/models/echo/infer", large, headers=stack.client_headers)
    assert status == 413 and "4096" in doc["error"], doc


def _trickle(url: str, body_bytes: int, send: bytes, hold_s: float) -> tuple[bytes, float]:
    """Send a POST head announcing `body_bytes`, then `send` of it, then wait up to `hold_s` for an
    answer: (what came back, seconds)."""
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    started = time.monotonic()
    with socket.create_connection((parts.hostname, parts.port), timeout=hold_s) as sock:
        head = f"POST {parts.path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        sock.sendall(f"{head}Content-Length: {body_bytes}\r\n\r\n".encode() + send)
        got = b""
        try:
            while chunk := sock.recv(65536):
                got += chunk
        except TimeoutError:
            pass
    return got, time.monotonic() - started


def test_a_slow_body_gets_408_and_its_connection_is_closed(own_stack: Any) -> None:
    """Finding 4: `idle_timeout_s` covered the head only; 40 connections trickling a byte every 5 s held
    every slot for 35 s. The body now has `body_timeout_s`, at the router and at the node."""
    node = {"id": "n1", "partition": "edge-a", "models": ["echo"]}
    stack: Stack = own_stack([node], router={"body_timeout_s": 0.5})
    got, took = _trickle(f"{stack.router_url}/v2/models/echo/infer", 1000, b'{"inputs"', 10.0)
    assert got.startswith(b"HTTP/1.1 408") and b"within 0.5 s" in got, got[:200]
    assert took < 5.0, "answered at the body timeout and closed, not held"
    status, doc, _ = call(f"{stack.router_url}/v2/models/echo/infer", b"{", headers=stack.client_headers)
    assert status == 400, "the router serves on"


def test_a_client_gone_mid_body_is_no_error_in_the_log(own_stack: Any) -> None:
    """Finding 12: each client that disconnected mid-body logged an ERROR with a traceback."""
    import socket
    from urllib.parse import urlsplit

    stack: Stack = own_stack([{"id": "n1", "partition": "edge-a", "models": ["echo"]}])
    log_path = stack.log_dir / "router.log"
    before = log_path.read_text() if log_path.exists() else ""
    parts = urlsplit(stack.router_url)
    for _ in range(5):
        with socket.create_connection((parts.hostname, parts.port), timeout=2.0) as sock:
            sock.sendall(b"POST /v2/models/echo/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
            time.sleep(0.05)
    time.sleep(0.5)
    status, _, _ = call(f"{stack.router_url}/v2/health/ready")
    after = log_path.read_text()[len(before) :]
    assert status == 200 and "Traceback" not in after and "ERROR" not in after, after[-2000:]


def test_a_huge_policy_is_refused_at_once_and_specs_are_checked_off_the_loop(own_stack: Any) -> None:
    """Finding 11: a 6 MB `PUT /admin/policy` held the router's event loop for 10 s (validated on the
    loop, no size bound)."""
    stack: Stack = own_stack([{"id": "n1", "partition": "edge-a", "models": ["echo"]}])
    url = f"{stack.router_url}/admin/policy"
    huge = json.dumps({"preset": "p2c", "params": {"sample": {"k": 2}}, "pad": ["x" * 100] * 60_000}).encode()
    started = time.monotonic()
    status, doc, _ = call(url, huge, method="PUT", headers=stack.admin_headers)
    assert status == 413 and time.monotonic() - started < 2.0, doc
    status, doc, _ = call(url, json.dumps({"preset": "least_outstanding"}).encode(), "PUT", stack.admin_headers)
    assert status == 200 and doc["name"] == "least_outstanding", doc
    status, doc, _ = call(url, json.dumps({"preset": "nope"}).encode(), "PUT", stack.admin_headers)
    assert status == 400 and "least_outstanding" in doc["error"], doc
