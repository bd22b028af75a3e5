"""A lean HTTP/1.1 client for the router's calls to nodes: pooled keep-alive connections, one
`asyncio.Protocol` per connection, no per-request objects beyond a future and a timer; answers parsed
by llhttp (Node.js's parser, through `httptools`).

aiohttp's client costs 120-160 us of CPU per call on the development machine; this one about a third
of that (measured against the same echo server, one process, uvloop, concurrency 32), and a router
spends most of its own time forwarding. llhttp reads a node's typical answer in 5.7 us against 10.5 us
for the hand-written parser it replaced (same process, same answer, interleaved rounds;
docs/measurements.md). It speaks what a router needs of a node and nothing more: one request at a
time per connection, bodies by Content-Length, answers by Content-Length, chunked, or read to the
close; `Connection: close` honoured; 1xx answers skipped. TLS through the event loop's own
(`ssl_context`).

A node's answer is hostile input: llhttp refuses what is not HTTP/1.x (a bad status line, a header
field with a space or control character, a length that is not digits or overflows, a bad chunk); on
top of it the head and the trailers are bounded (`MAX_HEAD`), 1xx heads counted, the status must be
100-599, the body bounded by `max_answer_bytes` (an announced length before it is read, chunked data
as it comes), and bytes past the answer end the connection. Any fault ends the connection with
`NodeBadAnswer` (no connection is reused after a fault). A connect that fails or takes longer than
`connect_timeout_s` is `NodeUnavailable`, as is a connection lost before a whole answer; no whole
answer within the call's time is `NodeTimeout`.
"""

from __future__ import annotations

import asyncio
import select
import ssl
from collections.abc import Mapping
from urllib.parse import urlsplit

import httptools

__all__ = ["HttpReply", "Http1Client", "MAX_HEAD"]

MAX_HEAD = 64 << 10  # an answer's status line and headers together (and, apart, a chunked answer's trailers)
MAX_INFORMATIONAL = 8  # 1xx heads skipped before an answer; more is a node stalling the call
_SPLIT_CACHE_MAX = 4096
_HOSTS_MAX = 4096  # pools kept; past it, the pools of nodes with nothing open or in use are dropped


class HttpReply:
    """What a node answered: status, the headers (names in lower case; the last of repeats), the body."""

    __slots__ = ("body", "headers", "status", "waited_ms")

    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body
        self.waited_ms = 0.0  # how long the call waited for a free connection before it was sent


class _Fault(Exception):
    """Raised inside the parser; becomes the caller's `bad` or `lost` exception."""


class _TooLarge(_Fault):
    """An answer over the size limit (the caller's `too_large`, not a fault of the far end's)."""


