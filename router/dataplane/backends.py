"""HAProxy's backends for the native data plane (router.dataplane.haproxy renders the rest): the router
behind the proxy, the nodes (checked), and each model's (balanced as the policy says, with the
proxy's admission, the node's deadline, and the emulated links' delay).

A connect to a node that has gone silent (its host down, a WAN cut) is ended by the kernel (`tcp-ut`,
TCP_USER_TIMEOUT), not by HAProxy's connect timer, which is set a second past it: HAProxy answers a
connect that fails with an error with its 503, but one that its own timer ends, on a client
connection that has carried a request before, with a closed connection and no answer (by design, so
that an HTTP client may retry; `http_return_srv_error` in HAProxy's source). Linux sends its first
SYN again after a second and only then checks the user timeout, so such a connect fails after
max(`connect_timeout_ms`, 1 s). For the same reason each model's backend holds a request whole before
sending it (`option http-buffer-request`), so that it can send it again to another node where one
fails under it (router.dataplane.haproxy.retry_body_bytes)."""

from __future__ import annotations

import dataclasses

from router.dataplane.cfg import KEY_HEADER, PEER_HEADER, Render, body_wait, errors, ms, refusal, safe
from router.dataplane.links import LINK_ACTION
from router.dataplane.plan import ALWAYS_TRY_MIN, Plan, ServerState
from telemetry.oip import wire

__all__ = ["model_backend", "node_connect_ms", "nodes_backend", "python_backend"]

SYN_RETRY_MS = 1000.0  # Linux's first SYN retransmission (TCP_TIMEOUT_INIT): no user timeout ends a connect sooner
CONNECT_MARGIN_MS = 1000.0  # HAProxy's own connect timer, past the kernel's (a safety net only)


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


def python_backend(r: Render, name: str, addr: str, grpc: bool, h2: bool = True) -> list[str]:
    """The router behind the proxy, on its private socket (plain: the folder's mode guards it, so a
    router with mutual TLS needs no certificate for its own proxy): the client's own Authorization goes
    on, the proxy's mark and the client's address with it (the router trusts them only with the key,
    router.app.front_door). `grpc` with `h2` False: gRPC calls over HTTP/1.1 (telemetry.oip.grpc_http1)."""
    where = f"unix@{addr}" if addr.startswith("/") else addr
    return [
        f"backend {name}",
        f"    timeout server {ms(r.max_deadline_ms + 5000)}",
        *(errors(True) if grpc else []),
        f"    http-request set-header {KEY_HEADER} {safe(r.key, 'the data plane key')}",
        f"    http-request set-header {PEER_HEADER} %[src]",
        # the router's 408 (a body that stopped coming) ends the client's connection, as the router's
        # own door ends it: what remains of the request would otherwise hold it until `timeout client`
        # (HTTP/1 only: gRPC answers its errors in trailers, over a connection that carries other calls)
        *([] if grpc else ["    http-response set-header connection close if { status 408 }"]),
        f"    server router {safe(where, 'the router address')}" + (" proto h2" if grpc and h2 else ""),
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
    answer = refusal(message, grpc)
    return [
        f"    http-request set-var(txn.cost) var(txn.be),map({r.rundir}/costs.map) if {has} {low}",
        "    http-request set-var(txn.wait) be_conn,mul(txn.cost) if { var(txn.cost) -m found }",
        f"    http-request return status 429 hdr Retry-After 1 hdr x-edgeroute-data-plane native {answer} "
        f"if {{ var(txn.wait) -m found }} {{ {dl},mul(1000),sub(txn.wait) -m int lt 0 }}",
    ]


def model_backend(r: Render, plan: Plan, j: int, grpc: bool) -> list[str]:
    s = r.settings
    max_dl = int(r.max_deadline_ms)
    serving = plan.serving.get(j, frozenset())
    user, timer = (ms(t) for t in node_connect_ms(r))
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
            *errors(True),
            *body_wait(r, True),
            "    http-request set-timeout server var(txn.dl) if { var(txn.dl) -m found }",
        ]
    else:
        lines += [
            *body_wait(r, False),
            f"    http-request set-timeout server req.hdr({wire.DEADLINE_MS}) if "
            f"{{ req.hdr({wire.DEADLINE_MS}) -m int le {max_dl} }}",
            f"    http-request set-timeout server {max_dl} if {{ req.hdr({wire.DEADLINE_MS}) -m int gt {max_dl} }}",
        ]
    lines.append(
        f"    http-request set-priority-class req.hdr({wire.PRIORITY}),neg if {{ req.hdr_cnt({wire.PRIORITY}) eq 1 }}"
    )
    lines += _admission(r, grpc)
    if r.node_token is not None:
        lines.append(f"    http-request set-header Authorization 'Bearer {safe(r.node_token, 'node_token')}'")
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
    h2 = grpc and s.node_grpc == "h2"  # (http1: gRPC's messages and trailers over HTTP/1.1, telemetry.oip.grpc_http1)
    lines.append(f"    default-server maxconn {s.max_per_node}" + (" proto h2" if h2 else ""))
    for i in range(s.node_slots):
        st = plan.nodes.get(i)
        if grpc and st is not None:
            st = None if st.grpc is None else dataclasses.replace(st, host=st.grpc[0], port=st.grpc[1])
        # (tcp-ut on each server: HAProxy 2.6 does not take it from `default-server`)
        lines.append(_server(i, st, f"tcp-ut {user} track nodes/n{i}", i in serving, True))
    return lines


def nodes_backend(r: Render, plan: Plan) -> list[str]:
    """Backend `nodes`: one server per node slot, checked; every model's servers track these."""
    s = r.settings
    lines: list[str] = []
    lines += [
        "backend nodes",
        "    option httpchk GET /v2/health/ready",
    ]
    if r.node_token is not None:
        lines.append(f"    http-check send hdr Authorization 'Bearer {safe(r.node_token, 'node_token')}'")
    lines.append(
        f"    default-server check inter {ms(s.check_ms)} fastinter {ms(s.check_ms)} "
        f"downinter {ms(s.check_ms)} fall 2 rise 1"
    )
    for i in range(s.node_slots):
        st = plan.nodes.get(i)
        lines.append(_server(i, st, "", st is not None))
    return lines
