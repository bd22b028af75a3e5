"""Slow clients at the native data plane (router.dataplane): a request head, a body or a gRPC message
that stops arriving is answered 408 (gRPC: DEADLINE_EXCEEDED) by the proxy, the head after the
router's `idle_timeout_s` and the body after its `body_timeout_s`, as the router answers it alone, and
holds up no other client meanwhile."""

from __future__ import annotations

import http.client
import json
import socket
import time
from collections.abc import Iterator

import pytest

from router.dataplane.haproxy import retry_body_bytes
from router.dataplane.proxy import find_binary, install_hint
from router.dataplane.settings import DataPlaneConfig
from scenarios.stack.launcher import Stack
from tests.integration.http import infer_body
from tests.integration.test_data_plane import ROUTER, TOKENS, _stack, _until, _view, call

if find_binary(None) is None:
    pytest.skip(f"no HAProxy here: {install_hint()}", allow_module_level=True)

pytest.importorskip("h2")
import h2.config  # noqa: E402
import h2.connection  # noqa: E402
import h2.events  # noqa: E402
import h2.exceptions  # noqa: E402

grpc = pytest.importorskip("grpc")
from tests.integration.test_data_plane_grpc import INFER, _call, _meta, _request  # noqa: E402

CAMS = {"Authorization": f"Bearer {TOKENS['cams']}"}  # (its own: other tests' clients add to theirs)
IDLE_S, BODY_S = 5, 1  # the head's time and the body's after it (the router's settings, which the proxy takes)
INFER_PATH = "/v2/models/sensor_mlp/infer"


@pytest.fixture(scope="module")
def slow(broker, tmp_path_factory):  # type: ignore[no-untyped-def]
    router = {**ROUTER, "idle_timeout_s": IDLE_S, "body_timeout_s": BODY_S}
    stack = _stack(broker, tmp_path_factory.mktemp("dataplane-slow"), router)
    try:
        _until(lambda: "sensor_mlp" in (_view(stack)["data_plane"] or {}).get("models", []), 10.0)
        _until(lambda: _view(stack)["data_plane"]["grpc"] is not None, 5.0)
        yield stack
    finally:
        stack.stop()


OPEN: list[socket.socket] = []  # every stalled client's socket, closed after each test however it ends


@pytest.fixture(autouse=True)
def _close_stalled() -> Iterator[None]:
    yield
    while OPEN:
        OPEN.pop().close()


def _address(url: str) -> tuple[str, int]:
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    return host, int(port)


class Stalled:
    """An HTTP/1.1 client that sends `data` (part of a request) and no more."""

    def __init__(self, url: str, data: bytes) -> None:
        self.sock = socket.create_connection(_address(url), timeout=IDLE_S + 10)
        OPEN.append(self.sock)
        self.sock.sendall(data)
        self.began = time.monotonic()

    def answer(self, closed_within_s: float = 5.0) -> tuple[int, dict[str, str], bytes, float, bool]:
        """(status, headers, body, seconds from the last byte sent to the answer, whether the connection
        was closed within `closed_within_s` after it: the rest of the request never came, so it cannot
        carry another)."""
        try:
            answer = http.client.HTTPResponse(self.sock)
            answer.begin()
            body = answer.read()
            took = time.monotonic() - self.began
            closed = False
            if closed_within_s > 0:
                self.sock.settimeout(closed_within_s)
                try:
                    closed = self.sock.recv(1) == b""
                except TimeoutError:
                    closed = False
        finally:
            self.sock.close()
        headers = {k.lower(): v for k, v in answer.getheaders()}
        return answer.status, headers, body, took, closed


def _head(length: int) -> bytes:
    return (
        f"POST {INFER_PATH} HTTP/1.1\r\nHost: edge\r\nAuthorization: {CAMS['Authorization']}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


class StalledGrpc:
    """A gRPC client (HTTP/2, h2c) that sends a ModelInfer call's headers and `data` of its message,
    and no more."""

    def __init__(self, target: str, data: bytes) -> None:
        host, port = target.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=IDLE_S + 10)
        OPEN.append(self.sock)
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.conn.initiate_connection()
        self.conn.send_headers(
            1,
            [
                (":method", "POST"),
                (":scheme", "http"),
                (":path", INFER),
                (":authority", target),
                ("content-type", "application/grpc"),
                ("te", "trailers"),
                ("authorization", CAMS["Authorization"]),
            ],
        )
        self.conn.send_data(1, data)
        self.sock.sendall(self.conn.data_to_send())
        self.began = time.monotonic()

    def answer(self) -> tuple[dict[str, str], float]:
        """(the answer's headers and trailers, seconds from the last byte sent to its end)."""
        seen: dict[str, str] = {}
        try:
            ended = False
            while not ended:
                data = self.sock.recv(65536)
                if not data:
                    break
                for event in self.conn.receive_data(data):
                    if isinstance(event, (h2.events.ResponseReceived, h2.events.TrailersReceived)):
                        seen.update(dict(event.headers))  # type: ignore[arg-type]
                    ended = ended or isinstance(event, (h2.events.StreamEnded, h2.events.StreamReset))
                self.sock.sendall(self.conn.data_to_send())
        finally:
            self.sock.close()
        return seen, time.monotonic() - self.began


