"""What a router's and a node's processes share: serving HTTP to clients that may be slow or many (the
limits below), the event loop, running until a signal, and the garbage collector's setting (`tune_gc`).

- `max_connections`: past this many open connections a new one is answered 503 and closed at once,
  so slow or abandoned clients cannot take every file descriptor (default: the process's file limit
  less a reserve for its own outbound connections, brokers and files).
- `idle_timeout_s`: a connection must deliver a complete request's headers within this long of
  opening or of its previous answer, else it is closed (aiohttp's keep-alive timer, which also runs
  from the start of a connection), so a client trickling its headers cannot hold a connection.
- `body_timeout_s` (`read_body`): the body must then arrive whole within this long, else 408 and the
  connection is closed (40 connections trickling a byte every 5 s once held every slot); a client
  that goes away mid-body is a line at debug level, not an error with a traceback per client.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import resource
import signal
import ssl
import sys
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import Any

from aiohttp import web

from telemetry.process.configfile import ConfigError

log = logging.getLogger("edgeroute.serving")

RESERVED_FDS = 256
LINGER_S = 1.0
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

    def __init__(
        self, server: web.Server, limit: int, protocol: Callable[[web.Server], asyncio.BaseProtocol] | None = None
    ) -> None:
        self._server = server
        self.limit = limit
        self.refused = 0
        self._protocol = protocol  # what serves one connection, given the server (None: aiohttp's own)

    def __call__(self) -> asyncio.BaseProtocol:
        if len(self._server._connections) >= self.limit:
            self.refused += 1
            return _Busy()
        protocol: asyncio.BaseProtocol = self._server() if self._protocol is None else self._protocol(self._server)
        return protocol

    def __getattr__(self, name: str) -> Any:  # shutdown, pre_shutdown, connections, ...
        return getattr(self._server, name)


async def read_body(request: web.Request, timeout_s: float) -> bytes:
    """The request's whole body within `timeout_s`. Raises `web.HTTPRequestTimeout` (408, connection
    closed) when it has not all arrived by then, and `web.HTTPBadRequest` when the client went away
    mid-body (nobody reads that answer; the disconnect is logged once, at debug level). The size limit
    is the application's `client_max_size` (413), as before. A body already all received (most: it
    came with the head) is read without arming the timer."""
    if request.content.is_eof():
        return await request.read()  # (nothing left to wait for)
    try:
        async with asyncio.timeout(timeout_s):
            return await request.read()
    except TimeoutError:
        resp = web.HTTPRequestTimeout(
            text=json.dumps({"error": f"request body not received within {timeout_s:g} s"}),
            content_type="application/json",
        )
        resp.force_close()
        raise resp from None
    except ConnectionResetError:
        log.debug("client %s went away while sending its body", request.remote)
        gone = web.HTTPBadRequest(
            text=json.dumps({"error": "connection lost mid-body"}), content_type="application/json"
        )
        gone.force_close()
        raise gone from None


async def start_site(
    app: web.Application,
    host: str,
    port: int,
    *,
    ssl_context: ssl.SSLContext | None = None,
    reuse_port: bool = False,
    max_connections: int | None = None,
    idle_timeout_s: float = 30.0,
    protocol: Callable[[web.Server], asyncio.BaseProtocol] | None = None,
) -> tuple[web.AppRunner, web.TCPSite, ConnectionCap]:
    """Set up and start `app` on host:port with the limits above; the caller cleans the runner up.
    `protocol`: what serves each connection, given aiohttp's server (None: aiohttp's own handler)."""
    # after an answer to a request whose body was not read whole (408, 413) the rest is drained for
    # LINGER_S at most, then the connection closes: long enough for a client still uploading to read
    # the answer (closing at once resets it), short where aiohttp's 10 s let a trickle hold the slot
    runner = web.AppRunner(
        app, handle_signals=False, access_log=None, keepalive_timeout=idle_timeout_s, lingering_time=LINGER_S
    )
    await runner.setup()
    assert runner.server is not None
    cap = ConnectionCap(runner.server, max_connections or default_max_connections(), protocol)
    runner._server = cap  # type: ignore[assignment]  # TCPSite asks the runner for its protocol factory
    site = web.TCPSite(runner, host, port, ssl_context=ssl_context, reuse_port=reuse_port or None)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, site, cap


async def stop_serving(runner: web.AppRunner, grpc_server: Any | None, traced: bool) -> None:
    """The end of a router's or a node's serving: its gRPC server (a second for calls in progress),
    its HTTP site, then its span exporter, flushed (telemetry.process.tracing)."""
    if grpc_server is not None:
        await grpc_server.stop(1.0)
    await runner.cleanup()
    if traced:
        from telemetry.process import tracing

        tracing.shutdown()


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


# Python's defaults (700, 10, 10) run a full collection whenever the young generations have been
# collected 10 times and a quarter of the old generation is new since the last full one. A router
# holds every node's latest report (about 40 tracked objects each: pydantic models, their dicts and
# field sets) and replaces them as reports arrive, so the old generation churns all the time: at
# 5,000 nodes a full collection scans over 200,000 objects, finds nothing (reports hold no cycles;
# they die by reference count, and neither the router's nor the node's request path leaves cyclic
# garbage) and stops every thread for 100-370 ms, several times a second at tens of thousands of
# reports a second. Young collections stay as they are (pauses of a few ms); the old generation is
# collected after 1,000 young-old collections instead of 10 (docs/measurements.md, "Garbage
# collection in the router"). The objects that exist when a server starts (modules, schemas,
# settings) are frozen first, so no collection scans them again.
GC_THRESHOLDS = (700, 10, 1000)


def gc_thresholds(spec: str | None) -> tuple[int, int, int] | None:
    """`EDGEROUTE_GC`: unset or empty for `GC_THRESHOLDS`, `default` for Python's own, or three
    thresholds `G0,G1,G2` (positive integers up to 10,000,000); ConfigError otherwise."""
    if spec is None or not spec.strip():
        return GC_THRESHOLDS
    if spec.strip() == "default":
        return None
    parts = [p.strip() for p in spec.split(",")]
    if len(parts) != 3 or not all(p.isascii() and p.isdigit() and 0 < int(p) <= 10_000_000 for p in parts):
        raise ConfigError(f"$EDGEROUTE_GC: 'default' or three positive integers G0,G1,G2, not {spec[:40]!r}")
    g0, g1, g2 = (int(p) for p in parts)
    return g0, g1, g2


def tune_gc(spec: str | None = None, freeze: bool = True) -> tuple[int, int, int] | None:
    """A server process's collector (`GC_THRESHOLDS`, or `EDGEROUTE_GC` unless `spec` is given): what
    exists now is collected once and frozen (`gc.freeze`, unless `freeze` is False), and the
    thresholds set. Returns them (None: Python's defaults kept, nothing frozen); ConfigError for a
    bad setting, before any change."""
    thresholds = gc_thresholds(os.environ.get("EDGEROUTE_GC") if spec is None else spec)
    if thresholds is not None:
        if freeze:
            gc.collect()
            gc.freeze()
        gc.set_threshold(*thresholds)
    return thresholds


@contextlib.contextmanager
def tuned_gc(spec: str | None = None) -> Iterator[tuple[int, int, int] | None]:
    """`tune_gc` for the block (a load generator or benchmark in a process that goes on), undone after
    it. Objects someone else froze before stay frozen; then this block freezes nothing of its own."""
    before = gc.get_threshold()
    ours = gc.get_freeze_count() == 0
    thresholds = tune_gc(spec, freeze=ours)
    try:
        yield thresholds
    finally:
        if thresholds is not None:
            gc.set_threshold(*before)
            if ours:
                gc.unfreeze()


def run_until_signalled(name: str, serve: Callable[[asyncio.Event], Awaitable[None]]) -> int:
    """`serve(stop)` on the process's loop (`run`), `stop` set by SIGTERM or SIGINT (a node's or a
    router's process, `name` in messages: it then drains and exits), with the collector tuned for a
    server (`tune_gc`). Returns the exit status: 0, or 2 after one line for a bad `EDGEROUTE_GC`."""
    try:
        tune_gc()
    except ConfigError as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 2

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(stop)

    run(main())
    return 0
