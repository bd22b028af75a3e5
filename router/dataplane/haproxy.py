"""HAProxy as the native data plane: its configuration, rendered from a `Plan` (pure: no sockets, no
processes; router.dataplane.runtime moves it from one plan to the next without a reload,
router.dataplane.proxy runs it).

The layout (router.dataplane.plan says why it is fixed):

- frontend `door`: a request is carried natively when it is `POST /v2/models/<m>/infer`, `<m>` is in
  `models.map`, its backend has a server up, and nothing about it needs the router: no site or tenant
  header, priority and deadline headers well formed (the deadline becomes the node's timeout, capped
  as the router caps it, the priority the proxy's queue class), one Content-Length within the body
  limit, and with auth on a bearer token whose SHA-256 is in `clients.map`. Anything else (a missing or
  unknown token, a header the router must judge, a chunked body, another route) goes to backend
  `python`, the router itself, which answers exactly as it does alone.
- backend `nodes`: one server per node slot, checked (`GET /v2/health/ready` every `check_ms`, two
  failures down); each model's servers track these, so a node's death takes it out of every model.
- backend `m<j>`: model slot j, balanced as the policy says, one server per node slot, ready where
  the node serves the model. A connect to a node that has gone silent (its host down, a WAN cut) is
  ended by the kernel (`tcp-ut`, TCP_USER_TIMEOUT), not by HAProxy's connect timer, which is set a
  second past it: HAProxy answers a connect that fails with an error with its 503, but one that its
  own timer ends, on a client connection that has carried a request before, with a closed connection
  and no answer (by design, so that an HTTP client may retry; `http_return_srv_error` in HAProxy's
  source). Linux sends its first SYN again after a second and only then checks the user timeout, so
  such a connect fails after max(`connect_timeout_ms`, 1 s). With emulated links, the answer of a
  server in `links.map` waits out its link's delay in a Lua action (router.dataplane.links).
- rate limits: a sliding window per client (at most `burst` requests in any `burst/rps` seconds, at
  least a second): the same sustained rate and largest burst as the router's token bucket; one table
  for both doors, as the router's bucket counts a client's requests over every door.
- frontend `gdoor` (where the router has a gRPC door): OIP v2 gRPC over HTTP/2. A `ModelInfer` call
  is carried natively when the model named first in its message (field 1, as every protobuf encoder
  writes it) is in `grpc_models.map` (keyed by the message's first bytes in hex: tag, length, name),
  uncompressed and within the body limit, with the same header (metadata) and token checks as `door`;
  backend `g<j>` carries it over HTTP/2 to the nodes' gRPC services, its deadline the earlier of the
  call's `grpc-timeout` and the deadline header. Everything else (other calls, streams, a model the
  map lacks) goes to backend `pygrpc`, the router's own gRPC door. The proxy's own refusals carry a
  gRPC status (`grpc-status`), as a gRPC server's would.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import re
from collections.abc import Mapping
from dataclasses import dataclass

from router.dataplane.links import LINK_ACTION
from router.dataplane.plan import ALWAYS_TRY_MIN, Plan, ServerState
from router.dataplane.settings import DataPlaneConfig, default_threads
from telemetry.oip import wire

__all__ = [
    "GRPC_SOCKET",
    "MODEL_NAME",
    "ROUTER_SOCKET",
    "Render",
    "grpc_key",
    "map_lines",
    "node_connect_ms",
    "retry_body_bytes",
    "render",
    "token_key",
    "vouched",
]

MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")  # what may stand in the proxy's map
MAX_DEADLINE_DIGITS = 9
REWRITE_BYTES = 1024  # HAProxy's tune.maxrewrite: buffer room kept for rewriting headers
HEAD_BYTES = 8192  # room for a request's headers (and HTX's own) beside its body
SYN_RETRY_MS = 1000.0  # Linux's first SYN retransmission (TCP_TIMEOUT_INIT): no user timeout ends a connect sooner
CONNECT_MARGIN_MS = 1000.0  # HAProxy's own connect timer, past the kernel's (a safety net only)
UNSAFE = re.compile(r"[\s\"'\\#;%$]")  # a value that would break out of a config line
KEY_HEADER = "x-edgeroute-dataplane-key"  # proxy -> router: the requests it passes on are its own
PEER_HEADER = "x-edgeroute-peer"  # proxy -> router: the client's address
ROUTER_SOCKET = "router.sock"  # the router serves its proxy here, in the proxy's private folder
GRPC_SOCKET = "router-grpc.sock"  # its gRPC door for its proxy
GRPC_INFER = "/inference.GRPCInferenceService/ModelInfer"
GRPC_NAME_MAX = 127  # a name whose length is one varint byte (the map's keys have a fixed layout)
BODY_WAIT_MS = 1000  # how long the gRPC door waits for a message's first bytes before passing it on
# gRPC's `grpc-timeout`: digits and a unit -> the converters that make milliseconds of it
GRPC_UNITS = {
    "H": ",mul(3600000)",
    "M": ",mul(60000)",
    "S": ",mul(1000)",
    "m": "",
    "u": ",div(1000)",
    "n": ",div(1000000)",
}
# the proxy's own refusals as a gRPC server's (HTTP status -> grpc-status)
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
    python_priority_at: int | None = None  # requests at or above this priority go to the router (it hedges them)
    grpc_listen: tuple[str, int] | None = None  # the proxy's gRPC door (None: none)
    python_grpc: str | None = None  # the router's gRPC door behind it (as `python`)
    links: bool = False  # emulated links: the Lua action that waits out a link's delay (router.dataplane.links)
    link_site: str | None = None  # the site a request naming none comes from (the router's own), for links


def token_key(token: str) -> str:
    """A bearer token as the proxy's client map holds it (its SHA-256, as HAProxy's `sha2(256),hex`)."""
    return hashlib.sha256(token.encode()).hexdigest().upper()


def vouched(key: str, given: str | None, peer: str | None) -> str | None:
    """The client's address a request passed on by the proxy carries (PEER_HEADER), where the key it
    carries (KEY_HEADER, `given`) is the proxy's `key`; None otherwise (anyone may send the header)."""
    if given is None or not hmac.compare_digest(given.encode(errors="replace"), key.encode()):
        return None
    return (peer or "unknown")[:64]


