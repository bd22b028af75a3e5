"""HAProxy as the native data plane: its configuration, rendered from a `Plan`, and the runtime
commands that move it from one plan to the next without a reload (pure: no sockets, no processes;
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
  the node serves the model.
- rate limits: a sliding window per client (at most `burst` requests in any `burst/rps` seconds, at
  least a second): the same sustained rate and largest burst as the router's token bucket.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass

from router.dataplane.plan import Plan, ServerState
from router.dataplane.settings import DataPlaneConfig
from telemetry.oip import wire

__all__ = ["MODEL_NAME", "Render", "commands", "map_lines", "render", "token_key"]

MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")  # what may stand in the proxy's map
MAX_DEADLINE_DIGITS = 9
UNSAFE = re.compile(r"[\s\"'\\#;%$]")  # a value that would break out of a config line
KEY_HEADER = "x-edgeroute-dataplane-key"  # proxy -> router: the requests it passes on are its own
PEER_HEADER = "x-edgeroute-peer"  # proxy -> router: the client's address


@dataclass(frozen=True)
class Render:
    """Everything the configuration depends on but the plan."""

    settings: DataPlaneConfig
    listen: tuple[str, int]
    python: tuple[str, int]  # the router behind the proxy
    rundir: str  # sockets and maps (a private folder)
    key: str  # the header value that marks the proxy's requests to the router
    python_tls: bool = False  # the router serves HTTPS
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


def token_key(token: str) -> str:
    """A bearer token as the proxy's client map holds it (its SHA-256, as HAProxy's `sha2(256),hex`)."""
    return hashlib.sha256(token.encode()).hexdigest().upper()


def map_lines(entries: Mapping[str, str]) -> str:
    return "".join(f"{k} {v}\n" for k, v in sorted(entries.items()))


def _safe(value: str, what: str) -> str:
    if not value or UNSAFE.search(value) or not value.isprintable():
        raise ValueError(f"{what} cannot be written into the proxy's configuration (spaces, quotes or controls)")
    return value


def _ms(value: float) -> str:
    return f"{max(1, round(value))}ms"


def _server(i: int, s: ServerState | None, extra: str, up: bool) -> str:
    if s is None:
        return f"    server n{i} 0.0.0.0:1 disabled {extra}".rstrip()
    host = f"[{s.host}]" if ":" in s.host else s.host
    return f"    server n{i} {host}:{s.port} weight {s.weight} {extra}{'' if up else ' disabled'}".rstrip()


def _error(status: int, message: str, retry_after: bool = False) -> str:
    hdr = " hdr Retry-After 1" if retry_after else ""
    body = wire.dumps({"error": message}).decode()
    return f"    http-error status {status} content-type application/json{hdr} string '{body}'"


def render(r: Render, plan: Plan) -> str:
    """HAProxy's configuration for `plan` (the state it starts in; later plans reach it at runtime)."""
    s = r.settings
    d = r.rundir
    host, port = r.listen
    bind = f"{'[' + host + ']' if ':' in host else host}:{port}"
    if r.tls_pem is not None:
        bind += f" ssl crt {r.tls_pem}" + (f" ca-file {r.client_ca} verify required" if r.client_ca else "")
    max_dl = int(r.max_deadline_ms)
    lines = [
        "global",
        f"    stats socket {d}/admin.sock mode 600 level admin",
        f"    maxconn {s.max_connections}",
        "    hard-stop-after 10s",
        "    tune.ssl.default-dh-param 2048",
    ]
    if s.threads is not None:
        lines.append(f"    nbthread {s.threads}")
    lines += [
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
        _error(400, "bad request"),
        _error(408, "request head not received in time"),
        _error(502, "the node gave no valid answer"),
        _error(503, "no node can take the request now", retry_after=True),
        _error(504, "deadline exceeded before the node answered"),
        "",
        "frontend door",
        f"    bind {bind}",
        f"    maxconn {s.max_connections}",
        f"    http-request del-header {KEY_HEADER}",
        f"    http-request del-header {PEER_HEADER}",
        "    http-request set-var(txn.infer) bool(true) if METH_POST { path_reg ^/v2/models/[^/]+/infer$ }",
        f"    http-request set-var(txn.be) path,field(4,/),map({d}/models.map) if {{ var(txn.infer) -m found }}",
    ]
    python_if = [
        f"{{ req.hdr_cnt({wire.SITE}) gt 0 }}",
        f"{{ req.hdr_cnt({wire.TENANT}) gt 0 }}",
        "{ req.hdr_cnt(transfer-encoding) gt 0 }",
        "!{ req.hdr_cnt(content-length) eq 1 }",
    ]
    assert wire.MAX_PRIORITY == 1_000_000  # (the pattern below bounds the priority header to it)
    for name, pattern in (
        (wire.DEADLINE_MS, f"^[1-9][0-9]{{0,{MAX_DEADLINE_DIGITS - 1}}}$"),
        (wire.PRIORITY, "^-?(1000000|[0-9]{1,6})$"),
    ):
        python_if.append(f"{{ req.hdr_cnt({name}) gt 1 }}")
        python_if.append(f"{{ req.hdr_cnt({name}) eq 1 }} !{{ req.hdr({name}) -m reg {pattern} }}")
    if r.python_priority_at is not None:
        python_if.append(
            f"{{ req.hdr({wire.PRIORITY}),add({wire.MAX_PRIORITY}) -m int ge "
            f"{r.python_priority_at + wire.MAX_PRIORITY} }}"
        )
    if r.auth:
        lines.append(
            f"    http-request set-var(txn.client) req.hdr(authorization),field(2,' '),sha2(256),hex,"
            f"map({d}/clients.map) if {{ var(txn.infer) -m found }} {{ req.hdr_cnt(authorization) eq 1 }} "
            "{ req.hdr(authorization) -m reg ^[Bb][Ee][Aa][Rr][Ee][Rr]\\ [^\\ ]+$ }"
        )
        python_if.append("!{ var(txn.client) -m found }")
    # a body over the limit: the router refuses it and drains what the client still sends (a proxy
    # that answers and closes would cut the client off mid-upload, a broken pipe, not a 413)
    python_if.append(f"{{ req.hdr(content-length) -m int gt {r.max_body_bytes} }}")
    for cond in python_if:
        lines.append(f"    http-request unset-var(txn.be) if {{ var(txn.be) -m found }} {cond}")
    if r.rate is not None:
        rps, burst = r.rate
        window_s = max(1, round(burst / rps))
        limit = max(burst, round(rps * window_s))
        # every inference request of a known client counts (those the router answers too: its own
        # bucket sees only those, so the proxy's window is the one that binds)
        key, known = ("var(txn.client)", "{ var(txn.client) -m found }") if r.auth else ("src", "")
        lines += [
            f"    http-request track-sc0 {key} table rates if {{ var(txn.infer) -m found }} {known}".rstrip(),
            f"    http-request return status 429 content-type application/json hdr Retry-After {window_s} "
            f"string '{wire.dumps({'error': f'over {rps:g} requests/s'}).decode()}' "
            f"if {{ var(txn.infer) -m found }} {known} {{ sc_http_req_rate(0) gt {limit} }}",
        ]
    for j in range(s.model_slots):
        lines.append(f"    use_backend m{j} if {{ var(txn.be) -m str m{j} }} {{ nbsrv(m{j}) gt 0 }}")
    lines += ["    default_backend python", ""]
    # the router behind the proxy: the client's own Authorization goes on, the proxy's mark and the
    # client's address with it (the router trusts them only with the key, router.app.front_door)
    py_host, py_port = r.python
    py_addr = f"{'[' + py_host + ']' if ':' in py_host else py_host}:{py_port}"
    lines += [
        "backend python",
        f"    timeout server {_ms(r.max_deadline_ms + 5000)}",
        f"    http-request set-header {KEY_HEADER} {_safe(r.key, 'the data plane key')}",
        f"    http-request set-header {PEER_HEADER} %[src]",
        f"    server router {py_addr}" + (" ssl verify none" if r.python_tls else ""),
        "",
        "backend nodes",
        "    option httpchk GET /v2/health/ready",
        f"    default-server check inter {_ms(s.check_ms)} fastinter {_ms(s.check_ms)} "
        f"downinter {_ms(s.check_ms)} fall 2 rise 1",
    ]
    if r.node_token is not None:
        lines.insert(
            len(lines) - 1, f"    http-check send hdr Authorization 'Bearer {_safe(r.node_token, 'node_token')}'"
        )
    for i in range(s.node_slots):
        st = plan.nodes.get(i)
        lines.append(_server(i, st, "", st is not None))
    if r.rate is not None:
        rps, burst = r.rate
        window_s = max(1, round(burst / rps))
        lines += [
            "",
            "backend rates",
            f"    stick-table type string len 128 size 100k expire {2 * window_s}s store http_req_rate({window_s}s)",
        ]
    balance = plan.balance or "random(2)"
    for j in range(s.model_slots):
        serving = plan.serving.get(j, frozenset())
        lines += [
            "",
            f"backend m{j}",
            f"    balance {balance}",
            f"    retries {r.retries}",
            "    option redispatch 1",
            "    retry-on conn-failure empty-response",
            "    http-request del-header authorization",
            f"    http-request set-timeout server req.hdr({wire.DEADLINE_MS}) if "
            f"{{ req.hdr({wire.DEADLINE_MS}) -m int le {max_dl} }}",
            f"    http-request set-timeout server {max_dl} if {{ req.hdr({wire.DEADLINE_MS}) -m int gt {max_dl} }}",
            f"    http-request set-priority-class req.hdr({wire.PRIORITY}),neg if "
            f"{{ req.hdr_cnt({wire.PRIORITY}) eq 1 }}",
        ]
        if r.node_token is not None:
            lines.append(f"    http-request set-header Authorization 'Bearer {_safe(r.node_token, 'node_token')}'")
        if r.max_answer_bytes is not None:
            lines.append(f"    http-request set-header {wire.MAX_ANSWER} {r.max_answer_bytes}")
        lines += [
            "    http-response set-header x-edgeroute-data-plane native",
            f"    default-server maxconn {s.max_per_node}",
        ]
        for i in range(s.node_slots):
            lines.append(_server(i, plan.nodes.get(i), f"track nodes/n{i}", i in serving))
    return "\n".join(lines) + "\n"


