"""The router's HTTP/1.1 client on real loopback sockets: keep-alive reuse, the per-node connection
cap, `Connection: close`, a node closing an idle connection, a node that hangs or talks unasked,
cancellation, and header injection refused before anything is sent."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web

from router.node_client import HttpNodeClient, NodeBadAnswer, NodeTimeout, NodeUnavailable

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class Server:
    """A scripted HTTP/1.1 server: `script` answers each connection; connections are counted."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.connections = 0
        self.open = 0
        self.most_open = 0
        self.url = ""
        self._server: asyncio.Server | None = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.open += 1
        self.most_open = max(self.most_open, self.open)
        try:
            await self.script(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self.open -= 1
            writer.close()

    async def __aenter__(self) -> Server:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        (int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")), 0
    )
    return head + await reader.readexactly(length)


def answer(body: bytes = b'{"ok":true}', extra: bytes = b"") -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
        + extra
        + b"Content-Length: %d\r\n\r\n" % len(body)
        + body
    )


def answering(delay_s: float) -> Script:
    """A keep-alive node that answers every request after `delay_s`."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            await asyncio.sleep(delay_s)
            writer.write(answer())
            await writer.drain()

    return script


keep_alive = answering(0.01)


@pytest.fixture
async def client() -> AsyncIterator[HttpNodeClient]:
    c = HttpNodeClient(pool_per_node=2, connect_timeout_s=0.5)
    try:
        yield c
    finally:
        await c.close()


async def test_connections_are_kept_alive_and_capped_per_node(client: HttpNodeClient) -> None:
    async with Server(keep_alive) as server:
        for _ in range(5):
            reply = await client.post(server.url + "/v2/models/m/infer", b"{}", {}, 2.0)
            assert reply.status == 200 and reply.body == b'{"ok":true}'
        assert server.connections == 1
        replies = await asyncio.gather(
            *(client.post(server.url + "/v2/models/m/infer", b"{}", {}, 2.0) for _ in range(8))
        )
        assert all(r.status == 200 for r in replies)
        assert server.most_open <= 2 and server.connections <= 2


async def test_connection_close_and_a_node_closing_idle_connections(client: HttpNodeClient) -> None:
    async def once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(answer(extra=b"Connection: close\r\n"))
        await writer.drain()

    async with Server(once) as server:
        for _ in range(3):
            assert (await client.post(server.url + "/x", b"{}", {}, 2.0)).status == 200
        assert server.connections == 3

    async def answers_then_closes(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(answer())  # keep-alive, yet the node closes it a moment later (its idle timeout)
        await writer.drain()
        await asyncio.sleep(0.05)

    async with Server(answers_then_closes) as server:
        assert (await client.post(server.url + "/x", b"{}", {}, 2.0)).status == 200
        await asyncio.sleep(0.2)  # the node has closed the pooled connection
        assert (await client.post(server.url + "/x", b"{}", {}, 2.0)).status == 200
        assert server.connections == 2


async def test_a_hung_node_times_out_and_its_connection_is_not_reused(client: HttpNodeClient) -> None:
    calls = []

    async def hangs_first(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            calls.append(1)
            if len(calls) == 1:
                await asyncio.sleep(1.0)  # answers late, on the connection the client gave up
            writer.write(answer())
            await writer.drain()

    async with Server(hangs_first) as server:
        with pytest.raises(NodeTimeout):
            await client.post(server.url + "/x", b"{}", {}, 0.2)
        reply = await client.post(server.url + "/x", b"{}", {}, 2.0)
        assert reply.status == 200 and server.connections == 2


async def test_a_cancelled_call_does_not_leave_its_connection_in_the_pool(client: HttpNodeClient) -> None:
    async with Server(answering(0.3)) as server:
        task = asyncio.create_task(client.post(server.url + "/x", b"{}", {}, 2.0))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        reply = await client.post(server.url + "/x", b"{}", {}, 2.0)
        assert reply.status == 200 and server.connections == 2


async def test_garbage_and_refusals_are_node_errors(client: HttpNodeClient) -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"\x00\x01 not http at all\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.2)

    async with Server(garbage) as server:
        with pytest.raises(NodeBadAnswer, match="status line"):
            await client.post(server.url + "/x", b"{}", {}, 2.0)
        url = server.url
    with pytest.raises(NodeUnavailable):  # nothing listens there any more
        await client.post(url + "/x", b"{}", {}, 2.0)
    with pytest.raises(NodeUnavailable, match="http"):
        await client.post("ftp://127.0.0.1:1/x", b"{}", {}, 2.0)


@pytest.mark.parametrize(
    "headers",
    [{"X-A": "1\r\nX-Injected: 1"}, {"X-A\r\nX-B": "1"}, {"X-A": "a\nb"}, {"X-A:": "1"}],
)
async def test_header_injection_is_refused_before_anything_is_sent(
    client: HttpNodeClient, headers: dict[str, str]
) -> None:
    async with Server(keep_alive) as server:
        with pytest.raises(NodeUnavailable, match="header"):
            await client.post(server.url + "/x", b"{}", headers, 2.0)
        await asyncio.sleep(0.05)
        assert server.connections == 0


async def test_bodies_and_headers_reach_an_aiohttp_node_intact(client: HttpNodeClient) -> None:
    seen: dict[str, object] = {}

    async def handler(request: web.Request) -> web.Response:
        seen["body"] = await request.read()
        seen["priority"] = request.headers.get("x-edgeroute-priority")
        return web.Response(body=b"x" * 300_000, content_type="application/octet-stream")

    app = web.Application(client_max_size=16 << 20)
    app.router.add_post("/v2/models/m/infer", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        body = bytes(range(256)) * 4096  # 1 MiB: written without a copy
        reply = await client.post(
            f"http://127.0.0.1:{port}/v2/models/m/infer", body, {"x-edgeroute-priority": "3"}, 5.0
        )
        assert reply.status == 200 and reply.body == b"x" * 300_000
        assert reply.headers["Content-Type"] == "application/octet-stream"
        assert seen == {"body": body, "priority": "3"}
    finally:
        await runner.cleanup()


async def test_the_table_of_node_pools_stays_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Endpoints come from telemetry: a flood of distinct ones must not grow the client without bound."""
    import router.http1 as http1

    monkeypatch.setattr(http1, "_HOSTS_MAX", 5)
    client = HttpNodeClient(connect_timeout_s=0.2)
    try:
        async with Server(keep_alive) as server:
            port = int(server.url.rsplit(":", 1)[1])
            for i in range(20):  # distinct loopback addresses, one live
                url = server.url if i % 5 == 0 else f"http://127.0.0.{2 + i}:{port}"
                try:
                    await client.post(url + "/x", b"{}", {}, 1.0)
                except NodeUnavailable:
                    pass
                assert len(client._http._hosts) <= 5
    finally:
        await client.close()


