"""The seam between the router and the nodes: `NodeClient`, over HTTP or in memory (unit tests)."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import orjson

from router.http1 import Http1Client
from telemetry.oip import wire

PASS_HEADERS = (
    "Content-Type",
    wire.HEADER_LENGTH,
    wire.NODE,
    wire.EXEC_MS,
    wire.QUEUE_MS,
    wire.COLD_MS,  # (only on an answer that waited for a load: the workflow's cold stages and the replays count it)
)
_PASS = tuple((name, name.lower()) for name in PASS_HEADERS)
ANSWER_TYPES = ("application/json", "application/octet-stream")  # what a node's answer may be relayed as


class NodeError(Exception):
    """Any way a call to a node can fail without a usable answer."""


class NodeUnavailable(NodeError):
    """The node could not be reached (refused, reset, DNS); safe to retry elsewhere."""


class NodeTimeout(NodeError):
    """No answer within the time allowed; the request may still be running at the node."""


class NodeBadAnswer(NodeError):
    """The node answered, but not with something the router may pass on (a redirect, which is never
    followed; not HTTP/1.x); safe to retry elsewhere, and counted against the node."""


class NodeAnswerTooLarge(NodeError):
    """The node's answer is over `max_answer_bytes`: the request asked for more than the router carries.
    The request's doing, not the node's (any node would answer it alike): not retried, no health effect."""


MAX_ANSWER_BYTES = 64 << 20


def error_text(body: bytes) -> str:
    """A node's error answer as text: its JSON `error`, else the first 200 bytes as they came."""
    try:
        return str(wire.loads(body).get("error", ""))
    except (ValueError, AttributeError):
        return body[:200].decode(errors="replace")


@dataclass(frozen=True)
class NodeReply:
    status: int
    body: bytes
    headers: Mapping[str, str] = field(default_factory=dict)
    waited_ms: float = 0.0  # spent waiting for a free connection to the node, before it was sent


class NodeClient(Protocol):
    """Calls to nodes. `admin=True` marks a call the router itself builds for a node's admin or
    repository routes (cancels, model loads and unloads): only those carry the node admin token."""

    async def post(
        self, url: str, body: bytes, headers: Mapping[str, str], timeout_s: float, admin: bool = False
    ) -> NodeReply: ...

    async def get(self, url: str, timeout_s: float, admin: bool = False) -> NodeReply: ...

    async def delete(self, url: str, timeout_s: float, admin: bool = False) -> NodeReply: ...

    async def close(self) -> None: ...