def test_a_stalled_body_gets_the_routers_408_and_holds_up_no_one(slow: Stack) -> None:
    body = infer_body()
    url = slow.router_url  # (the proxy's door)
    native = [Stalled(url, _head(len(body) + 10) + body) for _ in range(8)]  # a body carried natively
    big = retry_body_bytes(DataPlaneConfig()) + 1000
    routed = Stalled(url, _head(big) + body)  # one over the retry limit: the router reads it
    alone = Stalled(slow.router.url, _head(len(body) + 10) + body)  # the router alone, for its answer
    # meanwhile, everyone else is answered
    for _ in range(5):
        status, doc, headers = call(f"{url}{INFER_PATH}", body, headers=CAMS)
        assert status == 200 and headers.get("x-edgeroute-data-plane") == "native", doc
    want_status, _, want_body, _, _ = alone.answer()
    assert want_status == 408
    want = json.loads(want_body)
    assert want == {"error": f"request body not received within {BODY_S} s"}
    for stalled in [*native, routed]:
        status, headers, answer, took, closed = stalled.answer(5.0 if stalled is not routed else 0.0)
        # the body's own time, not the head's (the proxy's timer for a head is IDLE_S)
        assert (status, json.loads(answer)) == (408, want) and took < IDLE_S - 1, (headers, answer, took)
        # the proxy ends a connection whose body it stopped waiting for; one whose body the router
        # stopped waiting for it tells to close (HAProxy 2.6 drains what remains of that request until
        # its client timer)
        assert closed or (stalled is routed and headers.get("connection") == "close"), headers


def test_a_stalled_head_gets_408_after_the_head_time(slow: Stack) -> None:
    stalled = Stalled(slow.router_url, f"POST {INFER_PATH} HTTP/1.1\r\nHost: edge\r\n".encode())
    status, doc, _ = call(f"{slow.router_url}{INFER_PATH}", infer_body(), headers=CAMS)
    assert status == 200, doc
    status, _, _, took, closed = stalled.answer()
    # (the page is HAProxy's own: its 2.6 HTTP/1 layer answers a head it never got with its built-in one)
    assert status == 408 and took > IDLE_S - 1 and closed


def _prefix(length: int) -> bytes:
    return b"\x00" + length.to_bytes(4, "big")


@pytest.mark.parametrize("part", ["first bytes", "most of it"])
def test_a_stalled_grpc_message_gets_deadline_exceeded_and_holds_up_no_one(slow: Stack, part: str) -> None:
    target = slow.router.dataplane_grpc  # type: ignore[union-attr]
    assert target
    message = _request(rows=8)
    # the first bytes only: the door cannot yet read the model's name; most of it: the name read, the
    # model's backend holds the message for its retries and waits for the rest
    data = _prefix(len(message))[:3] if part == "first bytes" else _prefix(len(message)) + message[:-16]
    stalled = [StalledGrpc(target, data) for _ in range(4)]
    for _ in range(3):
        code, details, how = _call(target, _request(), _meta(CAMS), timeout=5.0)
        assert (code, how) == (grpc.StatusCode.OK, "native"), details
    for call_ in stalled:
        seen, took = call_.answer()
        assert seen.get("grpc-status") == str(grpc.StatusCode.DEADLINE_EXCEEDED.value[0]), seen
        assert seen.get("grpc-message") == f"request body not received within {BODY_S} s", seen
        assert took < IDLE_S - 1, took


def test_a_silent_connection_to_either_door_is_closed_after_the_idle_time(slow: Stack) -> None:
    """A connection that sends nothing (or, to the gRPC door, only HTTP/2's preface) holds a slot of the
    proxy's for the router's `idle_timeout_s`, as at the router's own doors, not the proxy's 60 s."""
    target = slow.router.dataplane_grpc  # type: ignore[union-attr]
    assert target
    host, port = target.rsplit(":", 1)
    doors = [
        (_address(slow.router_url), b""),
        ((host, int(port)), b""),
        ((host, int(port)), b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"),
    ]
    silent = []
    for addr, data in doors:
        sock = socket.create_connection(addr, timeout=IDLE_S + 10)
        OPEN.append(sock)
        sock.sendall(data)
        silent.append((sock, time.monotonic()))
    for sock, began in silent:
        while sock.recv(4096):  # (HTTP/2's SETTINGS and GOAWAY come before the close)
            pass
        assert time.monotonic() - began < IDLE_S + 5, sock
