"""Generated hostile requests against a real router and real nodes (hypothesis): odd paths and model
names, encoded slashes, hostile hint headers (huge, negative, NaN, text priorities and deadlines,
unknown sites, control characters), malformed binary framing, random JSON, tensors whose shapes and
data disagree, deep nesting, huge numbers, random bytes. Every request gets one answer and none is a
500 or 502; afterwards every process is alive, no node is ejected, and valid requests succeed on
every node, directly and through the router, from every site.

`make test` runs a slice (EDGEROUTE_FUZZ_EXAMPLES, default 300, deterministic); `make fuzz` runs
10,000 with a fresh seed each time."""

from __future__ import annotations

import http.client
import json
import os
import re
from typing import Any
from urllib.parse import urlsplit

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from scenarios.stack.launcher import Stack
from telemetry.oip import wire
from tests.integration.http import call, infer_body

EXAMPLES = int(os.environ.get("EDGEROUTE_FUZZ_EXAMPLES", "300"))
RANDOM = bool(os.environ.get("EDGEROUTE_FUZZ_RANDOM"))
MODELS = ["sensor_mlp", "echo", "mobilenet_s"]
# what a hostile request may get: its own fault (4xx), overload or no time (503, 504), or success
ALLOWED = {200, 400, 401, 403, 404, 405, 409, 413, 415, 429, 431, 503, 504}

numbers = st.one_of(
    st.integers(min_value=-(10**30), max_value=10**30).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["nan", "inf", "-inf", "1e400", "-1e400", "0x10", "", " ", "1_000", "9" * 5000, "true", "[]"]),
    st.text(max_size=20),
)
names = st.one_of(
    st.sampled_from(MODELS),
    st.sampled_from(["..", ".", "%2e%2e", "x%2F..%2F..%2Fadmin%2Fstats", "sensor_mlp%00", "a" * 300, "%", "%ZZ"]),
    st.text(alphabet=st.characters(codec="ascii", exclude_characters="/?#"), min_size=1, max_size=40),
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
    max_leaves=20,
)
datatypes = st.sampled_from(["FP32", "FP16", "FP64", "INT64", "INT8", "UINT8", "BOOL", "BYTES", "fp32", "X", ""])


@st.composite
def tensors(draw: st.DrawFn) -> dict[str, Any]:
    shape = draw(
        st.one_of(
            st.lists(st.integers(min_value=-3, max_value=8), max_size=4),
            st.just([2**60, 16]),
            st.just([0, 4]),
            st.lists(st.integers(min_value=-(2**63), max_value=2**64), max_size=3),
            json_values,
        )
    )
    data = draw(st.one_of(st.lists(st.floats(allow_nan=True), max_size=40), json_values, st.just([1.0] * 4)))
    out: dict[str, Any] = {"name": draw(st.sampled_from(["readings", "x", "input", ""])), "shape": shape}
    out["datatype"] = draw(datatypes)
    out["data"] = data
    if draw(st.booleans()):
        out["parameters"] = draw(json_values)
    return out


@st.composite
def bodies(draw: st.DrawFn) -> tuple[bytes, dict[str, str]]:
    kind = draw(st.sampled_from(["valid", "tensors", "json", "bytes", "deep", "bignum", "binary", "empty"]))
    headers: dict[str, str] = {}
    if kind == "valid":
        body = infer_body()
    elif kind == "tensors":
        doc: dict[str, Any] = {"inputs": draw(st.lists(tensors(), max_size=3))}
        if draw(st.booleans()):
            doc["outputs"] = draw(json_values)
        if draw(st.booleans()):
            doc["id"] = draw(st.text(max_size=40))
        if draw(st.booleans()):
            doc["parameters"] = {"priority": draw(json_values), "deadline_ms": draw(json_values)}
        body = json.dumps(doc).encode()
    elif kind == "json":
        body = json.dumps(draw(json_values)).encode()
    elif kind == "bytes":
        body = draw(st.binary(max_size=512))
    elif kind == "deep":
        depth = draw(st.integers(min_value=100, max_value=100_000))
        body = b"[" * depth + b"]" * depth
    elif kind == "bignum":
        body = (
            b'{"inputs":[{"name":"readings","shape":[1,'
            + b"9" * draw(st.integers(1, 20_000))
            + b'],"datatype":"FP32","data":[1]}]}'
        )  # noqa: E501
    elif kind == "binary":
        size = draw(st.integers(-5, 64))
        tensor = {"name": "readings", "shape": [1, 4], "datatype": "FP32", "parameters": {"binary_data_size": size}}
        header = json.dumps({"inputs": [tensor]}).encode()
        tail = draw(st.binary(max_size=64))
        headers[wire.HEADER_LENGTH] = draw(st.one_of(st.just(str(len(header))), numbers))
        body = header + tail
    else:
        body = b""
    return body, headers


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, str, str, bytes, dict[str, str]]:
    target = draw(st.sampled_from(["router", "router", "node"]))
    model = draw(names)
    route = draw(st.sampled_from(["infer", "infer", "infer", "version", "meta", "ready", "load"]))
    version = draw(st.one_of(st.just("1"), names))
    path = {
        "infer": f"/v2/models/{model}/infer",
        "version": f"/v2/models/{model}/versions/{version}/infer",
        "meta": f"/v2/models/{model}",
        "ready": f"/v2/models/{model}/ready",
        "load": f"/v2/repository/models/{model}/load",
    }[route]
    method = "GET" if route in ("meta", "ready") else draw(st.sampled_from(["POST", "POST", "POST", "PUT", "DELETE"]))
    body, headers = draw(bodies())
    hints = {
        wire.PRIORITY: numbers,
        wire.DEADLINE_MS: numbers,
        wire.SITE: st.one_of(st.sampled_from(["edge-a", "cloud", "mars"]), st.text(max_size=300)),
        wire.REQUEST_ID: st.text(max_size=80),
        "Content-Type": st.sampled_from(["application/json", "application/octet-stream", "text/plain", "x/y"]),
    }
    for header, strategy in hints.items():
        if draw(st.booleans()):
            headers[header] = draw(strategy)
    # what http.client cannot put on the wire (CR, LF, NUL, non-Latin-1) is left out
    headers = {k: v for k, v in headers.items() if v.isprintable() and v.isascii()}
    return target, method, path, body, headers