def grpc_key(model: str) -> str:
    """A model as the gRPC door's map holds it: the first bytes of a ModelInferRequest naming it (field
    1's tag, its length, the name), in hex as HAProxy's `hex` writes them."""
    name = model.encode()
    return (bytes([0x0A, len(name)]) + name).hex().upper()


def map_lines(entries: Mapping[str, str]) -> str:
    return "".join(f"{k} {v}\n" for k, v in sorted(entries.items()))


def _safe(value: str, what: str) -> str:
    if not value or UNSAFE.search(value) or not value.isprintable():
        raise ValueError(f"{what} cannot be written into the proxy's configuration (spaces, quotes or controls)")
    return value


def _ms(value: float) -> str:
    return f"{max(1, round(value))}ms"


def retry_body_bytes(s: DataPlaneConfig) -> int:
    """The largest body the proxy carries: one it holds whole in its buffer, so that it can send the
    request again when a node fails under it (HAProxy's L7 retries). HAProxy closes a kept-alive
    client connection without an answer where a request that is not its first fails before any answer
    and cannot be sent again; a larger body goes to the router, which sends it again itself."""
    return s.buffer_kb * 1024 - REWRITE_BYTES - HEAD_BYTES


def node_connect_ms(r: Render) -> tuple[float, float]:
    """(the kernel's user timeout on a connection to a node, HAProxy's connect timer past it) in ms."""
    user = max(r.connect_timeout_ms, SYN_RETRY_MS)
    return user, user + CONNECT_MARGIN_MS