class _Unasked(Exception):
    """A node sent a second answer to one request (or bytes past its answer)."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection; `exchange` sends a request and its future gets the answer."""

    def __init__(
        self, max_body: int, errors: tuple[type[Exception], type[Exception]], too_large: type[Exception] | None = None
    ) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reusable = True
        self.idle_since = 0.0
        self._max_body = max_body
        self._bad, self._lost = errors
        self._too_large = too_large or self._bad
        self._waiter: asyncio.Future[HttpReply] | None = None
        self._poller: select.poll | None = None  # the socket, for `quiet` (plain TCP only)
        self._reset()

    def _reset(self) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self._status = 0
        self._informational = 0  # 1xx heads skipped in this answer
        self._fields: dict[str, str] = {}  # the head being read
        self._field_bytes = 0  # its bytes so far (and, past the head, the trailers')
        self._head_fed = 0  # bytes fed while no head was whole yet
        self._headers: dict[str, str] | None = None  # the answer's head, once whole
        self._length = -1  # body bytes announced; -1 read to the close; -2 chunked
        self._body = bytearray()
        self._answer: HttpReply | None = None

    # -- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None and transport.get_extra_info("sslcontext") is None:
            self._poller = select.poll()  # (not select(): descriptors past 1,024 are common on a busy router)
            self._poller.register(sock.fileno(), select.POLLIN)

    def data_received(self, data: bytes) -> None:
        if self._waiter is None or self._waiter.done():
            self.reusable = False  # nothing was asked: a node that talks unasked is not reused
            self.close()
            return
        fault: Exception | None = None
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:  # one of ours below, or the answer is whole
            fault = exc.__context__ if isinstance(exc.__context__, _Fault | _Unasked) else _Fault(str(exc))
        except httptools.HttpParserError as exc:  # not HTTP/1.x, or a field llhttp refuses
            fault = _Fault(f"not an HTTP/1.x status line and head: {exc}")
        if self._headers is None and self._answer is None and fault is None:
            self._head_fed += len(data)
            if self._head_fed > MAX_HEAD:
                fault = _Fault(f"answer head over {MAX_HEAD} bytes")
        answer = self._answer
        if answer is not None:  # whole; anything after it (another answer, garbage) ends the connection
            if fault is not None:
                self.reusable = False
            waiter, self._waiter = self._waiter, None
            waiter.set_result(answer)
        elif fault is not None:
            self._fail((self._too_large if isinstance(fault, _TooLarge) else self._bad)(str(fault)))

    def eof_received(self) -> bool | None:
        self.reusable = False
        return None  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.reusable = False
        waiter = self._waiter
        if waiter is None or waiter.done():
            return
        if self._headers is not None and self._length == -1 and self._answer is None:
            self._waiter = None  # an answer read to the close: complete now
            waiter.set_result(HttpReply(self._status, self._headers, bytes(self._body)))
            return
        reason = f"connection lost before a whole answer ({type(exc).__name__})" if exc else "connection closed"
        self._fail(self._lost(reason))

    # -- use -----------------------------------------------------------------------------------

    def exchange(self, request: bytes, body: bytes, waiter: asyncio.Future[HttpReply]) -> None:
        assert self.transport is not None
        self._waiter = waiter
        self._reset()
        if len(body) <= 65536:
            self.transport.write(request + body)
        else:  # a large tensor body is not copied
            self.transport.write(request)
            self.transport.write(body)

    def _fail(self, exc: Exception) -> None:
        self.reusable = False
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)
        self.close()

    def quiet(self) -> bool:
        """Nothing is waiting to be read (no bytes the node sent unasked, no close): safe to reuse. A
        poll of the socket, so bytes still in the kernel's buffer, which the event loop has not handed
        over yet, cannot become the answer to the next request (another client's)."""
        if self.closed:
            return False
        if self._poller is None:
            return True  # (TLS: records the TLS layer itself consumes may be pending; data_received guards)
        try:
            return not self._poller.poll(0)
        except (OSError, ValueError):
            return False

    def close(self) -> None:
        self.reusable = False
        if self.transport is not None and not self.closed:
            self.transport.close()

    def abort(self) -> None:
        self.reusable = False
        if self.transport is not None and not self.closed:
            self.transport.abort()

    # -- llhttp's callbacks (httptools): the answer's bounds and checks ----------------------------

    def on_message_begin(self) -> None:
        if self._answer is not None:
            raise _Unasked  # a second answer to one request
        self._fields = {}
        self._field_bytes = 0

    def on_header(self, name: bytes, value: bytes) -> None:
        self._field_bytes += len(name) + len(value) + 4
        if self._field_bytes > MAX_HEAD:
            raise _Fault("trailers too long" if self._headers is not None else f"answer head over {MAX_HEAD} bytes")
        if self._headers is None:  # (trailers are read and bounded, not kept)
            self._fields[name.decode("latin-1").lower()] = value.decode("latin-1").strip(" \t")

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if not 100 <= status <= 599:
            raise _Fault(f"status {status}")
        headers = self._fields
        if 100 <= status < 200:
            if status == 101:
                raise _Fault("the node switched protocols")
            self._informational += 1
            if self._informational > MAX_INFORMATIONAL:
                raise _Fault(f"more than {MAX_INFORMATIONAL} informational (1xx) heads")
            return  # informational: the real answer follows
        if not self._parser.should_keep_alive():
            self.reusable = False
        coding = headers.get("transfer-encoding")
        if coding is not None:
            if coding.lower() != "chunked":
                raise _Fault(f"transfer encoding {coding[:20]!r}")
            self._length = -2
        elif status in (204, 304):
            self._length = 0
        elif "content-length" in headers:
            self._length = int(headers["content-length"])  # (llhttp checked it: digits, no overflow)
            if self._length > self._max_body:
                raise _TooLarge(f"answer of {self._length} bytes is over the {self._max_body}-byte limit")
        else:
            self._length = -1  # read to the close
            self.reusable = False
        self._status, self._headers = status, headers
        self._field_bytes = 0  # now counting the trailers'

    def on_body(self, body: bytes) -> None:
        if len(self._body) + len(body) > self._max_body:
            raise _TooLarge(f"answer over {self._max_body} bytes")
        self._body += body

    def on_message_complete(self) -> None:
        if self._headers is None:  # an informational head ended
            return
        self._answer = HttpReply(self._status, self._headers, bytes(self._body))


