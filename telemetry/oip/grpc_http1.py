"""OIP v2 `ModelInfer` as gRPC messages over HTTP/1.1, the answer's status in chunked trailers: the door a
native data plane's proxy (HAProxy, router.dataplane) carries a client's gRPC call to, at a node
(nodes.server) and at the router behind it (router.app), giving the client real gRPC over HTTP/2
(HAProxy moves trailers between the two).

Why a door of its own: Python's gRPC servers cost most of a call. grpc.aio took 200-253 us of CPU for a
bare call on the development machine, more than the node's whole HTTP inference path (159 us), so the
node's gRPC service answered 0.41-0.49x of its HTTP rate through the proxy (docs/benchmarks.md). Here a
call is parsed by llhttp (`httptools`) and protobuf and answered by the service's own `infer_once`
(nodes.grpc_service, router.grpc_api: the code its gRPC service runs), written in one piece.

What it speaks, and nothing more: `POST /inference.GRPCInferenceService/ModelInfer`, one uncompressed
message, its metadata as headers (`grpc-timeout`, the hints, `authorization`); every other call
answers UNIMPLEMENTED, a malformed message INVALID_ARGUMENT. One call at a time per connection (the
proxy does not pipeline). Metadata past grpc-core's default hard limit is refused RESOURCE_EXHAUSTED,
as the gRPC services refuse it. Hostile input is bounded as at the other doors: the head (`MAX_HEAD`), the
message (`max_body`), connections (`max_connections`), a head's and a connection's idle time
(`idle_timeout_s`), a body's (`body_timeout_s`); what is not HTTP/1.1 gets a 400 and the connection
closes. A call whose client goes away mid-call is cancelled, as grpc.aio cancels one.
"""

from __future__ import annotations

import asyncio
import logging
import re
import ssl
import time
from collections.abc import Awaitable
from typing import Any

import httptools
from google.protobuf.message import DecodeError

from telemetry.oip.grpc import code_of
from telemetry.oip.triton import pb
from telemetry.process.serving import default_max_connections
from telemetry.process.settings import ServerSettings

log = logging.getLogger("edgeroute")

PATH = b"/inference.GRPCInferenceService/ModelInfer"
MAX_HEAD = 64 << 10  # a call's request line and headers together (past it: not a call, 400)
MAX_HEADERS = 256  # headers of one call (the data plane's HAProxy passes at most 128 and adds a few)
# a call's metadata, counted as grpc-core counts it (name, value and 32 bytes an entry), past which it
# is refused RESOURCE_EXHAUSTED as grpc-core's default hard limit refuses it at the gRPC services
MAX_METADATA = 16 << 10
MAX_MESSAGE_TEXT = 1024  # a status message's characters
_TIMEOUT = re.compile(rb"^([0-9]{1,8})([HMSmun])$")
_UNIT_S = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}
_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/grpc\r\ntransfer-encoding: chunked\r\n\r\n"
_BAD = b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
_LATE = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
_PLAIN = set(range(0x20, 0x7F)) - {ord("%")}
_TRAILER_NAME = re.compile(r"^[a-z0-9-]{1,64}$")
_TRAILER_VALUE = re.compile(r"^[\x20-\x7e]{0,256}$")
_OWN = frozenset({"grpc-status", "grpc-message", "content-type", "transfer-encoding", "content-length"})


def grpc_timeout_s(value: bytes | None) -> float | None:
    """A `grpc-timeout` header in seconds (None: none, or one not understood)."""
    if value is None:
        return None
    m = _TIMEOUT.match(value.strip())
    return None if m is None else int(m.group(1)) * _UNIT_S[m.group(2)]


def _percent(text: str) -> bytes:
    """A grpc-message's value: percent-encoded where gRPC says (outside printable ASCII, and `%`)."""
    raw = text[:MAX_MESSAGE_TEXT].encode("utf-8", "replace")
    return b"".join(bytes((b,)) if b in _PLAIN else b"%%%02X" % b for b in raw)


def answer(
    code: int, message: str = "", payload: bytes | None = None, trailers: tuple[tuple[str, str], ...] = ()
) -> bytes:
    """One call's whole answer: its message, if any, then its status in the trailers (with `trailers`,
    the service's own trailing metadata: those not a name and a printable value of gRPC's are left out)."""
    out = [_HEAD]
    if payload is not None:
        framed = b"\x00" + len(payload).to_bytes(4, "big") + payload
        out += [b"%x\r\n" % len(framed), framed, b"\r\n"]
    out.append(b"0\r\ngrpc-status: %d\r\n" % code)
    if message:
        out += [b"grpc-message: ", _percent(message), b"\r\n"]
    for name, value in trailers:
        if _TRAILER_NAME.match(name) and name not in _OWN and _TRAILER_VALUE.match(value):
            out.append(f"{name}: {value}\r\n".encode())
    out.append(b"\r\n")
    return b"".join(out)