def _server(i: int, s: ServerState | None, extra: str, up: bool, limit: bool = False) -> str:
    """Node slot i's server (`limit`: with its own maxconn, where the plan gives one)."""
    if s is None:
        return f"    server n{i} 0.0.0.0:1 disabled {extra}".rstrip()
    host = f"[{s.host}]" if ":" in s.host else s.host
    own = f" maxconn {s.maxconn}" if limit and s.maxconn is not None else ""
    return f"    server n{i} {host}:{s.port} weight {s.weight}{own} {extra}{'' if up else ' disabled'}".rstrip()


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


def _errors(grpc: bool) -> list[str]:
    return [_error(status, message, retry, grpc) for status, message, retry in ERRORS]


def _addr(host: str, port: int) -> str:
    return f"{'[' + host + ']' if ':' in host else host}:{port}"


def _bind(r: Render, listen: tuple[str, int], grpc: bool) -> str:
    bind = _addr(*listen) + (" proto h2" if grpc and r.tls_pem is None else "")
    if r.tls_pem is not None:
        bind += f" ssl crt {r.tls_pem}" + (" alpn h2" if grpc else "")
        bind += f" ca-file {r.client_ca} verify required" if r.client_ca else ""
    return bind


def _header_checks(r: Render) -> list[str]:
    """What sends a request of either door to the router: a header (metadata) it must judge, a hedged
    priority, an unknown token."""
    conds = [
        f"{{ req.hdr_cnt({wire.SITE}) gt 1 }}",
        f"{{ req.hdr_cnt({wire.SITE}) eq 1 }} !{{ var(txn.siteok) -m found }}",  # a site it may not claim
        f"{{ req.hdr_cnt({wire.TENANT}) gt 0 }}",
    ]
    assert wire.MAX_PRIORITY == 1_000_000  # (the pattern below bounds the priority header to it)
    for name, pattern in (
        (wire.DEADLINE_MS, f"^[1-9][0-9]{{0,{MAX_DEADLINE_DIGITS - 1}}}$"),
        (wire.PRIORITY, "^-?(1000000|[0-9]{1,6})$"),
    ):
        conds.append(f"{{ req.hdr_cnt({name}) gt 1 }}")
        conds.append(f"{{ req.hdr_cnt({name}) eq 1 }} !{{ req.hdr({name}) -m reg {pattern} }}")
    if r.python_priority_at is not None:
        conds.append(
            f"{{ req.hdr({wire.PRIORITY}),add({wire.MAX_PRIORITY}) -m int ge "
            f"{r.python_priority_at + wire.MAX_PRIORITY} }}"
        )
    if r.auth:
        conds.append("!{ var(txn.client) -m found }")
    return conds


def _client(r: Render) -> list[str]:
    """The client (its token's name) with auth on, and whether the site it names is one it may claim
    (`sites.map`: `site`, or `client|site` with auth; any other goes to the router, which judges it).
    With emulated links, the site the request comes from (`txn.lsite`), as the router's intake takes
    it: the one it names, else its key's (`client_sites.map`), else the router's own."""
    one = f"{{ req.hdr_cnt({wire.SITE}) eq 1 }}"
    if not r.auth:
        lines = [f"    http-request set-var(txn.siteok) req.hdr({wire.SITE}),map({r.rundir}/sites.map) if {one}"]
    else:
        lines = [
            f"    http-request set-var(txn.client) req.hdr(authorization),field(2,' '),sha2(256),hex,"
            f"map({r.rundir}/clients.map) if {{ var(txn.infer) -m found }} {{ req.hdr_cnt(authorization) eq 1 }} "
            "{ req.hdr(authorization) -m reg ^[Bb][Ee][Aa][Rr][Ee][Rr]\\ [^\\ ]+$ }",
            f"    http-request set-var(txn.site) req.hdr({wire.SITE}) if {one} {{ var(txn.client) -m found }}",
            f"    http-request set-var(txn.siteok) var(txn.client),concat(|,txn.site),map({r.rundir}/sites.map) "
            "if { var(txn.site) -m found }",
        ]
    if not r.links:
        return lines
    none = f"!{{ req.hdr_cnt({wire.SITE}) gt 0 }}"
    lines.append(f"    http-request set-var(txn.lsite) req.hdr({wire.SITE}) if {one} {{ var(txn.siteok) -m found }}")
    if r.auth:
        lines.append(
            f"    http-request set-var(txn.lsite) var(txn.client),map({r.rundir}/client_sites.map) "
            f"if {none} {{ var(txn.client) -m found }}"
        )
    if r.link_site is not None:
        own = _safe(r.link_site, "the router's site")
        lines.append(f"    http-request set-var(txn.lsite) str({own}) if {none} !{{ var(txn.lsite) -m found }}")
    return lines


