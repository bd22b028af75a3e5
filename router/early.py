"""The doors' early refusal: work the router's own saturation rule refuses (router.lifecycle.saturation)
is answered as soon as what it says of itself is read (an HTTP request's head, before aiohttp builds a
request for it; an MQTT request's properties, before the door makes a task for it: router.mqtt_api).

When the router itself is the bottleneck every refusal spends the core that the work it admits needs. A
refusal through aiohttp's whole request path (a `Request`, a handler task, the middleware, the body read
and parsed for intake, a `Response`) cost 0.55x a routed request on the development machine, so offered
twice its capacity the router had almost nothing left to route: goodput at most (1 - 2f) / (1 - f) of
the capacity for a refusal costing f of a routed request (docs/measurements.md, "The router itself the
bottleneck"). The rule needs only what a request's head says when it carries its hints as headers (its
priority, its deadline), so `EarlyDoor` asks it there (`look`, then `refuse`), on the connection's
protocol, for a request that:

- is `POST /v2/models/{model}[/versions/{version}]/infer` with its whole body already received, within
  `max_body_bytes`, keeping its connection alive, on a connection with no request before it in flight
  (its answer cannot overtake another) and little unsent (a client that reads no answers gets no more
  written for it here);
- gives its priority as the `x-edgeroute-priority` header (a header wins over the body's, so the body
  cannot change it), names no site by header, and its deadline, if any, by header (else the router's
  default budget is the one weighed, as the body is not read);
- meets nothing that would answer it first on the full path: it authenticates, its model and version
  are names a node serves, and no workflow, cascade, tenant or trace applies.

Such a request the rule refuses (asked first without taking anything: `Saturation.refuse(peek=True)`)
gets the full path's answer: the client's rate is taken first (its 429 where it is over), then the 503
with the rule's reason and `Retry-After`, counted in `edgeroute_requests_total` and captured as the
full path does. Everything else (and everything while the rule is not armed) goes on to aiohttp's path
untouched, so the answers differ from the full path's in one way: under saturation a request refused
here is refused before its body is parsed, so a body that would have been a 400 is a 503 then.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from http import HTTPStatus
from typing import Any, NamedTuple

from aiohttp import web
from aiohttp.helpers import rfc822_formatted_time
from aiohttp.http import SERVER_SOFTWARE
from aiohttp.http_parser import RawRequestMessage
from aiohttp.web_protocol import RequestHandler

from router import director
from router.dataplane.haproxy import KEY_HEADER, PEER_HEADER, vouched
from router.dispatch import Outcome
from router.lifecycle import intake
from router.state import Router
from telemetry.oip import wire
from telemetry.process import tracing

INFER = re.compile(r"/v2/models/([^/?%]+)(?:/versions/([^/?%]+))?/infer")
UNSENT_LIMIT = 64 << 10  # bytes written and not yet taken by the client past which nothing more is written here


class Look(NamedTuple):
    """What the rule's look at a request found: the request's priority and budget (ms)."""

    priority: int
    budget_ms: float


def peer_of(router: Router, headers: Mapping[str, str], remote: str | None) -> str:
    """The client's address: the connection's, or, for a request the native data plane passed on (its
    key proves it), the one the proxy saw (router.dataplane)."""
    dp = router.dataplane
    if dp is not None:
        peer = vouched(dp.key, headers.get(KEY_HEADER), headers.get(PEER_HEADER))
        if peer is not None:
            return peer
    return remote or "unknown"


def look(
    router: Router, priority: str | None, deadline: str | None, site: str | None, transport_ms: float | None = None
) -> Look | None:
    """Whether the saturation rule refuses a request on the hints its door decoded (its priority, its
    deadline and the site it names as given, the transport's deadline): its priority and budget, else
    None (it goes the full path: as it does for any site named, which the full path checks). Nothing is
    taken or counted."""
    sat = router.saturation
    if priority is None or site is not None or not sat.armed:
        return None
    if tracing.TRACER is not None or router.lifecycle.tenants.enabled:
        return None
    try:
        prio = wire.priority_hint(priority) or 0
        given = wire.deadline_hint(deadline, None, transport_ms)
    except wire.BadHint:
        return None  # (the full path's 400)
    if given is not None and given <= 0:
        return None  # (the full path's 504)
    budget = intake.budget_ms(given, router.lifecycle.settings.intake)
    if sat.refuse(prio, budget, peek=True) is None:
        return None
    return Look(prio, budget)


def routed(router: Router, model: str, version: str | None) -> bool:
    """Whether the full path would route a request for `model` (and `version`) by the policy, with
    nothing (a bad name, a workflow, a cascade, a model no node serves) to answer it before the rule."""
    return not (
        len(model) > director.MAX_NAME
        or not director.NAME.match(model)
        or (version is not None and not director.NAME.match(version))
        or model in router.workflows
        or model in router.cascades
        or model in router.cascade_only
        or router.lifecycle.unknown_model(model) is not None
    )


def refuse(
    router: Router, seen: Look, door: str, model: str, version: str | None, client: str, size: int
) -> tuple[int, str, str]:
    """A request `look` found refused, from an authenticated `client`, answered as the full path answers
    it: its client's rate taken first (its 429 where it is over), else the rule's 503 taken; counted and
    captured. (status, reason, Retry-After)."""
    sat = router.saturation
    arrived = router.clock()
    limited = director.admit(router, client, model)
    if limited is None:
        status, retry = 503, "1"
        why = sat.refuse(seen.priority, seen.budget_ms) or "the router is saturated"  # (as `look` found)
        sat.refused_early += 1
        director.count(router, model, seen.priority, "none", 503, arrived)
    else:
        status, why, retry = limited.status, limited.reason, limited.headers["Retry-After"]
    if router.capture is not None:
        call = director.InferCall(model, version, b"", {}, client, arrived, door=door)
        site = router.auth.site_of(client) or router.lifecycle.settings.intake.site
        outcome = limited or Outcome.error(status, why)
        director.record(router, call, director.Trail(seen.priority, site, seen.budget_ms), outcome, size)
    return status, why, retry


def refusal(router: Router, msg: RawRequestMessage, remote: str | None) -> tuple[int, str, str] | None:
    """The full path's answer to an HTTP request where the rule refuses it on its head alone: (status,
    reason, Retry-After); else None: it goes the full path. Nothing is taken or counted for None."""
    headers = msg.headers
    if msg.method != "POST":
        return None
    seen = look(router, headers.get(wire.PRIORITY), headers.get(wire.DEADLINE_MS), headers.get(wire.SITE))
    path = INFER.fullmatch(msg.path) if seen is not None else None
    if seen is None or path is None or not routed(router, path.group(1), path.group(2)):
        return None
    verdict = router.auth.check(headers.get("Authorization"), False, peer_of(router, headers, remote))
    if verdict.status:
        return None  # (the full path's 401 or 403)
    return refuse(router, seen, "http", path.group(1), path.group(2), verdict.client, _length(msg))


_ANSWERS: dict[tuple[int, str, str], tuple[bytes, bytes]] = {}  # an answer's bytes before and after its date
_ANSWERS_MAX = 1024  # (reasons differ by the figures they give: a few hundred in all)


def _answer(status: int, reason: str, retry_after: str) -> bytes:
    """The HTTP/1.1 answer aiohttp would write for `Outcome.error(status, reason)` with its Retry-After
    (router.http_api.outcome_response)."""
    key = (status, reason, retry_after)
    parts = _ANSWERS.get(key)
    if parts is None:
        if len(_ANSWERS) >= _ANSWERS_MAX:
            _ANSWERS.clear()
        body = json.dumps({"error": reason}).encode()
        head = (
            f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\nContent-Type: application/json\r\n"
            f"Retry-After: {retry_after}\r\nContent-Length: {len(body)}\r\nDate: "
        )
        parts = _ANSWERS[key] = (head.encode("latin-1"), f"\r\nServer: {SERVER_SOFTWARE}\r\n\r\n".encode() + body)
    return parts[0] + rfc822_formatted_time().encode() + parts[1]


class EarlyDoor(RequestHandler):
    """aiohttp's protocol for one connection, asking `refusal` of each request parsed while the
    connection waits for its next one. The first it leaves alone, and all after it on the connection,
    go on as aiohttp would take them."""

    __slots__ = ("_router",)

    def __init__(self, server: web.Server, router: Router) -> None:
        super().__init__(server, loop=server._loop, **server._kwargs)
        self._router = router

    def data_received(self, data: bytes) -> None:
        waiter = self._waiter
        if (
            self._messages
            or self._request_in_progress
            or (waiter is not None and waiter.done())
            or not self._router.saturation.armed
        ):
            super().data_received(data)  # (a request before it not yet answered, or nothing to refuse)
            return
        # the connection's task waits for a request (`waiter`), or is on its way to (None: it has just
        # answered one); so aiohttp does not wake it for what is answered here, the waiter is kept aside
        self._waiter = None
        try:
            super().data_received(data)
        finally:
            self._waiter = waiter
        messages = self._messages
        while messages:
            msg, payload = messages[0]
            transport = self.transport
            if (
                transport is None
                or not isinstance(msg, RawRequestMessage)
                or msg.should_close
                or not payload.is_eof()
                or transport.get_write_buffer_size() > UNSENT_LIMIT
                or _length(msg) > self._router.config.max_body_bytes
            ):
                break
            answer = refusal(self._router, msg, _remote(transport))
            if answer is None:
                break
            messages.popleft()
            if self._parser is not None:
                self._parser.message_consumed()
            transport.write(_answer(*answer))
            self._keep_open()
        if messages:
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
        elif self._buffer_paused:
            self._resume_reading_if_drained()

    def _keep_open(self) -> None:
        """A connection answered here is as alive as one answered by aiohttp: its idle timer restarts."""
        timeout = self._keepalive_timeout
        if timeout > 0:
            close_time = self._loop.time() + timeout
            self._next_keepalive_close_time = close_time
            if self._keepalive_handle is None:
                self._keepalive_handle = self._loop.call_at(close_time, self._process_keepalive)


def _length(msg: RawRequestMessage) -> int:
    """The body's announced length (llhttp has checked it is digits; 0 with none)."""
    try:
        return int(msg.headers.get("Content-Length") or 0)
    except ValueError:
        return 1 << 62


def _remote(transport: Any) -> str | None:
    """The peer's address as aiohttp's `request.remote` gives it."""
    peername = transport.get_extra_info("peername")
    if peername is None:
        return None
    if isinstance(peername, (list, tuple)):
        return str(peername[0])
    return str(peername)


__all__ = ["EarlyDoor", "Look", "look", "peer_of", "refusal", "refuse", "routed"]