class HttpNodeClient:
    """The router's HTTP/1.1 client (router.http1) over keep-alive pools (`pool_per_node` connections
    per node).

    A node's answer is hostile input too: redirects are never followed (a forged or broken node could
    otherwise point the router at any address) and are a `NodeBadAnswer`, as is one that is not HTTP/1.x;
    an answer over `max_answer_bytes` is a `NodeAnswerTooLarge` (the request's fault: nodes are told the
    limit and refuse first); a connect that times out, a refused or reset
    connection, one lost before a whole answer and an unusable endpoint are `NodeUnavailable` (retried
    elsewhere, counted against the node); only a node that accepted the request and did not answer in
    time is a `NodeTimeout`.

    With `admin_token`, the calls the router makes for a node's admin and repository routes (`admin=True`:
    cancels, model loads and unloads) carry it as a bearer token; nothing else does, whatever its URL
    (an endpoint announced with a path such as `/admin/` once made every inference carry it). With
    `node_token`, every other call (inference, probes) carries that one instead: a node listening beyond
    loopback serves inference to the routers that hold it only.
    """

    def __init__(
        self,
        pool_per_node: int = 64,
        connect_timeout_s: float = 0.5,
        max_answer_bytes: int = MAX_ANSWER_BYTES,
        admin_token: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
        node_token: str | None = None,
    ) -> None:
        # a connect that takes half a call's budget will not finish in time: the client gives up on it
        # and leaves the rest for a retry on another node
        self._http = Http1Client(
            pool_per_host=pool_per_node,
            connect_timeout_s=connect_timeout_s,
            max_answer_bytes=max_answer_bytes,
            ssl_context=ssl_context,
            unavailable=NodeUnavailable,
            timeout=NodeTimeout,
            bad_answer=NodeBadAnswer,
            too_large=NodeAnswerTooLarge,
        )
        self._admin = {"Authorization": f"Bearer {admin_token}"} if admin_token else None
        # every other call: the node token, and the largest answer this router carries (a node refuses
        # a larger one before sending it)
        self._node = {wire.MAX_ANSWER: str(max_answer_bytes)}
        if node_token:
            self._node["Authorization"] = f"Bearer {node_token}"

    async def _request(
        self,
        method: str,
        url: str,
        body: bytes | None,
        headers: Mapping[str, str] | None,
        timeout_s: float,
        admin: bool = False,
    ) -> NodeReply:
        if admin:
            if self._admin is not None:
                headers = {**(headers or {}), **self._admin}
        else:
            headers = {**headers, **self._node} if headers else self._node
        # the node's budget counts down while the call waits for a connection to it
        answer = await self._http.request(
            method, url, body or b"", headers, timeout_s, wire.DEADLINE_MS, wire.REQUEST_ID
        )
        if 300 <= answer.status < 400:
            raise NodeBadAnswer(f"{url}: answered a redirect ({answer.status}), not followed")
        media = answer.headers.get("content-type", "application/json").split(";")[0].strip().lower()
        if media not in ANSWER_TYPES and answer.body:
            # relayed as it came, text/html from a node would be served from the router's origin
            if answer.status == 200:
                raise NodeBadAnswer(f"{url}: answered Content-Type {media[:60]!r}")
            text = answer.body[:200].decode("utf-8", "replace")
            body = orjson.dumps({"error": f"node answered {answer.status} ({media[:60]}): {text}"})
            return NodeReply(answer.status, body, {"Content-Type": "application/json"}, answer.waited_ms)
        got = answer.headers
        passed = {name: got[lower] for name, lower in _PASS if lower in got}
        length = passed.get(wire.HEADER_LENGTH)
        if length is not None and not (length.isascii() and length.isdigit() and int(length) <= len(answer.body)):
            # relayed as it came, a lying length would have the client read past the body or its JSON
            raise NodeBadAnswer(f"{url}: {wire.HEADER_LENGTH} {length[:20]!r} does not fit the answer")
        return NodeReply(answer.status, answer.body, passed, answer.waited_ms)

    async def post(
        self, url: str, body: bytes, headers: Mapping[str, str], timeout_s: float, admin: bool = False
    ) -> NodeReply:
        return await self._request("POST", url, body, headers, timeout_s, admin)

    async def get(self, url: str, timeout_s: float, admin: bool = False) -> NodeReply:
        return await self._request("GET", url, None, None, timeout_s, admin)

    async def delete(self, url: str, timeout_s: float, admin: bool = False) -> NodeReply:
        return await self._request("DELETE", url, None, None, timeout_s, admin)

    async def close(self) -> None:
        await self._http.close()


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

    async def post(
        self, url: str, body: bytes, headers: Mapping[str, str], timeout_s: float, admin: bool = False
    ) -> NodeReply:
        try:
            return await asyncio.wait_for(self._call("POST", url, body, headers), timeout_s)
        except TimeoutError:
            raise NodeTimeout(url) from None

    async def delete(self, url: str, timeout_s: float, admin: bool = False) -> NodeReply:
        try:
            return await asyncio.wait_for(self._call("DELETE", url, b"", {}), timeout_s)
        except TimeoutError:
            raise NodeTimeout(url) from None

    async def get(self, url: str, timeout_s: float, admin: bool = False) -> NodeReply:
        try:
            return await asyncio.wait_for(self._call("GET", url, b"", {}), timeout_s)
        except TimeoutError:
            raise NodeTimeout(url) from None

    async def close(self) -> None:
        return None