# --- findings of the wire review: answers that stall, mislead or outlive their request -------------


async def test_endless_informational_heads_end_the_call_at_once(client: HttpNodeClient) -> None:
    """Finding 3: a node sending `100 Continue` heads without end kept the router's loop busy until
    the deadline (requests to healthy nodes went from 2.2 ms to 1.5 s p50)."""

    async def continues(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        for _ in range(10_000):
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            await writer.drain()
            await asyncio.sleep(0.001)

    async with Server(continues) as server:
        started = asyncio.get_running_loop().time()
        with pytest.raises(NodeBadAnswer, match="informational"):
            await client.post(server.url + "/x", b"{}", {}, 10.0)
        assert asyncio.get_running_loop().time() - started < 1.0


async def test_endless_chunked_trailers_end_the_call(client: HttpNodeClient) -> None:
    """Finding 3: trailers after the last chunk, one short line after another, were read until the
    deadline."""

    async def trailers(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n")
        for i in range(100_000):
            writer.write(b"X-T%d: %s\r\n" % (i, b"v" * 40))
            await writer.drain()

    async with Server(trailers) as server:
        started = asyncio.get_running_loop().time()
        with pytest.raises(NodeBadAnswer, match="trailers too long"):
            await client.post(server.url + "/x", b"{}", {}, 10.0)
        assert asyncio.get_running_loop().time() - started < 2.0


async def test_bytes_a_node_sends_after_its_answer_never_become_another_answer() -> None:
    """Finding 7: bytes a node sent after a complete answer stayed on the pooled connection and became
    the next request's answer (another client's) in 2 of 3 runs: they had reached the socket while the
    router's loop was busy elsewhere, and the next call took the connection before the loop read them.
    Here the node (a thread, blocking socket) sends an unasked answer while the loop is held, then the
    next call goes out. (Bytes that arrive only after the next request went out cannot be told from its
    answer in HTTP/1.1; they come from the node that request went to, which could answer it anything.)"""
    import socket
    import threading
    import time

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    go = threading.Event()
    stop = threading.Event()

    def node() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(2.0)
                try:
                    while not stop.is_set():
                        data = b""
                        while b"\r\n\r\n" not in data:
                            chunk = conn.recv(65536)
                            if not chunk:
                                raise ConnectionError
                            data += chunk
                        conn.sendall(answer())
                        if go.wait(2.0):
                            go.clear()
                            conn.sendall(answer(b"stray"))  # unasked, after the answer
                except (ConnectionError, OSError):
                    pass

    thread = threading.Thread(target=node, daemon=True)
    thread.start()
    c = HttpNodeClient(pool_per_node=1, connect_timeout_s=0.5)
    bodies = []
    try:
        for _ in range(10):
            reply = await c.post(f"http://127.0.0.1:{port}/x", b"{}", {}, 2.0)
            bodies.append(reply.body)
            go.set()
            time.sleep(0.02)  # the loop held: the stray bytes reach the socket, unread
    finally:
        await c.close()
        stop.set()
        go.set()
        thread.join(5)
        listener.close()
    assert b"stray" not in bodies, f"{bodies.count(b'stray')} of {len(bodies)} answers were another's"


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/1.1 200 OK\r\nX-Evil: a\rb\r\nContent-Length: 2\r\n\r\nok",  # a bare CR in a value
        b"HTTP/1.1 200 OK\r\nX-Evil: a\x00b\r\nContent-Length: 2\r\n\r\nok",
        b"HTTP/1.1 600 Odd\r\nContent-Length: 2\r\n\r\nok",
        b"HTTP/1.1 999 Odd\r\nContent-Length: 2\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\nInference-Header-Content-Length: 99\r\nContent-Length: 2\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\nInference-Header-Content-Length: -1\r\nContent-Length: 2\r\n\r\nok",
    ],
)
async def test_answers_that_no_client_may_be_sent_are_bad_answers(client: HttpNodeClient, head: bytes) -> None:
    """Finding 8: a node header with CR or control characters made aiohttp drop the client's connection
    with no answer; statuses 600 and 999 and a lying `Inference-Header-Content-Length` were relayed as
    they came. Each is a bad answer now (the router's 502)."""

    async def bad(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(head)
        await writer.drain()

    async with Server(bad) as server:
        with pytest.raises(NodeBadAnswer):
            await client.post(server.url + "/x", b"{}", {}, 2.0)