def _refusal(message: str, grpc: bool) -> str:
    """The body of a 429 the proxy answers itself (`http-request return`): a gRPC status and message on
    the gRPC door, the router's JSON error on the HTTP door."""
    if grpc:
        return f"hdr grpc-status {GRPC_CODES[429]} hdr grpc-message '{message}'"
    return f"content-type application/json string '{wire.dumps({'error': message}).decode()}'"


def _rate(r: Render, grpc: bool) -> list[str]:
    """The rate limit's rules (every inference request of a known client counts, those the router
    answers too: its own bucket sees only those, so the proxy's window is the one that binds)."""
    if r.rate is None:
        return []
    rps, burst = r.rate
    window_s = max(1, round(burst / rps))
    limit = max(burst, round(rps * window_s))
    key, known = ("var(txn.client)", "{ var(txn.client) -m found }") if r.auth else ("src", "")
    message = f"over {rps:g} requests/s"
    answer = _refusal(message, grpc)
    return [
        f"    http-request track-sc0 {key} table rates if {{ var(txn.infer) -m found }} {known}".rstrip(),
        f"    http-request return status 429 hdr Retry-After {window_s} {answer} "
        f"if {{ var(txn.infer) -m found }} {known} {{ sc_http_req_rate(0) gt {limit} }}",
    ]


def _global(r: Render) -> list[str]:
    s = r.settings
    lines = [
        "global",
        f"    stats socket {r.rundir}/admin.sock mode 600 level admin",
        f"    maxconn {s.max_connections}",
        "    hard-stop-after 10s",
        "    tune.ssl.default-dh-param 2048",
        f"    tune.bufsize {s.buffer_kb * 1024}",
        f"    tune.maxrewrite {REWRITE_BYTES}",
    ]
    if r.links:
        lines.append(f"    lua-load {r.rundir}/links.lua")
    lines.append(f"    nbthread {s.threads or default_threads()}")
    return lines + [
        "defaults",
        "    mode http",
        "    option http-keep-alive",
        "    option dontlognull",
        f"    timeout connect {_ms(r.connect_timeout_ms)}",
        "    timeout client 60s",
        f"    timeout http-request {_ms(r.idle_timeout_s * 1000)}",
        f"    timeout http-keep-alive {_ms(r.idle_timeout_s * 1000)}",
        f"    timeout server {_ms(r.default_deadline_ms)}",
        f"    timeout queue {_ms(s.queue_timeout_ms)}",
        "    unique-id-format dp%{+X}o%ci%cp%Ts%rt%pid",  # (a request's id for the node: its executions counted)
        *_errors(False),
        "",
    ]


