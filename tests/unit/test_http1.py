"""The router's HTTP/1.1 answer parser (router.http1) fed bytes directly: whole, split at every byte,
chunked, and generated mutations, which must end in an answer or a NodeBadAnswer/NodeUnavailable on the
caller's future, never another exception. Sockets, pools and timeouts: tests/integration/test_http1.py."""

from __future__ import annotations

import asyncio
import random

import pytest

from router.http1 import MAX_HEAD, HttpReply, _Connection
from router.node_client import NodeBadAnswer, NodeUnavailable


class Wire:
    """Where the connection writes (the socket's place; the parser is what is under test)."""

    def __init__(self) -> None:
        self.sent = b""
        self.closed = False

    def write(self, data: bytes) -> None:
        self.sent += data

    def close(self) -> None:
        self.closed = True

    abort = close

    def get_extra_info(self, name: str, default: object = None) -> object:
        return default  # (no socket: nothing to poll)

    def is_closing(self) -> bool:
        return self.closed


def feed(pieces: list[bytes], max_body: int = 1 << 20, lose: bool = False) -> tuple[HttpReply | Exception, _Connection]:
    loop = asyncio.new_event_loop()
    try:
        conn = _Connection(max_body, (NodeBadAnswer, NodeUnavailable))
        conn.connection_made(Wire())  # type: ignore[arg-type]
        waiter: asyncio.Future[HttpReply] = loop.create_future()
        conn.exchange(b"POST / HTTP/1.1\r\n\r\n", b"", waiter)
        for piece in pieces:
            if waiter.done():
                break
            conn.data_received(piece)
        if lose and not waiter.done():
            conn.connection_lost(None)
        if not waiter.done():
            return NodeUnavailable("incomplete"), conn
        exc = waiter.exception()
        return (exc if exc is not None else waiter.result()), conn
    finally:
        loop.close()


OK = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Edgeroute-Node: n1\r\nContent-Length: 11\r\n\r\n"
    b'{"ok":true}'
)
CHUNKED = (
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: application/json\r\n\r\n"
    b'4;ext=1\r\n{"ok\r\n7\r\n":true}\r\n0\r\nTrailer: x\r\n\r\n'
)


@pytest.mark.parametrize("raw", [OK, CHUNKED], ids=["length", "chunked"])
def test_an_answer_reads_whole_and_split_at_every_byte(raw: bytes) -> None:
    whole, conn = feed([raw])
    assert isinstance(whole, HttpReply) and whole.status == 200 and whole.body == b'{"ok":true}'
    assert whole.headers["content-type"] == "application/json" and conn.reusable
    for cut in range(1, len(raw)):
        split, _ = feed([raw[:cut], raw[cut:]])
        assert isinstance(split, HttpReply) and split.body == whole.body, cut
    bytewise, _ = feed([raw[i : i + 1] for i in range(len(raw))])
    assert isinstance(bytewise, HttpReply) and bytewise.body == whole.body


def test_informational_answers_are_skipped_and_close_is_honoured() -> None:
    got, conn = feed([b"HTTP/1.1 100 Continue\r\n\r\n" + OK.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n", 1)])
    assert isinstance(got, HttpReply) and got.status == 200 and not conn.reusable


def test_an_answer_without_a_length_is_read_to_the_close() -> None:
    got, conn = feed([b"HTTP/1.0 503 Busy\r\n\r\n", b"try later"], lose=True)
    assert isinstance(got, HttpReply) and got.status == 503 and got.body == b"try later" and not conn.reusable


BAD = {
    "not http": b"SSH-2.0-OpenSSH\r\n\r\n",
    "unicode digits in the status": "HTTP/1.1 ²00 OK\r\n\r\n".encode("latin-1"),
    "status under 100": b"HTTP/1.1 099 x\r\nContent-Length: 0\r\n\r\n",
    "switching protocols": b"HTTP/1.1 101 Switching\r\n\r\n",
    "header without a colon": b"HTTP/1.1 200 OK\r\nbroken\r\n\r\n",
    "space before the colon": b"HTTP/1.1 200 OK\r\nContent-Length : 1\r\n\r\nx",
    "negative length": b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
    "length over the limit": b"HTTP/1.1 200 OK\r\nContent-Length: 2000000\r\n\r\n",
    "huge length": b"HTTP/1.1 200 OK\r\nContent-Length: 99999999999999999999999\r\n\r\n",
    "other transfer coding": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n",
    "bad chunk size": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    # (llhttp does not tell its caller a chunk's announced size: the limit holds on the data as it comes)
    "chunks over the limit": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nFFFFFFF\r\n"
    + b"x" * (1 << 20)
    + b"x",
    "chunk without its CRLF": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nxyz",
    "head over the limit": b"HTTP/1.1 200 OK\r\n" + b"X-A: " + b"a" * MAX_HEAD,
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_what_is_not_a_good_answer_is_a_bad_answer(name: str) -> None:
    got, conn = feed([BAD[name]])
    assert isinstance(got, NodeBadAnswer), got
    assert not conn.reusable and conn.transport.is_closing()  # type: ignore[union-attr]


def test_a_connection_lost_mid_answer_is_unavailable() -> None:
    got, _ = feed([OK[:-4]], lose=True)
    assert isinstance(got, NodeUnavailable)


def test_bytes_nobody_asked_for_end_the_connection() -> None:
    conn = _Connection(1 << 20, (NodeBadAnswer, NodeUnavailable))
    conn.connection_made(Wire())  # type: ignore[arg-type]
    conn.data_received(OK)
    assert not conn.reusable and conn.transport.is_closing()  # type: ignore[union-attr]


def test_generated_answers_end_in_an_answer_or_a_node_error() -> None:
    rng = random.Random(3)
    for _ in range(4000):
        data = bytearray(rng.choice([OK, CHUNKED, BAD["bad chunk size"]]))
        for _ in range(rng.randrange(1, 6)):
            at = rng.randrange(len(data))
            data[at : at + 1] = bytes([rng.randrange(256)]) * rng.choice([0, 1, 1, 1, 3])
        cut = sorted(rng.sample(range(1, len(data)), min(3, len(data) - 1)))
        pieces = [bytes(data[a:b]) for a, b in zip([0, *cut], [*cut, len(data)], strict=True)]
        got, _ = feed(pieces, max_body=4096, lose=rng.random() < 0.5)
        assert isinstance(got, HttpReply | NodeBadAnswer | NodeUnavailable), type(got)
        if isinstance(got, HttpReply):
            assert 100 <= got.status <= 999 and len(got.body) <= 4096
