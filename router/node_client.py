"""The seam between the router and the nodes: `NodeClient`, over HTTP or in memory (unit tests)."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol
from urllib.parse import urlsplit

import aiohttp

from telemetry import wire

PASS_HEADERS = (
    "Content-Type",
    wire.HEADER_LENGTH,
    wire.NODE,
    wire.EXEC_MS,
    wire.QUEUE_MS,
)


class NodeError(Exception):
    """Any way a call to a node can fail without a usable answer."""


class NodeUnavailable(NodeError):
    """The node could not be reached (refused, reset, DNS); safe to retry elsewhere."""


class NodeTimeout(NodeError):
    """No answer within the time allowed; the request may still be running at the node."""


class NodeBadAnswer(NodeError):
    """The node answered, but not with something the router may pass on (a redirect, which is never
    followed; an answer over the size limit); safe to retry elsewhere, and counted against the node."""


MAX_ANSWER_BYTES = 64 << 20


@dataclass(frozen=True)
class NodeReply:
    status: int
    body: bytes
    headers: Mapping[str, str] = field(default_factory=dict)


class NodeClient(Protocol):
    async def post(self, url: str, body: bytes, headers: Mapping[str, str], timeout_s: float) -> NodeReply: ...

    async def get(self, url: str, timeout_s: float) -> NodeReply: ...

    async def delete(self, url: str, timeout_s: float) -> NodeReply: ...

    async def close(self) -> None: ...


ADMIN_PATHS = ("/admin/", "/v2/repository/")


def _is_admin(url: str) -> bool:
    # most calls are inference: only a URL that holds an admin prefix somewhere needs splitting
    return any(p in url for p in ADMIN_PATHS) and urlsplit(url).path.startswith(ADMIN_PATHS)


class HttpNodeClient:
    """aiohttp client over a keep-alive pool (`pool_per_node` connections per node).

    A node's answer is hostile input too: redirects are never followed (a forged or broken node could
    otherwise point the router at any address) and are a `NodeBadAnswer`, as is an answer over
    `max_answer_bytes`; a connect that times out, a refused or reset connection, malformed HTTP and an
    unusable endpoint are `NodeUnavailable` (retried elsewhere, counted against the node); only a
    node that accepted the request and did not answer in time is a `NodeTimeout`.

    With `admin_token`, calls to a node's `/admin/` and `/v2/repository/` routes carry it as a bearer
    token (cancels, model loads and unloads); inference never does.
    """

    def __init__(
        self,
        pool_per_node: int = 64,
        connect_timeout_s: float = 0.5,
        max_answer_bytes: int = MAX_ANSWER_BYTES,
        admin_token: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self._ssl: ssl.SSLContext | bool = True if ssl_context is None else ssl_context
        self._session: aiohttp.ClientSession | None = None
        self._pool = pool_per_node
        self._connect_timeout_s = connect_timeout_s
        self._max_answer = max_answer_bytes
        self._admin = {"Authorization": f"Bearer {admin_token}"} if admin_token else None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(
                limit=0, limit_per_host=self._pool, keepalive_timeout=10, enable_cleanup_closed=True, ssl=self._ssl
            )
            self._session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        return self._session

    async def _request(
        self, method: str, url: str, body: bytes | None, headers: Mapping[str, str] | None, timeout_s: float
    ) -> NodeReply:
        if self._admin is not None and _is_admin(url):
            headers = {**(headers or {}), **self._admin}
        timeout = aiohttp.ClientTimeout(
            # a connect that takes half the budget will not finish in time: give up and leave the rest for
            # a retry on another node
            total=max(0.001, timeout_s),
            sock_connect=min(self._connect_timeout_s, max(0.001, timeout_s / 2)),
        )
        try:
            async with self.session.request(
                method, url, data=body, headers=headers, timeout=timeout, allow_redirects=False
            ) as resp:
                if 300 <= resp.status < 400:
                    raise NodeBadAnswer(f"{url}: answered a redirect ({resp.status}), not followed")
                if (resp.content_length or 0) > self._max_answer:
                    raise NodeBadAnswer(f"{url}: answer of {resp.content_length} bytes is over the limit")
                if resp.content_length is not None:  # within the limit (checked above): read exactly that
                    answer = await resp.read()
                else:  # chunked: counted as it comes
                    chunks: list[bytes] = []
                    size = 0
                    async for chunk in resp.content.iter_chunked(1 << 16):
                        size += len(chunk)
                        if size > self._max_answer:
                            raise NodeBadAnswer(f"{url}: answer over {self._max_answer} bytes")
                        chunks.append(chunk)
                    answer = b"".join(chunks)
                kept = {h: resp.headers[h] for h in PASS_HEADERS if h in resp.headers}
                return NodeReply(resp.status, answer, kept)
        except aiohttp.ConnectionTimeoutError:  # before ServerTimeoutError, its base: nothing was sent
            raise NodeUnavailable(f"{url}: connect timed out") from None
        except TimeoutError:
            raise NodeTimeout(url) from None
        except aiohttp.ServerTimeoutError:
            raise NodeTimeout(url) from None
        except (aiohttp.ClientError, OSError, ValueError) as exc:  # refused, reset, malformed HTTP, bad URL
            raise NodeUnavailable(f"{url}: {type(exc).__name__}: {exc}"[:300]) from None

    async def post(self, url: str, body: bytes, headers: Mapping[str, str], timeout_s: float) -> NodeReply:
        return await self._request("POST", url, body, headers, timeout_s)

    async def get(self, url: str, timeout_s: float) -> NodeReply:
        return await self._request("GET", url, None, None, timeout_s)

    async def delete(self, url: str, timeout_s: float) -> NodeReply:
        return await self._request("DELETE", url, None, None, timeout_s)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


Handler = Callable[[str, str, bytes, Mapping[str, str]], Awaitable[NodeReply]]


class InMemoryNodeClient:
    """Routes calls to in-process handlers keyed by endpoint (unit tests; no sockets).

    A handler may raise NodeUnavailable or NodeTimeout to play a failed node. `calls` records
    (endpoint, path) in order.
    """

    def __init__(self, handlers: dict[str, Handler]) -> None:
        self.handlers = handlers
        self.calls: list[tuple[str, str]] = []

    async def _call(self, method: str, url: str, body: bytes, headers: Mapping[str, str]) -> NodeReply:
        for endpoint, handler in self.handlers.items():
            if url.startswith(endpoint):
                path = url[len(endpoint) :]
                self.calls.append((endpoint, path))
                return await handler(method, path, body, headers)
        raise NodeUnavailable(f"{url}: no such node")

    async def post(self, url: str, body: bytes, headers: Mapping[str, str], timeout_s: float) -> NodeReply:
        try:
            return await asyncio.wait_for(self._call("POST", url, body, headers), timeout_s)
        except TimeoutError:
            raise NodeTimeout(url) from None

    async def delete(self, url: str, timeout_s: float) -> NodeReply:
        try:
            return await asyncio.wait_for(self._call("DELETE", url, b"", {}), timeout_s)
        except TimeoutError:
            raise NodeTimeout(url) from None

    async def get(self, url: str, timeout_s: float) -> NodeReply:
        try:
            return await asyncio.wait_for(self._call("GET", url, b"", {}), timeout_s)
        except TimeoutError:
            raise NodeTimeout(url) from None

    async def close(self) -> None:
        return None