class Targets:
    def __init__(self, stack: Stack) -> None:
        self.urls = {"router": stack.router_url, "node": next(iter(stack.nodes.values())).url}
        self.conns: dict[str, http.client.HTTPConnection] = {}
        self.sent = 0

    def close(self) -> None:
        for conn in self.conns.values():
            conn.close()
        self.conns.clear()

    def send(self, target: str, method: str, path: str, body: bytes, headers: dict[str, str]) -> int | None:
        """The answer's status, or None for a request http.client will not put on the wire."""
        parts = urlsplit(self.urls[target])
        for attempt in range(2):
            conn = self.conns.get(target)
            if conn is None:
                conn = self.conns[target] = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=15)
            try:
                conn.putrequest(method, path, skip_accept_encoding=True)
            except (http.client.InvalidURL, ValueError, UnicodeError):
                conn.close()
                self.conns.pop(target, None)
                return None
            try:
                for name, value in headers.items():
                    conn.putheader(name, value)
                conn.putheader("Content-Length", str(len(body)))
                conn.endheaders(body)
                resp = conn.getresponse()
                resp.read()
                if resp.will_close:
                    conn.close()
                    self.conns.pop(target, None)
                self.sent += 1
                return resp.status
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                # a keep-alive connection the server closed after the previous answer: once more, fresh
                conn.close()
                self.conns.pop(target, None)
                if attempt:
                    raise
        raise AssertionError("unreachable")


def test_hostile_requests_hurt_no_one(own_stack: Any) -> None:
    stack: Stack = own_stack(
        [
            {"id": "e1", "partition": "edge-a", "models": MODELS},
            {"id": "c1", "partition": "cloud", "tier": "cloud", "slots": 2, "models": MODELS},
        ],
        router={"max_body_bytes": 1 << 20, "outlier": {"consecutive": 3}},
    )
    targets = Targets(stack)
    seen: dict[int, int] = {}

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=not RANDOM,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(requests())
    def attack(req: tuple[str, str, str, bytes, dict[str, str]]) -> None:
        target, method, path, body, headers = req
        status = targets.send(target, method, path, body, headers)
        assume(status is not None)
        assert status is not None
        seen[status] = seen.get(status, 0) + 1
        assert status in ALLOWED, (status, target, method, path, body[:300], headers)

    try:
        attack()
    finally:
        targets.close()
    print(f"fuzz: {targets.sent} requests, statuses {dict(sorted(seen.items()))}")
    assert targets.sent >= EXAMPLES

    # nobody died, nobody was ejected, and valid requests succeed everywhere
    assert stack.router is not None and stack.router.popen.poll() is None
    for proc in stack.nodes.values():
        assert proc.popen.poll() is None, proc.name
    status, view, _ = call(f"{stack.router_url}/admin/view", headers=stack.admin_headers)
    assert status == 200 and view["health"]["ejected_now"] == [], view["health"]
    for proc in stack.nodes.values():
        for model in MODELS:
            meta = call(f"{proc.url}/v2/models/{model}")[1]
            shape = [1, *(d if d > 0 else 1 for d in meta["inputs"][0]["shape"][1:])]
            n = 1
            for d in shape:
                n *= d
            body = infer_body(meta["inputs"][0]["name"], shape, data=[0.5] * n)
            assert call(f"{proc.url}/v2/models/{model}/infer", body)[0] == 200, (proc.name, model)
            for site in ("edge-a", "cloud"):
                status, doc, hdrs = call(f"{stack.router_url}/v2/models/{model}/infer", body, headers={wire.SITE: site})
                assert status == 200, (model, site, doc)


@pytest.mark.parametrize(
    "raw",
    [
        b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n" + b"X-Long: " + b"a" * 20_000 + b"\r\n\r\n",
        b"POST /v2/models/echo/infer HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
        b"POST /v2/models/echo/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"GARBAGE\r\n\r\n",
        b"GET /v2/models/ech\x00o HTTP/1.1\r\nHost: x\r\n\r\n",
    ],
)
def test_malformed_http_gets_a_4xx_and_the_router_lives(own_stack: Any, raw: bytes) -> None:
    import socket

    stack: Stack = own_stack([{"id": "e1", "partition": "edge-a", "models": ["echo"]}])
    for url in (stack.router_url, next(iter(stack.nodes.values())).url):
        parts = urlsplit(url)
        with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
            sock.sendall(raw)
            answer = sock.recv(4096)
        assert re.match(rb"HTTP/1\.[01] 4\d\d ", answer), answer[:200]
    assert call(f"{stack.router_url}/v2/health/live")[0] == 200
