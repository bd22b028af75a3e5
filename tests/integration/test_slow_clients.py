"""Slow and many clients: past `max_connections` a new connection is answered 503 and closed; a
connection that does not deliver a complete request head within `idle_timeout_s` (idle, or trickling
its headers a byte at a time) is closed; other clients are served throughout. Real node and router
servers on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator

import aiohttp

from nodes.config import NodeConfig
from router.app import create_app
from router.config import parse_config
from telemetry.kafka.reader import StaticTelemetrySource
from telemetry.process.serving import start_site
from tests.helpers import load
from tests.integration.inproc import running_node


@contextlib.asynccontextmanager
async def node(**limits: object) -> AsyncIterator[int]:
    cfg = NodeConfig.model_validate({"node_id": "n", "kafka": None, "models": [{"name": "echo"}], **limits})
    async with running_node(cfg) as port:
        yield port


async def _get(port: int, path: str = "/v2/health/live") -> int:
    async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{port}{path}") as resp:
        return resp.status


def _recv_all(sock: socket.socket, timeout_s: float) -> bytes:
    sock.settimeout(timeout_s)
    out = b""
    with contextlib.suppress(TimeoutError, ConnectionResetError):
        while chunk := sock.recv(4096):
            out += chunk
    return out


async def test_connections_past_the_cap_get_503_and_idle_ones_are_closed() -> None:
    async with node(max_connections=4, idle_timeout_s=1.0) as port:
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
        try:
            await asyncio.sleep(0.2)
            extra = socket.create_connection(("127.0.0.1", port))
            answer = await asyncio.to_thread(_recv_all, extra, 2.0)
            extra.close()
            assert answer.startswith(b"HTTP/1.1 503") and b"too many connections" in answer, answer
            # the idle connections never sent a request: closed after idle_timeout_s
            closed = await asyncio.gather(*(asyncio.to_thread(_recv_all, s, 3.0) for s in idle))
            assert closed == [b""] * 4
        finally:
            for s in idle:
                s.close()
        assert await _get(port) == 200


async def test_a_client_trickling_its_headers_is_cut_off_and_others_are_served() -> None:
    async with node(idle_timeout_s=1.0) as port:
        slow = socket.create_connection(("127.0.0.1", port))
        slow.sendall(b"POST /v2/models/echo/infer HTTP/1.1\r\nHost: x\r\n")
        started = time.monotonic()
        closed_after = None
        try:
            for _ in range(40):  # one header byte every 0.1 s: never a complete head
                try:
                    slow.sendall(b"X")
                except (BrokenPipeError, ConnectionResetError):
                    closed_after = time.monotonic() - started
                    break
                await asyncio.sleep(0.1)
                assert await _get(port) == 200, "other clients are served meanwhile"
        finally:
            slow.close()
        assert closed_after is not None and closed_after < 3.0, closed_after


async def test_router_refuses_past_its_cap() -> None:
    cfg = parse_config({"kafka": None, "max_connections": 2, "idle_timeout_s": 5})
    app = create_app(cfg, source=StaticTelemetrySource([load("a", sent_at_ms=time.time() * 1000)]))
    runner, site, cap = await start_site(app, "127.0.0.1", 0, max_connections=2, idle_timeout_s=5)
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    held = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
    try:
        await asyncio.sleep(0.2)
        extra = socket.create_connection(("127.0.0.1", port))
        assert (await asyncio.to_thread(_recv_all, extra, 2.0)).startswith(b"HTTP/1.1 503")
        extra.close()
        assert cap.refused == 1
    finally:
        for s in held:
            s.close()
    await asyncio.sleep(0.2)
    try:
        assert await _get(port) == 200, "served again once connections were freed"
    finally:
        await runner.cleanup()