class _Host:
    __slots__ = ("busy", "idle", "slots")

    def __init__(self, limit: int) -> None:
        self.idle: list[_Connection] = []
        self.slots = asyncio.Semaphore(limit)
        self.busy = 0  # calls holding a slot


class Http1Client:
    """Keep-alive pools, one per (scheme, host, port), at most `pool_per_host` connections each."""

    def __init__(
        self,
        *,
        pool_per_host: int,
        connect_timeout_s: float,
        max_answer_bytes: int,
        ssl_context: ssl.SSLContext | None,
        unavailable: type[Exception],
        timeout: type[Exception],
        bad_answer: type[Exception],
        too_large: type[Exception] | None = None,
        keepalive_s: float = 10.0,
    ) -> None:
        self._limit = pool_per_host
        self._connect_timeout_s = connect_timeout_s
        self._max = max_answer_bytes
        self._ssl = ssl_context  # None: the system's trust store, made at the first https connection
        self._unavailable, self._timeout, self._bad = unavailable, timeout, bad_answer
        self._too_large = too_large or bad_answer
        self._keepalive_s = keepalive_s
        self._hosts: dict[tuple[str, str, int], _Host] = {}
        self._splits: dict[str, tuple[tuple[str, str, int], str, str]] = {}
        self._closed = False

    def _split(self, url: str) -> tuple[tuple[str, str, int], str, str]:
        """(scheme, host, port), the Host header, the request target; remembered per URL (bounded)."""
        found = self._splits.get(url)
        if found is not None:
            return found
        try:
            parts = urlsplit(url)
            host, port = parts.hostname, parts.port
        except ValueError as exc:
            raise self._unavailable(f"{url[:200]}: {exc}") from None
        if parts.scheme not in ("http", "https") or not host or parts.username or parts.password:
            raise self._unavailable(f"{url[:200]}: not an http(s) URL with a host")
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        if any(c in target for c in " \r\n\t") or any(c in parts.netloc for c in "\r\n\t "):
            raise self._unavailable(f"{url[:200]}: not a request target")
        found = ((parts.scheme, host, port or (443 if parts.scheme == "https" else 80)), parts.netloc, target)
        if len(self._splits) >= _SPLIT_CACHE_MAX:
            self._splits.clear()
        self._splits[url] = found
        return found

    async def request(
        self,
        method: str,
        url: str,
        body: bytes,
        headers: Mapping[str, str] | None,
        timeout_s: float,
        countdown: str | None = None,
        echo: str | None = None,
    ) -> HttpReply:
        """One call. `countdown` names a header whose value is a budget in milliseconds: a call that
        had to wait for a free connection sends it lowered by that wait, so the far end is never told
        it has time that was spent here. `echo` names a header the far end answers with the value it
        was sent: an answer that names another value answers another request (a late duplicate on a
        reused connection) and is a bad answer, its connection closed; after an answer that names none,
        its connection carries no other request."""
        if self._closed:
            raise self._unavailable("client closed")
        key, netloc, target = self._split(url)
        head = [f"{method} {target} HTTP/1.1\r\nHost: {netloc}\r\nContent-Length: {len(body)}\r\n"]
        if headers:
            for name, value in headers.items():
                if "\r" in value or "\n" in value or "\r" in name or "\n" in name or ":" in name:
                    raise self._unavailable(f"header {name[:40]!r}: line breaks or ':' in a header")
                head.append(f"{name}: {value}\r\n")
        head.append("\r\n")
        request = "".join(head).encode("latin-1", "replace")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.001, timeout_s)
        host = self._hosts.get(key)
        if host is None:
            if len(self._hosts) >= _HOSTS_MAX:  # endpoints come from telemetry: never an unbounded table
                self._prune()
            host = self._hosts[key] = _Host(self._limit)
        waited_ms = 0.0
        if host.slots.locked():  # all of this node's connections busy: wait for one, within the time
            began = loop.time()
            try:
                async with asyncio.timeout_at(deadline):
                    await host.slots.acquire()
            except TimeoutError:
                raise self._timeout(url) from None
            waited_ms = (loop.time() - began) * 1000.0
            if countdown is not None and headers and countdown in headers:
                request = _counted_down(request, countdown, headers[countdown], waited_ms)
        else:
            await host.slots.acquire()  # free: returns at once
        host.busy += 1
        conn: _Connection | None = None
        try:
            conn = self._idle(host, loop.time())
            if conn is None:
                budget = min(self._connect_timeout_s, max(0.001, timeout_s / 2), deadline - loop.time())
                conn = await self._connect(key, budget, url)
            waiter: asyncio.Future[HttpReply] = loop.create_future()
            timer = loop.call_at(deadline, _expire, waiter)
            try:
                conn.exchange(request, body, waiter)
                answer = await waiter
            finally:
                timer.cancel()
        except _Expired:
            if conn is not None:
                conn.abort()  # the answer may still come: this connection cannot carry another request
            raise self._timeout(url) from None
        except BaseException:  # a fault, or the caller cancelled: this connection is not reused
            if conn is not None:
                conn.abort()
            raise
        finally:
            host.busy -= 1
            host.slots.release()
        if echo is not None and headers is not None and echo in headers:
            echoed = answer.headers.get(echo.lower())
            if echoed is None:
                # a far end that does not echo: a late duplicate of this answer could not be told from the
                # answer to the next request sent on this connection, so none is sent on it
                conn.reusable = False
            elif echoed != headers[echo]:
                conn.abort()
                raise self._bad(f"{url[:200]}: the answer names request {echoed[:64]!r}, not the one sent")
        if conn.reusable and not conn.closed and not self._closed:
            conn.idle_since = loop.time()
            host.idle.append(conn)
        else:
            conn.close()
        answer.waited_ms = waited_ms
        return answer

    def _prune(self) -> None:
        now = asyncio.get_running_loop().time()
        for key, host in list(self._hosts.items()):
            kept = [c for c in host.idle if not c.closed and c.reusable and now - c.idle_since < self._keepalive_s]
            for conn in host.idle:
                if conn not in kept:
                    conn.close()
            host.idle[:] = kept
            if not host.busy and not host.idle:
                del self._hosts[key]

    def _idle(self, host: _Host, now: float) -> _Connection | None:
        while host.idle:
            conn = host.idle.pop()
            if not conn.closed and conn.reusable and now - conn.idle_since < self._keepalive_s and conn.quiet():
                return conn
            conn.close()
        return None

    async def _connect(self, key: tuple[str, str, int], budget_s: float, url: str) -> _Connection:
        scheme, host, port = key
        loop = asyncio.get_running_loop()
        context: ssl.SSLContext | None = None
        if scheme == "https":
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            context = self._ssl
        conn = _Connection(self._max, (self._bad, self._unavailable), self._too_large)
        try:
            async with asyncio.timeout(max(0.001, budget_s)):
                await loop.create_connection(
                    lambda: conn, host, port, ssl=context, server_hostname=host if context is not None else None
                )
        except TimeoutError:
            conn.abort()
            raise self._unavailable(f"{url[:200]}: connect timed out") from None
        except (OSError, ssl.SSLError, ValueError) as exc:
            conn.abort()
            raise self._unavailable(f"{url[:200]}: {type(exc).__name__}: {exc}"[:300]) from None
        return conn

    async def close(self) -> None:
        self._closed = True
        for host in self._hosts.values():
            for conn in host.idle:
                conn.close()
            host.idle.clear()
        self._hosts.clear()


def _counted_down(request: bytes, name: str, value: str, waited_ms: float) -> bytes:
    """`request`'s head with the budget header `name` lowered by `waited_ms` (a value that is not a
    number is left as it is: the far end refuses it as it would have)."""
    try:
        left = max(0.0, float(value) - waited_ms)
    except ValueError:
        return request
    return request.replace(f"\r\n{name}: {value}\r\n".encode("latin-1", "replace"),
                           f"\r\n{name}: {left:.3f}\r\n".encode(), 1)  # fmt: skip


class _Expired(Exception):
    """The call's time ran out while waiting for the answer."""


def _expire(waiter: asyncio.Future[HttpReply]) -> None:
    if not waiter.done():
        waiter.set_exception(_Expired())
