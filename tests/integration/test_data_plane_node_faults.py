"""Nodes failing under the native data plane, on client connections kept alive.

HAProxy answers nothing, and closes the client's connection, when a request that is not the first on
it fails before any answer (so that an HTTP client may retry it): a connect its own timer ends, or a
node that closes the connection after taking the request (a crash). So the proxy's node connects are
ended by the kernel's TCP user timeout (router.dataplane.backends.node_connect_ms), and it takes a
request's whole body before it sends it, so that it can send it again to another node (L7 retries);
a body too large for its buffer goes to the router. Every request gets its answer.

A silent node here is a listening socket whose accept queue is full: Linux drops the SYNs it gets, as
a host behind a cut link does; a crashing node reads each request and closes the connection. The
proxy runs alone from a rendered configuration (no router, no broker); its checks are slowed so that
they do not take a failing node out during the test."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import http.server
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from router.dataplane.haproxy import Render, node_connect_ms, render, retry_body_bytes
from router.dataplane.plan import Plan, ServerState
from router.dataplane.proxy import Haproxy, find_binary, install_hint
from router.dataplane.runtime import map_files
from router.dataplane.settings import DataPlaneConfig

BINARY = find_binary(None)
if BINARY is None:
    pytest.skip(f"no HAProxy here: {install_hint()}", allow_module_level=True)

BODY = json.dumps(
    {"inputs": [{"name": "readings", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
).encode()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _silent() -> Iterator[int]:
    """A port whose SYNs go unanswered: a listener with a full accept queue, never accepting."""
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(0)
    port = int(lsock.getsockname()[1])
    held = []
    try:
        for _ in range(4):
            c = socket.socket()
            c.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                c.connect(("127.0.0.1", port))
            held.append(c)
        time.sleep(0.2)
        probe = socket.socket()
        probe.settimeout(0.3)
        try:  # the premise: a connect there times out (not refused, not accepted)
            probe.connect(("127.0.0.1", port))
        except TimeoutError:
            pass
        except OSError as exc:
            pytest.skip(f"this kernel refuses a connect to a full accept queue ({exc}): no silent node here")
        else:
            pytest.skip("this kernel accepts past a full accept queue: no silent node here")
        finally:
            probe.close()
        yield port
    finally:
        for c in held:
            c.close()
        lsock.close()


class _Node(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        body = json.dumps({"model_name": "m", "outputs": []}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST  # (the proxy's readiness checks)

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def _crashing() -> Iterator[int]:
    """A node that reads each inference request whole and closes the connection without an answer
    (its readiness check answers: it stays in rotation)."""
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(64)
    lsock.settimeout(0.2)
    port = int(lsock.getsockname()[1])
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn:
            conn.settimeout(5)
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                data += chunk
            if data.startswith(b"GET "):  # (the proxy's readiness check: ready)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                return
            head, _, body = data.partition(b"\r\n\r\n")
            length = next((int(v) for k, _, v in (h.partition(b":") for h in head.split(b"\r\n")[1:])
                           if k.strip().lower() == b"content-length"), 0)  # fmt: skip
            while len(body) < length:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                body += chunk

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = lsock.accept()
            except TimeoutError:
                continue
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield port
    finally:
        stop.set()
        thread.join(2)
        lsock.close()


@contextlib.contextmanager
def _node() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Node)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def _proxy(tmp: Path, ports: list[int], retries: int, balance: str = "random(2)") -> Iterator[tuple[int, Render]]:
    rundir = tmp / "dp"
    rundir.mkdir()
    listen = ("127.0.0.1", _free_port())
    r = Render(
        settings=DataPlaneConfig(
            enabled=True, check_ms=10_000, max_connections=1000, model_slots=1, node_slots=len(ports)
        ),
        listen=listen,
        python=str(rundir / "router.sock"),  # (no router behind it: nothing here goes to one)
        rundir=str(rundir),
        key="k",
        retries=retries,
    )
    nodes = {i: ServerState(f"n{i}", "127.0.0.1", p, weight=1, ready=True) for i, p in enumerate(ports)}
    plan = Plan(balance, "", nodes, {"m": 0}, {0: frozenset(nodes)})
    maps = map_files(plan)
    assert BINARY is not None
    proxy = Haproxy(BINARY, rundir)
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(proxy.start(render(r, plan), maps))
        yield listen[1], r
    finally:
        loop.run_until_complete(proxy.stop())
        loop.close()


def _post(conn: http.client.HTTPConnection, body: bytes = BODY) -> tuple[int, bytes, float]:
    """One request on the connection as it stands (kept alive); a closed connection fails the test."""
    began = time.monotonic()
    conn.request("POST", "/v2/models/m/infer", body, {"Content-Type": "application/json", "Connection": "keep-alive"})
    resp = conn.getresponse()
    return resp.status, resp.read(), time.monotonic() - began


def test_every_request_on_a_kept_connection_gets_its_503_when_its_only_node_is_silent(tmp_path: Path) -> None:
    with _silent() as port, _proxy(tmp_path, [port], retries=0) as (listen, r):
        user_ms, timer_ms = node_connect_ms(r)
        assert (user_ms, timer_ms) == (1000.0, 2000.0)
        conn = http.client.HTTPConnection("127.0.0.1", listen, timeout=10)
        try:
            answers = [_post(conn) for _ in range(3)]  # the 2nd and 3rd were closed without an answer before
        finally:
            conn.close()
    for status, body, took in answers:
        assert status == 503, body
        assert json.loads(body) == {"error": "no node can take the request now"}
        assert 0.9 <= took < timer_ms / 1000  # the kernel ended the connect, not HAProxy's timer


def test_a_retry_past_a_silent_node_reaches_the_one_that_answers(tmp_path: Path) -> None:
    # `first` (edge_first's balance) tries the silent node, in slot 0, first every time
    with _silent() as dead, _node() as live, _proxy(tmp_path, [dead, live], 1, "first") as (listen, _):
        conn = http.client.HTTPConnection("127.0.0.1", listen, timeout=10)
        try:
            answers = [_post(conn) for _ in range(3)]
        finally:
            conn.close()
    assert [status for status, _, _ in answers] == [200] * 3, answers
    assert all(took >= 0.9 for _, _, took in answers)  # (each waited out the silent node's connect first)


def _padded(size: int) -> bytes:
    """An inference body of about `size` bytes (JSON, its data padded out)."""
    data = [0.5] * max(4, (size - 120) // 5)
    return json.dumps({"inputs": [{"name": "x", "shape": [1, len(data)], "datatype": "FP32", "data": data}]}).encode()


def test_a_node_that_fails_after_taking_the_request_is_retried_elsewhere(tmp_path: Path) -> None:
    # `first` tries the crashing node, in slot 0, first every time: every request is sent to it, which
    # reads it whole and closes; the proxy sends it again to the node that answers (a 40 kB body too:
    # larger than HAProxy's default 16 kB buffer, within the proxy's)
    with _crashing() as bad, _node() as live, _proxy(tmp_path, [bad, live], 1, "first") as (listen, r):
        limit = retry_body_bytes(r.settings)
        assert 40_000 < limit
        conn = http.client.HTTPConnection("127.0.0.1", listen, timeout=10)
        try:
            answers = [_post(conn, _padded(size)) for size in (200, 40_000, 200, 40_000)]
        finally:
            conn.close()
    assert [status for status, _, _ in answers] == [200] * 4, answers