def _route(r: Render, conds: list[str], kind: str, python: str, grpc: bool) -> list[str]:
    """A door's last rules: any of `conds` sends the request to the router, the rate limit, each model's
    backend (`kind` + slot) while it has a server up, else the router (`python`; inference the router
    answers has a backend of its own, so the proxy's counts tell it from the rest)."""
    lines = [f"    http-request unset-var(txn.be) if {{ var(txn.be) -m found }} {c}" for c in conds]
    lines += _rate(r, grpc)
    lines += [
        f"    use_backend {kind}{j} if {{ var(txn.be) -m str {kind}{j} }} {{ nbsrv({kind}{j}) gt 0 }}"
        for j in range(r.settings.model_slots)
    ]
    return lines + [
        f"    use_backend {python}_infer if {{ var(txn.infer) -m found }}",
        f"    default_backend {python}",
        "",
    ]


def _door(r: Render) -> list[str]:
    s = r.settings
    lines = [
        "frontend door",
        f"    bind {_bind(r, r.listen, False)}",
        f"    maxconn {s.max_connections}",
        f"    http-request del-header {KEY_HEADER}",
        f"    http-request del-header {PEER_HEADER}",
        "    http-request set-var(txn.infer) bool(true) if METH_POST { path_reg ^/v2/models/[^/]+/infer$ }",
        f"    http-request set-var(txn.be) path,field(4,/),map({r.rundir}/models.map) if {{ var(txn.infer) -m found }}",
        *_client(r),
    ]
    conds = _header_checks(r) + [
        "{ req.hdr_cnt(transfer-encoding) gt 0 }",
        "!{ req.hdr_cnt(content-length) eq 1 }",
        # a body over the limit: the router refuses it and drains what the client still sends (a
        # proxy that answers and closes would cut the client off mid-upload, a broken pipe, not a 413)
        f"{{ req.hdr(content-length) -m int gt {r.max_body_bytes} }}",
        # a body the proxy could not send again: the router carries it (retry_body_bytes)
        f"{{ req.hdr(content-length) -m int gt {retry_body_bytes(s)} }}",
    ]
    return lines + _route(r, conds, "m", "python", False)


def _grpc_door(r: Render) -> list[str]:
    s = r.settings
    assert r.grpc_listen is not None
    max_dl = int(r.max_deadline_ms)
    gto = "req.hdr(grpc-timeout)"
    lines = [
        "frontend gdoor",
        f"    bind {_bind(r, r.grpc_listen, True)}",
        f"    maxconn {s.max_connections}",
        *_errors(True),
        f"    http-request del-header {KEY_HEADER}",
        f"    http-request del-header {PEER_HEADER}",
        f"    http-request set-var(txn.infer) bool(true) if METH_POST {{ path {GRPC_INFER} }}",
        f"    http-request wait-for-body time {BODY_WAIT_MS}ms at-least {GRPC_NAME_MAX + 7} "
        "if { var(txn.infer) -m found }",
        f"    http-request set-var(txn.be) req.body,bytes(5,{GRPC_NAME_MAX + 2}),hex,"
        f"map_beg({r.rundir}/grpc_models.map) "
        "if { var(txn.infer) -m found }",
        *_client(r),
    ]
    # the deadline: the call's grpc-timeout in ms, the deadline header where it is earlier
    for unit, conv in GRPC_UNITS.items():
        lines.append(
            f"    http-request set-var(txn.dl) {gto},field(1,{unit}){conv} if {{ {gto} -m reg ^[0-9]{{1,8}}{unit}$ }}"
        )
    dl, one = f"req.hdr({wire.DEADLINE_MS})", f"{{ req.hdr_cnt({wire.DEADLINE_MS}) eq 1 }}"
    lines += [
        f"    http-request set-var(txn.dd) {dl},sub(txn.dl) if {{ var(txn.dl) -m found }} {one}",
        f"    http-request set-var(txn.dl) {dl} if {one} !{{ var(txn.dl) -m found }}",
        f"    http-request set-var(txn.dl) {dl} if {{ var(txn.dd) -m int lt 0 }}",
        f"    http-request set-var(txn.dl) int({max_dl}) if {{ var(txn.dl) -m int gt {max_dl} }}",
    ]
    conds = _header_checks(r) + [
        f"{{ {gto} -m found }} !{{ var(txn.dl) -m found }}",  # (a grpc-timeout not understood)
        "{ var(txn.dl) -m int lt 1 }",
        "!{ req.body,bytes(0,1),hex -m str 00 }",  # a compressed message
        f"{{ req.body,bytes(1,4),hex,hex2i -m int gt {r.max_body_bytes} }}",
        f"{{ req.body,bytes(1,4),hex,hex2i -m int gt {retry_body_bytes(s)} }}",
    ]
    return lines + _route(r, conds, "g", "pygrpc", True)


