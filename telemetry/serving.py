"""Serving HTTP to clients that may be slow or many: the limits a router and a node share.

- `max_connections`: past this many open connections a new one is answered 503 and closed at once,
  so slow or abandoned clients cannot take every file descriptor (default: the process's file limit
  less a reserve for its own outbound connections, brokers and files).
- `idle_timeout_s`: a connection must deliver a complete request's headers within this long of
  opening or of its previous answer, else it is closed (aiohttp's keep-alive timer, which also runs
  from the start of a connection), so a client trickling its headers cannot hold a connection.
"""

from __future__ import annotations

import asyncio
import os
import resource
import signal
import ssl
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from aiohttp import web

RESERVED_FDS = 256
BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
    b'Connection: close\r\nContent-Length: 43\r\n\r\n{"error": "too many connections; try again"}'
)


def default_max_connections() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 10_000
    return max(16, min(10_000, soft - RESERVED_FDS))


class _Busy(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.WriteTransport)
        transport.write(BUSY)
        transport.close()


class ConnectionCap:
    """aiohttp's protocol factory, refusing connections past `limit` (counts them in `refused`)."""

    def __init__(self, server: web.Server, limit: int) -> None:
        self._server = server
        self.limit = limit
        self.refused = 0

    def __call__(self) -> asyncio.BaseProtocol:
        if len(self._server._connections) >= self.limit:
            self.refused += 1
            return _Busy()
        protocol: asyncio.BaseProtocol = self._server()
        return protocol

    def __getattr__(self, name: str) -> Any:  # shutdown, pre_shutdown, connections, ...
        return getattr(self._server, name)


async def start_site(
    app: web.Application,
    host: str,
    port: int,
    *,
    ssl_context: ssl.SSLContext | None = None,
    reuse_port: bool = False,
    max_connections: int | None = None,
    idle_timeout_s: float = 30.0,
) -> tuple[web.AppRunner, web.TCPSite, ConnectionCap]:
    """Set up and start `app` on host:port with the limits above; the caller cleans the runner up."""
    runner = web.AppRunner(app, handle_signals=False, access_log=None, keepalive_timeout=idle_timeout_s)
    await runner.setup()
    assert runner.server is not None
    cap = ConnectionCap(runner.server, max_connections or default_max_connections())
    runner._server = cap  # type: ignore[assignment]  # TCPSite asks the runner for its protocol factory
    site = web.TCPSite(runner, host, port, ssl_context=ssl_context, reuse_port=reuse_port or None)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, site, cap


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop where it is installed (a dependency on Linux and macOS), unless
    `EDGEROUTE_UVLOOP=0`; else None, asyncio's own."""
    if os.environ.get("EDGEROUTE_UVLOOP", "1") == "0":
        return None
    try:
        import uvloop
    except ImportError:
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def run(main: Coroutine[Any, Any, None]) -> None:
    """`asyncio.run(main)` on the loop `loop_factory` chooses (a node's or a router's process)."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        runner.run(main)


def run_until_signalled(serve: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """`serve(stop)` on the process's loop (`run`), `stop` set by SIGTERM or SIGINT (a node's or a
    router's process: it then drains and exits)."""

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(stop)

    run(main())
