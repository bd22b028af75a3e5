"""What every part of the proxy's configuration is written from and with (router.dataplane.haproxy
renders the doors, router.dataplane.backends the backends): the settings it is rendered from
(`Render`), values written into it only where they cannot break out of their line, and the answers
the proxy gives itself (HTTP's JSON error, or a gRPC status)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from router.dataplane.settings import DataPlaneConfig
from telemetry.oip import wire

__all__ = [
    "ERRORS",
    "GRPC_CODES",
    "KEY_HEADER",
    "PEER_HEADER",
    "Render",
    "body_wait",
    "errors",
    "ms",
    "refusal",
    "safe",
]

UNSAFE = re.compile(r"[\s\"'\\#;%$]")  # a value that would break out of a config line
KEY_HEADER = "x-edgeroute-dataplane-key"  # proxy -> router: the requests it passes on are its own
PEER_HEADER = "x-edgeroute-peer"  # proxy -> router: the client's address
GRPC_CODES = {400: 3, 408: 4, 413: 8, 429: 8, 502: 14, 503: 14, 504: 4}


@dataclass(frozen=True)
class Render:
    """Everything the configuration depends on but the plan."""

    settings: DataPlaneConfig
    listen: tuple[str, int]
    python: str  # the router behind the proxy: its private socket (a path) or HOST:PORT
    rundir: str  # sockets and maps (a private folder)
    key: str  # the header value that marks the proxy's requests to the router
    tls_pem: str | None = None  # cert + key for the proxy's own HTTPS (the router's, joined)
    client_ca: str | None = None  # mTLS: client certificates must be signed by this
    auth: bool = False
    rate: tuple[float, int] | None = None  # (rps, burst) per client
    max_body_bytes: int = 8 << 20
    default_deadline_ms: float = 2000.0
    max_deadline_ms: float = 60_000.0
    connect_timeout_ms: float = 500.0
    retries: int = 2
    max_answer_bytes: int | None = None
    node_token: str | None = None
    idle_timeout_s: float = 30.0
    body_timeout_s: float = 10.0  # a request's whole body after its head (the router's `body_timeout_s`)
    python_priority_at: int | None = None  # requests at or above this priority go to the router (it hedges them)
    grpc_listen: tuple[str, int] | None = None  # the proxy's gRPC door (None: none)
    python_grpc: str | None = None  # the router's gRPC door behind it (as `python`)
    python_grpc_http1: str | None = None  # its ModelInfer over HTTP/1.1 (None: ModelInfer to `python_grpc` too)
    links: bool = False  # emulated links: the Lua action that waits out a link's delay (router.dataplane.links)
    link_site: str | None = None  # the site a request naming none comes from (the router's own), for links


def safe(value: str, what: str) -> str:
    if not value or UNSAFE.search(value) or not value.isprintable():
        raise ValueError(f"{what} cannot be written into the proxy's configuration (spaces, quotes or controls)")
    return value


def ms(value: float) -> str:
    return f"{max(1, round(value))}ms"


def _error(status: int, message: str, retry_after: bool = False, grpc: bool = False) -> str:
    hdr = " hdr Retry-After 1" if retry_after else ""
    if grpc:  # (a trailers-only answer: gRPC clients read grpc-status before the HTTP status)
        return f"    http-error status {status} hdr grpc-status {GRPC_CODES[status]} hdr grpc-message '{message}'{hdr}"
    body = wire.dumps({"error": message}).decode()
    return f"    http-error status {status} content-type application/json{hdr} string '{body}'"


ERRORS = (
    (400, "bad request", False),
    (408, "request head not received in time", False),
    (502, "the node gave no valid answer", False),
    (503, "no node can take the request now", True),
    (504, "deadline exceeded before the node answered", False),
)


def errors(grpc: bool) -> list[str]:
    return [_error(status, message, retry, grpc) for status, message, retry in ERRORS]


def body_wait(r: Render, grpc: bool, timer: bool = True) -> list[str]:
    """A backend that holds a request's body (or, `timer` off, the gRPC door, which reads a message's
    first bytes with its own wait): how long it waits for it after the head, and its 408 past that, in
    the router's words (its `body_timeout_s`; the head's own time is `idle_timeout_s`, the frontend's).
    It replaces the 408 of `errors`."""
    return [
        *([f"    timeout http-request {ms(r.body_timeout_s * 1000)}"] if timer else []),
        _error(408, f"request body not received within {r.body_timeout_s:g} s", False, grpc),
    ]


def refusal(message: str, grpc: bool) -> str:
    """The body of a 429 the proxy answers itself (`http-request return`): a gRPC status and message on
    the gRPC door, the router's JSON error on the HTTP door."""
    if grpc:
        return f"hdr grpc-status {GRPC_CODES[429]} hdr grpc-message '{message}'"
    return f"content-type application/json string '{wire.dumps({'error': message}).decode()}'"