class CallContext:
    """What a service's `infer_once` asks of a gRPC call's context, from an HTTP/1.1 call's head."""

    __slots__ = ("_deadline", "_metadata", "_peer", "trailers")

    def __init__(self, metadata: list[tuple[str, str]], timeout_s: float | None, peer: str) -> None:
        self._metadata = metadata
        self._deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._peer = peer
        self.trailers: tuple[tuple[str, str], ...] = ()

    def set_trailing_metadata(self, pairs: tuple[tuple[str, str], ...]) -> None:
        self.trailers = tuple(pairs)

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return self._metadata

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def peer(self) -> str:
        return self._peer


class _Door:
    """The door's shared state: the service, its bounds, the connections open."""

    def __init__(
        self, service: Any, max_body: int, max_connections: int, idle_s: float, body_s: float, path: str | None
    ) -> None:
        self.service = service
        self.path = path
        self.max_message = max_body
        self.max_connections = max_connections
        self.idle_s = idle_s
        self.body_s = body_s
        self.open: set[_Connection] = set()


class _Connection(asyncio.Protocol):
    def __init__(self, door: _Door) -> None:
        self.door = door
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.peer = "unknown"
        self.task: asyncio.Task[None] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self._reset()

    def _reset(self) -> None:
        self.url = b""
        self.headers: list[tuple[str, str]] = []
        self.timeout: bytes | None = None
        self.head_bytes = 0
        self.metadata = 0  # (grpc-core's measure of the call's metadata)
        self.body = bytearray()
        self.too_large = False
        self.dropped = 0  # (a message over the bound: its bytes, counted, not kept)
        self.prefix = b""
        self.in_message = False
        self.in_body = False

    # --- the connection ------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # (uvloop's is not asyncio.Transport)
        door = self.door
        if len(door.open) >= door.max_connections:
            transport.close()
            return
        door.open.add(self)
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and peer:
            self.peer = f"ipv4:{peer[0]}:{peer[1]}" if ":" not in str(peer[0]) else f"ipv6:[{peer[0]}]:{peer[1]}"
        elif self.door.path is not None:
            self.peer = f"unix:{self.door.path}"
        self._arm(door.idle_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.door.open.discard(self)
        self._disarm()
        if self.task is not None and not self.task.done():
            self.task.cancel()  # (the client went away: the call is cancelled, as grpc.aio's would be)

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self.timer = asyncio.get_running_loop().call_later(seconds, self._expired)

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _expired(self) -> None:
        self.timer = None
        if self.transport is None or self.task is not None:
            return
        if self.in_body:  # a body not whole in time: the call's answer, then the connection goes
            why = f"request body not received within {self.door.body_s:g} s"
            self._finish(answer(code_of(408).value[0], why), close=True)
        elif self.in_message:  # a head not whole in time
            self.transport.write(_LATE)
            self.transport.close()
        else:  # idle
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self.task is not None:  # (one call at a time: the proxy does not pipeline)
            self._bad()
            return
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserUpgrade, httptools.HttpParserError):
            self._bad()

    def _bad(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(_BAD)
            self.transport.close()

    # --- llhttp's callbacks --------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.task is not None:  # (a second call before the first's answer: not HTTP this door speaks)
            raise httptools.HttpParserError("pipelined call")
        self._reset()
        self.in_message = True
        self._arm(self.door.idle_s)

    def _head(self, n: int) -> None:
        self.head_bytes += n
        if self.head_bytes > MAX_HEAD or len(self.headers) > MAX_HEADERS:
            raise httptools.HttpParserError("head too large")

    def on_url(self, url: bytes) -> None:
        self._head(len(url))
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head(len(name) + len(value))
        self.metadata += len(name) + len(value) + 32
        key = name.decode("latin-1").lower()
        if key == "grpc-timeout":
            self.timeout = value
        self.headers.append((key, value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        self.in_body = True
        self._arm(self.door.body_s)

    def on_body(self, body: bytes) -> None:
        if self.too_large:
            self.dropped += len(body)
            return
        if len(self.body) + len(body) > self.door.max_message + 5:
            self.too_large = True
            self.dropped = len(self.body) + len(body)
            self.prefix = bytes((self.body + body)[:5])
            self.body = bytearray()
            return
        self.body += body

    def on_message_complete(self) -> None:
        self._disarm()
        assert self.transport is not None
        self.transport.pause_reading()
        self.task = asyncio.get_running_loop().create_task(self._call())

    # --- the call ------------------------------------------------------------------------------------

    async def _call(self) -> None:
        keep = self.parser.should_keep_alive()
        try:
            out = await self._answer()
        except asyncio.CancelledError:
            return
        except Exception:  # (a fault of the service's own: the call fails alone, INTERNAL)
            log.exception("a gRPC call over HTTP/1.1 failed")
            out = answer(13, "the server failed to answer")
        self.task = None
        self._finish(out, close=not keep)

    def _finish(self, out: bytes, close: bool) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        transport.write(out)
        self.in_message = self.in_body = False
        if close:
            transport.close()
            return
        transport.resume_reading()
        self._arm(self.door.idle_s)

    async def _answer(self) -> bytes:
        if self.parser.get_method() != b"POST" or self.url != PATH:
            return answer(12, f"{self.url[:200].decode('latin-1')} is not served here")
        if self.metadata > MAX_METADATA:  # (in grpc-core's words, as the gRPC services answer it)
            return answer(8, f"received metadata size exceeds hard limit ({self.metadata} vs. {MAX_METADATA})")
        if self.too_large:  # (in grpc-core's words, as the gRPC service answers it)
            size = int.from_bytes(self.prefix[1:5], "big") if len(self.prefix) == 5 else self.dropped - 5
            return answer(8, f"SERVER: Received message larger than max ({size} vs. {self.door.max_message})")
        body = self.body  # (read in place: no copy of the message)
        if body and body[0] != 0:
            return answer(12, "compressed messages are not supported")
        if len(body) < 5 or int.from_bytes(body[1:5], "big") != len(body) - 5:
            return answer(3, "one whole message")
        try:
            request = pb.ModelInferRequest.FromString(memoryview(body)[5:])
        except DecodeError:
            return answer(3, "malformed ModelInferRequest message")
        ctx = CallContext(self.headers, grpc_timeout_s(self.timeout), self.peer)
        status, message, response = await self.door.service.infer_once(request, ctx)
        if response is None:
            return answer(code_of(status).value[0], message, None, ctx.trailers)
        return answer(0, "", response.SerializeToString())


def start_for(
    service: Any,
    settings: ServerSettings,
    max_body: int,
    host: str = "",
    port: int = 0,
    *,
    path: str | None = None,
    ssl_context: ssl.SSLContext | None = None,
) -> Awaitable[Server]:
    """`start` with a server's own settings (a node's or the router's): its idle and body times, and a
    quarter of its gRPC connections (the door serves only a proxy)."""
    return start(
        service,
        host,
        port,
        path=path,
        max_body=max_body,
        max_connections=max(16, settings.connection_limits(default_max_connections())[1] // 4),
        idle_timeout_s=settings.idle_timeout_s,
        body_timeout_s=settings.body_timeout_s,
        ssl_context=ssl_context,
    )


class Server:
    """The door, listening: `port` bound; `stop` closes it and every connection open."""

    def __init__(self, server: Any, door: _Door) -> None:
        self.server = server
        self.door = door
        name = server.sockets[0].getsockname()
        self.port: int = name[1] if isinstance(name, tuple) else 0

    async def stop(self) -> None:
        self.server.close()
        for conn in list(self.door.open):
            if conn.transport is not None:
                conn.transport.close()
        await self.server.wait_closed()


async def start(
    service: Any,
    host: str,
    port: int,
    *,
    path: str | None = None,
    max_body: int,
    max_connections: int,
    idle_timeout_s: float,
    body_timeout_s: float,
    ssl_context: ssl.SSLContext | None = None,
) -> Server:
    """The door on host:port (0: a free port), or on the unix socket `path`, answering with `service`
    (its `infer_once(request, context)` -> (status, message, response or None))."""
    door = _Door(service, max_body, max_connections, idle_timeout_s, body_timeout_s, path)
    loop = asyncio.get_running_loop()
    if path is not None:
        server = await loop.create_unix_server(lambda: _Connection(door), path)
    else:
        server = await loop.create_server(lambda: _Connection(door), host, port, ssl=ssl_context)
    return Server(server, door)


__all__ = ["PATH", "CallContext", "Server", "answer", "grpc_timeout_s", "start", "start_for"]