def _python(r: Render, name: str, addr: str, grpc: bool) -> list[str]:
    """The router behind the proxy, on its private socket (plain: the folder's mode guards it, so a
    router with mutual TLS needs no certificate for its own proxy): the client's own Authorization goes
    on, the proxy's mark and the client's address with it (the router trusts them only with the key,
    router.app.front_door)."""
    where = f"unix@{addr}" if addr.startswith("/") else addr
    return [
        f"backend {name}",
        f"    timeout server {_ms(r.max_deadline_ms + 5000)}",
        *(_errors(True) if grpc else []),
        f"    http-request set-header {KEY_HEADER} {_safe(r.key, 'the data plane key')}",
        f"    http-request set-header {PEER_HEADER} %[src]",
        f"    server router {_safe(where, 'the router address')}" + (" proto h2" if grpc else ""),
        "",
    ]


def _admission(r: Render, grpc: bool) -> list[str]:
    """The policy's deadline filter, where its plan has admission costs (`costs.map`, by backend): a
    request below ALWAYS_TRY_MIN whose deadline is shorter than the wait the requests this backend
    holds (`be_conn`, queued or at a node, this one counted) put before it is refused at once with
    429 and Retry-After, as the router's filter refuses it; the refusal is the backend's own answer,
    so the proxy's counts hold it as carried."""
    dl, has = (
        ("var(txn.dl)", "{ var(txn.dl) -m found }")
        if grpc
        else (
            f"req.hdr({wire.DEADLINE_MS})",
            f"{{ req.hdr_cnt({wire.DEADLINE_MS}) eq 1 }}",
        )
    )
    low = f"!{{ req.hdr({wire.PRIORITY}) -m int ge {ALWAYS_TRY_MIN} }}"
    message = "no node can answer within the deadline"
    answer = _refusal(message, grpc)
    return [
        f"    http-request set-var(txn.cost) var(txn.be),map({r.rundir}/costs.map) if {has} {low}",
        "    http-request set-var(txn.wait) be_conn,mul(txn.cost) if { var(txn.cost) -m found }",
        f"    http-request return status 429 hdr Retry-After 1 hdr x-edgeroute-data-plane native {answer} "
        f"if {{ var(txn.wait) -m found }} {{ {dl},mul(1000),sub(txn.wait) -m int lt 0 }}",
    ]