def model_map(plan: Plan) -> dict[str, str]:
    """`models.map` for a plan: each native model's backend (none when the router takes everything)."""
    if plan.balance is None:
        return {}
    return {m: f"m{j}" for m, j in plan.models.items() if MODEL_NAME.match(m) and plan.serving.get(j)}


def commands(old: Plan, new: Plan, settings: DataPlaneConfig, maps: str) -> list[str]:
    """The runtime API commands that take the proxy from `old` to `new` (same balance: a change of
    balance is a reload). `maps`: the models map's path."""
    out: list[str] = []
    for i in range(settings.node_slots):
        a, b = old.nodes.get(i), new.nodes.get(i)
        if a == b:
            continue
        if b is None:
            out.append(f"set server nodes/n{i} state maint")
            out.extend(f"set server m{j}/n{i} state maint" for j in range(settings.model_slots))
            continue
        if a is None or (a.host, a.port) != (b.host, b.port):
            out.append(f"set server nodes/n{i} addr {b.host} port {b.port}")
            out.extend(f"set server m{j}/n{i} addr {b.host} port {b.port}" for j in range(settings.model_slots))
        if a is None:
            out.append(f"set server nodes/n{i} state ready")
        if a is None or a.weight != b.weight:
            out.extend(f"set server m{j}/n{i} weight {b.weight}" for j in range(settings.model_slots))
    for j in range(settings.model_slots):
        was, now = old.serving.get(j, frozenset()), new.serving.get(j, frozenset())
        moved = {
            i
            for i in now
            if old.nodes.get(i) is None
            or (old.nodes[i].host, old.nodes[i].port) != (new.nodes[i].host, new.nodes[i].port)
        }
        for i in sorted(was - now):
            out.append(f"set server m{j}/n{i} state maint")
        for i in sorted((now - was) | (now & moved)):
            out.append(f"set server m{j}/n{i} state ready")
    before, after = model_map(old), model_map(new)
    for m in sorted(set(before) - set(after)):
        out.append(f"del map {maps} {m}")
    for m, be in sorted(after.items()):
        if m not in before:
            out.append(f"add map {maps} {m} {be}")
        elif before[m] != be:
            out.append(f"set map {maps} {m} {be}")
    return out
