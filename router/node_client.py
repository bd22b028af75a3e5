"""The seam between the router and the nodes: `NodeClient`, over HTTP or in memory (unit tests)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import aiohttp

from telemetry import wire

PASS_HEADERS = (
    "Content-Type",
    wire.HEADER_LENGTH,
    wire.NODE,
    wire.EXEC_MS,
    wire.QUEUE_MS,
)


class NodeUnavailable(Exception):
    """The node could not be reached (refused, reset, DNS); safe to retry elsewhere."""


class NodeTimeout(Exception):
    """No answer within the time allowed; the request may still be running at the node."""


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


class HttpNodeClient:
    """aiohttp client over a keep-alive pool (`pool_per_node` connections per node)."""

    def __init__(self, pool_per_node: int = 64, connect_timeout_s: float = 0.5) -> None:
        self._session: aiohttp.ClientSession | None = None
        self._pool = pool_per_node
        self._connect_timeout_s = connect_timeout_s

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(
                limit=0, limit_per_host=self._pool, keepalive_timeout=30, enable_cleanup_closed=True
            )
            self._session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        return self._session

    async def _request(
        self, method: str, url: str, body: bytes | None, headers: Mapping[str, str] | None, timeout_s: float
    ) -> NodeReply:
        timeout = aiohttp.ClientTimeout(
            # a connect that takes half the budget will not finish in time: give up and leave the rest for
            # a retry on another node
            total=max(0.001, timeout_s),
            sock_connect=min(self._connect_timeout_s, max(0.001, timeout_s / 2)),
        )
        try:
            async with self.session.request(method, url, data=body, headers=headers, timeout=timeout) as resp:
                payload = await resp.read()
                kept = {h: resp.headers[h] for h in PASS_HEADERS if h in resp.headers}
                return NodeReply(resp.status, payload, kept)
        except TimeoutError:
            raise NodeTimeout(url) from None
        except aiohttp.ServerTimeoutError:
            raise NodeTimeout(url) from None
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, OSError) as exc:
            raise NodeUnavailable(f"{url}: {exc}") from None

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