def _model_backend(r: Render, plan: Plan, j: int, grpc: bool) -> list[str]:
    s = r.settings
    max_dl = int(r.max_deadline_ms)
    serving = plan.serving.get(j, frozenset())
    user, timer = (_ms(ms) for ms in node_connect_ms(r))
    lines = [
        f"backend {'g' if grpc else 'm'}{j}",
        f"    balance {plan.balance or 'random(2)'}",
        f"    retries {r.retries}",
        f"    timeout connect {timer}",
        "    option http-buffer-request",  # (the whole request before it is sent: it can be sent again)
        "    option redispatch 1",
        "    retry-on conn-failure empty-response",
        "    http-request del-header authorization",
    ]
    if grpc:
        lines += [
            *_errors(True),
            "    http-request set-timeout server var(txn.dl) if { var(txn.dl) -m found }",
        ]
    else:
        lines += [
            f"    http-request set-timeout server req.hdr({wire.DEADLINE_MS}) if "
            f"{{ req.hdr({wire.DEADLINE_MS}) -m int le {max_dl} }}",
            f"    http-request set-timeout server {max_dl} if {{ req.hdr({wire.DEADLINE_MS}) -m int gt {max_dl} }}",
        ]
    lines.append(
        f"    http-request set-priority-class req.hdr({wire.PRIORITY}),neg if {{ req.hdr_cnt({wire.PRIORITY}) eq 1 }}"
    )
    lines += _admission(r, grpc)
    if r.node_token is not None:
        lines.append(f"    http-request set-header Authorization 'Bearer {_safe(r.node_token, 'node_token')}'")
    if r.max_answer_bytes is not None and not grpc:
        lines.append(f"    http-request set-header {wire.MAX_ANSWER} {r.max_answer_bytes}")
    if not grpc:  # the attempt's id, as the router names its own ("<request>-<attempt>")
        lines.append(f"    http-request set-header {wire.REQUEST_ID} %[unique-id]-1")
    lines.append("    http-response set-header x-edgeroute-data-plane native")
    if r.links:  # a node across an emulated link answers after the link's delay
        lines += [
            "    http-response set-var(txn.sn) srv_name if { var(txn.lsite) -m found }",
            f"    http-response set-var(txn.lk) var(txn.lsite),concat(|,txn.sn),map({r.rundir}/links.map) "
            "if { var(txn.lsite) -m found }",
            f"    http-response lua.{LINK_ACTION} if {{ var(txn.lk) -m found }}",
        ]
    lines.append(f"    default-server maxconn {s.max_per_node}" + (" proto h2" if grpc else ""))
    for i in range(s.node_slots):
        st = plan.nodes.get(i)
        if grpc and st is not None:
            st = None if st.grpc is None else dataclasses.replace(st, host=st.grpc[0], port=st.grpc[1])
        # (tcp-ut on each server: HAProxy 2.6 does not take it from `default-server`)
        lines.append(_server(i, st, f"tcp-ut {user} track nodes/n{i}", i in serving, True))
    return lines


def render(r: Render, plan: Plan) -> str:
    """HAProxy's configuration for `plan` (the state it starts in; later plans reach it at runtime)."""
    s = r.settings
    grpc = r.grpc_listen is not None and r.python_grpc is not None
    lines = _global(r) + _door(r) + (_grpc_door(r) if grpc else [])
    lines += _python(r, "python", r.python, False) + _python(r, "python_infer", r.python, False)
    if grpc:
        assert r.python_grpc is not None
        lines += _python(r, "pygrpc", r.python_grpc, True) + _python(r, "pygrpc_infer", r.python_grpc, True)
    lines += [
        "backend nodes",
        "    option httpchk GET /v2/health/ready",
    ]
    if r.node_token is not None:
        lines.append(f"    http-check send hdr Authorization 'Bearer {_safe(r.node_token, 'node_token')}'")
    lines.append(
        f"    default-server check inter {_ms(s.check_ms)} fastinter {_ms(s.check_ms)} "
        f"downinter {_ms(s.check_ms)} fall 2 rise 1"
    )
    for i in range(s.node_slots):
        st = plan.nodes.get(i)
        lines.append(_server(i, st, "", st is not None))
    if r.rate is not None:
        window_s = max(1, round(r.rate[1] / r.rate[0]))
        lines += [
            "",
            "backend rates",
            f"    stick-table type string len 128 size 100k expire {2 * window_s}s store http_req_rate({window_s}s)",
        ]
    for j in range(s.model_slots):
        lines += ["", *_model_backend(r, plan, j, False)]
        if grpc:
            lines += ["", *_model_backend(r, plan, j, True)]
    return "\n".join(lines) + "\n"
