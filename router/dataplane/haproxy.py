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
  the node serves the model; a node's failure under a request, or a connect to it that fails, never
  closes a client's connection without an answer (router.dataplane.backends says how). With emulated
  links, the answer of a server in `links.map` waits out its link's delay in a Lua action
  (router.dataplane.links).
- rate limits: a sliding window per client (at most `burst` requests in any `burst/rps` seconds, at
  least a second): the same sustained rate and largest burst as the router's token bucket; one table
  for both doors, as the router's bucket counts a client's requests over every door.
- frontend `gdoor` (where the router has a gRPC door): OIP v2 gRPC over HTTP/2. A `ModelInfer` call
  is carried natively when the model named first in its message (field 1, as every protobuf encoder
  writes it) is in `grpc_models.map` (keyed by the message's first bytes in hex: tag, length, name),
  uncompressed and within the body limit, with the same header (metadata) and token checks as `door`;
  backend `g<j>` carries it to the nodes, its deadline the earlier of the call's `grpc-timeout` and
  the deadline header: by default over HTTP/1.1 to each node's ModelInfer door
  (telemetry.oip.grpc_http1; the proxy turns the answer's chunked trailers into HTTP/2 trailers), with
  `node_grpc: h2` over HTTP/2 to the nodes' gRPC services. A ModelInfer call it does not carry goes to
  backend `pygrpc_infer`, the router's own ModelInfer over HTTP/1.1 where it serves one
  (GRPC_HTTP1_SOCKET), a compressed one to `pygrpc_infer_h2`; everything else (other calls, streams)
  to backend `pygrpc`, the router's own gRPC door. The proxy's own refusals carry a gRPC status
  (`grpc-status`), as a gRPC server's would.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Mapping

from router.dataplane.backends import model_backend, node_connect_ms, nodes_backend, python_backend
from router.dataplane.cfg import KEY_HEADER, PEER_HEADER, Render, body_wait, errors, ms, refusal, safe
from router.dataplane.plan import Plan
from router.dataplane.settings import DataPlaneConfig, default_threads
from telemetry.oip import wire

__all__ = [
    "GRPC_SOCKET",
    "KEY_HEADER",
    "MODEL_NAME",
    "PEER_HEADER",
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
# headers of one request (or answer) the proxy takes: as many as the router's and the nodes' aiohttp doors
# (128; past it they answer 400), where HAProxy's default, 101, refused more with its own 400, which
# its HTTP/2 layer gives a gRPC client as no gRPC status (telemetry.oip.grpc_http1 takes more)
MAX_HEADERS = 128
HEAD_BYTES = 8192  # room for a request's headers (and HTX's own) beside its body
ROUTER_SOCKET = "router.sock"  # the router serves its proxy here, in the proxy's private folder
GRPC_SOCKET = "router-grpc.sock"  # its gRPC door for its proxy
COMPRESSED = "!{ req.body,bytes(0,1),hex -m str 00 }"  # a gRPC message whose first byte says compressed
GRPC_HTTP1_SOCKET = "router-grpc-http1.sock"  # its ModelInfer over HTTP/1.1 for its proxy (telemetry.oip.grpc_http1)
GRPC_INFER = "/inference.GRPCInferenceService/ModelInfer"
GRPC_NAME_MAX = 127  # a name whose length is one varint byte (the map's keys have a fixed layout)
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


def retry_body_bytes(s: DataPlaneConfig) -> int:
    """The largest body the proxy carries: one it holds whole in its buffer, so that it can send the
    request again when a node fails under it (HAProxy's L7 retries). HAProxy closes a kept-alive
    client connection without an answer where a request that is not its first fails before any answer
    and cannot be sent again; a larger body goes to the router, which sends it again itself."""
    return s.buffer_kb * 1024 - REWRITE_BYTES - HEAD_BYTES


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
        own = safe(r.link_site, "the router's site")
        lines.append(f"    http-request set-var(txn.lsite) str({own}) if {none} !{{ var(txn.lsite) -m found }}")
    return lines


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
    answer = refusal(message, grpc)
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
        f"    tune.http.maxhdr {MAX_HEADERS}",
    ]
    if r.links:
        lines.append(f"    lua-load {r.rundir}/links.lua")
    lines.append(f"    nbthread {s.threads or default_threads()}")
    return lines + [
        "defaults",
        "    mode http",
        "    option http-keep-alive",
        "    option dontlognull",
        f"    timeout connect {ms(r.connect_timeout_ms)}",
        "    timeout client 60s",
        f"    timeout http-request {ms(r.idle_timeout_s * 1000)}",
        f"    timeout http-keep-alive {ms(r.idle_timeout_s * 1000)}",
        f"    timeout server {ms(r.default_deadline_ms)}",
        f"    timeout queue {ms(s.queue_timeout_ms)}",
        "    unique-id-format dp%{+X}o%ci%cp%Ts%rt%pid",  # (a request's id for the node: its executions counted)
        *errors(False),
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
    if grpc and r.python_grpc_http1 is not None:  # (the router's HTTP/1.1 door takes no compressed message)
        lines.append(f"    use_backend {python}_infer_h2 if {{ var(txn.infer) -m found }} {COMPRESSED}")
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
        # a connection idle this long closes, one that never sends its preface too (as the router's own
        # gRPC door closes them; HTTP/2 takes no `timeout http-request` before its preface)
        f"    timeout client {ms(r.idle_timeout_s * 1000)}",
        *errors(True),
        *body_wait(r, True, timer=False),
        f"    http-request del-header {KEY_HEADER}",
        f"    http-request del-header {PEER_HEADER}",
        f"    http-request set-var(txn.infer) bool(true) if METH_POST {{ path {GRPC_INFER} }}",
        f"    http-request wait-for-body time {ms(r.body_timeout_s * 1000)} at-least {GRPC_NAME_MAX + 7} "
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
        COMPRESSED,
        f"{{ req.body,bytes(1,4),hex,hex2i -m int gt {r.max_body_bytes} }}",
        f"{{ req.body,bytes(1,4),hex,hex2i -m int gt {retry_body_bytes(s)} }}",
    ]
    return lines + _route(r, conds, "g", "pygrpc", True)


def render(r: Render, plan: Plan) -> str:
    """HAProxy's configuration for `plan` (the state it starts in; later plans reach it at runtime)."""
    s = r.settings
    grpc = r.grpc_listen is not None and r.python_grpc is not None
    lines = _global(r) + _door(r) + (_grpc_door(r) if grpc else [])
    lines += python_backend(r, "python", r.python, False) + python_backend(r, "python_infer", r.python, False)
    if grpc:
        assert r.python_grpc is not None
        lines += python_backend(r, "pygrpc", r.python_grpc, True)
        if r.python_grpc_http1 is None:
            lines += python_backend(r, "pygrpc_infer", r.python_grpc, True)
        else:  # ModelInfer over HTTP/1.1 (telemetry.oip.grpc_http1); a compressed one to the gRPC service
            lines += python_backend(r, "pygrpc_infer", r.python_grpc_http1, True, h2=False)
            lines += python_backend(r, "pygrpc_infer_h2", r.python_grpc, True)
    lines += nodes_backend(r, plan)
    if r.rate is not None:
        window_s = max(1, round(r.rate[1] / r.rate[0]))
        lines += [
            "",
            "backend rates",
            f"    stick-table type string len 128 size 100k expire {2 * window_s}s store http_req_rate({window_s}s)",
        ]
    for j in range(s.model_slots):
        lines += ["", *model_backend(r, plan, j, False)]
        if grpc:
            lines += ["", *model_backend(r, plan, j, True)]
    return "\n".join(lines) + "\n"
